"""Damaged or changed data: every case is a one-line error naming the file or record,
before anything trains, and never a run on different data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fault_harness import error_line, run_cli, smoke_config, split_file

from jattn import data
from jattn.data.integrity import DataIntegrityError
from jattn.data.tasks import TextSource
from jattn.train import ConfigError, train_and_evaluate


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("split", ["train", "validation"])
def test_a_truncated_split_is_refused_naming_the_file(data_dir, tmp_path, split):
    path = split_file(data_dir, split)
    _truncate(path)
    with pytest.raises(DataIntegrityError, match=f"data file {path}"):
        data.load("copy/tiny", data_dir=str(data_dir))
    with pytest.raises(ConfigError, match=str(path)) as e:
        train_and_evaluate(smoke_config(data_dir), str(tmp_path / "run"))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # refused before the workdir was made


def test_swapped_shards_are_refused(data_dir):
    train, validation = split_file(data_dir, "train"), split_file(data_dir, "validation")
    tmp = train.with_suffix(".swap")
    train.rename(tmp)
    validation.rename(train)
    tmp.rename(validation)
    with pytest.raises(DataIntegrityError, match="damaged or replaced"):
        data.load("copy/tiny", data_dir=str(data_dir))


def test_a_missing_data_file_is_named(data_dir):
    path = split_file(data_dir, "train")
    path.unlink()
    with pytest.raises(DataIntegrityError, match=f"data file {path} is missing"):
        data.load("copy/tiny", data_dir=str(data_dir))


def test_data_damaged_before_its_first_read_is_refused_too(data_dir):
    """Data prepared before manifests existed: the record counts of dataset_info.json
    still catch a truncated shard (the manifest is only written for intact data)."""
    path = split_file(data_dir, "train")
    (path.parent / "jattn_integrity.json").unlink()
    _truncate(path)
    with pytest.raises(DataIntegrityError, match=str(path)):
        data.load("copy/tiny", data_dir=str(data_dir))
    assert not (path.parent / "jattn_integrity.json").exists()


def test_a_truncated_dataset_info_is_one_line(data_dir, tmp_path, cli_env):
    (info,) = (Path(data_dir) / "jattn_copy" / "tiny").glob("*/dataset_info.json")
    info.write_text(info.read_text()[:200])
    with pytest.raises(DataIntegrityError, match="dataset_info.json"):
        data.load("copy/tiny", data_dir=str(data_dir))
    proc = run_cli(tmp_path / "run", data_dir, cli_env)
    assert proc.returncode == 2
    assert "dataset_info.json" in error_line(proc.stderr)


class _Records:
    """A data source of decoded records, one of them with a missing feature."""

    def __init__(self, records):
        self._records = records

    def __len__(self):
        return len(self._records)

    def __getitem__(self, i):
        return self._records[i]


def test_a_missing_feature_is_an_error_naming_the_record_not_the_text_none():
    source = TextSource(
        _Records([{"inputs": b"ab", "targets": b"ab"}, {"inputs": b"cd", "targets": None}]),
        "inputs",
        "targets",
    )
    assert source[0] == {"inputs": "ab", "targets": "ab"}
    with pytest.raises(DataIntegrityError, match="feature 'targets' is missing in record 1"):
        source[1]
    with pytest.raises(DataIntegrityError, match="record 1"):
        source.__getitems__([0, 1])


def _vocab_file(data_dir) -> Path:
    (path,) = (Path(data_dir) / "jattn_vocab").rglob("char.json")
    return path


def test_an_edited_vocabulary_cache_is_refused(data_dir):
    path = _vocab_file(data_dir)
    chars = json.loads(path.read_text())["chars"]
    path.write_text(json.dumps({"chars": chars[1:]}))  # one character removed
    with pytest.raises(ValueError, match="was changed after it was learned"):
        data.load("copy/tiny", data_dir=str(data_dir))


def test_resuming_with_another_vocabulary_order_is_refused(data_dir, reference, tmp_path):
    """The same characters in another order (cache and its hash both rewritten, as a
    rebuilt cache would be): the run's signature holds the vocabulary's hash."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    (run / "final_metrics.json").unlink()
    path = _vocab_file(data_dir)
    chars = json.loads(path.read_text())["chars"]
    tok = data.CharTokenizer(list(reversed(chars)))
    tok.save(str(path))
    from jattn.data.tokenizers import vocab_hash

    Path(str(path) + ".sha256").write_text(vocab_hash(tok))
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="tokenizer vocabulary: checkpoint sha256:"):
        train_and_evaluate(smoke_config(data_dir), str(run))
    assert (run / "metrics.jsonl").read_text() == before
