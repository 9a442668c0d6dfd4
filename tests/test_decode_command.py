"""`jattn decode` and self-contained runs: the workdir keeps its tokenizer, and
`load_run` + `jattn decode` decode with the run's own settings.

One real tiny run (configs/smoke.py, a few steps, no evaluation) for the module.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from jattn import cli
from jattn.train import apply_overrides, load_config, load_run, train_and_evaluate

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "smoke.py")
TEXTS = ("abc", "hello")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("decode_run")
    config = apply_overrides(load_config(SMOKE), [("num_train_steps", "6"), ("eval_splits", "()")])
    train_and_evaluate(config, str(workdir))
    return workdir


def test_the_workdir_keeps_the_tokenizer_and_load_run_returns_it(run_dir, tmp_path):
    from jattn import data
    from jattn.data.tokenizers import CharTokenizer

    entry = json.loads((run_dir / "tokenizer.json").read_text())
    assert entry == {"kind": "char", "file": "tokenizer.chars.json"}
    run = load_run(str(run_dir))
    assert isinstance(run.tokenizer, CharTokenizer)
    assert run.tokenizer.chars == data.load("copy/tiny").tokenizer.chars
    # The saved copy is what load_run reads (not the data set's cache).
    moved = tmp_path / "run"
    shutil.copytree(run_dir, moved)
    (moved / "tokenizer.chars.json").write_text(json.dumps({"chars": ["x", "y"]}))
    assert load_run(str(moved)).tokenizer.chars == ("x", "y")


def expected(run, method: str) -> list[str]:
    from jattn.models import decoding
    from jattn.train.evaluation import ids_to_text

    encoded = [run.tokenizer.encode(t) for t in TEXTS]
    inputs = np.zeros((len(TEXTS), max(map(len, encoded))), np.int32)
    for i, ids in enumerate(encoded):
        inputs[i, : len(ids)] = ids
    length = run.config.eval_max_len
    if method == "beam":
        out = decoding.beam_search(
            run.model,
            run.params,
            inputs,
            max_length=length,
            beam_size=run.config.beam_size,
            alpha=run.config.beam_alpha,
        )
    else:
        out = decoding.greedy(run.model, run.params, inputs, max_length=length)
    return [ids_to_text(run.tokenizer, row) for row in np.asarray(out)]


def test_decode_command_prints_the_runs_greedy_and_beam_outputs(run_dir, capsys):
    run = load_run(str(run_dir))
    assert run.config.decode == "greedy"
    assert cli.main(["decode", "--workdir", str(run_dir), *TEXTS]) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == expected(run, "greedy")
    assert cli.main(["decode", "--workdir", str(run_dir), "--decode", "beam", *TEXTS]) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == expected(run, "beam")


def test_decode_command_prints_no_orbax_metadata_warning(run_dir, caplog, capsys):
    """`load_run` reads the saved state's own metadata: absl's "Metadata file does not
    exist: .../_CHECKPOINT_METADATA" warning (a step file orbax looks for beside an
    item) is not printed before the outputs."""
    with caplog.at_level(logging.INFO):
        assert cli.main(["decode", "--workdir", str(run_dir), "abc"]) == 0
    assert capsys.readouterr().out.count("\n") == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in warned if "Metadata file does not exist" in m], warned


def test_decode_command_fails_in_one_line(tmp_path, capsys):
    assert cli.main(["decode", "--workdir", str(tmp_path), "abc"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("jattn decode: error:") and "no config.json" in err


def test_characters_outside_the_vocabulary_are_reported(run_dir, capsys):
    """Before (issue 54): read as the unknown token and decoded with no word. Now one
    warning line for each text that has some, naming them; the output is unchanged."""
    run = load_run(str(run_dir))
    unknown = sorted({"é", "✓"} - set(run.tokenizer.chars))
    assert unknown == ["é", "✓"]
    texts = ("abc", "hé✓lloé")
    assert cli.main(["decode", "--workdir", str(run_dir), *texts]) == 0
    out = capsys.readouterr()
    assert len(out.out.split("\n")[:-1]) == 2
    assert out.err.strip().splitlines() == [
        "warning: input 2 ('hé✓lloé') has 3 characters outside the run's vocabulary: "
        "'é', '✓'; they are read as the unknown token (\u2047)"
    ]


def _old_spelling(model: dict) -> dict:
    """A model config as jattn wrote it before the schemes carried their options:
    each option a flat field (`jattn.models.config.RENAMED`)."""
    from jattn.models.config import RENAMED

    model = dict(model)
    options = model.pop("position_options")
    for old, (path, *_) in RENAMED.items():
        value = options
        for part in path.split("."):
            value = value[part]
        model[old] = value
    return model


def test_a_workdir_saved_in_the_old_spelling_decodes_and_resumes(run_dir, tmp_path, capsys):
    """A run saved before `position_options` (flat `rope_scaling`, `t5_num_buckets`,
    ... in model_config.json, config.json and the checkpoint's meta) loads with
    the same model config, decodes (also with --rope-scaling, which sets the new
    key) and continues training under today's config."""
    old = tmp_path / "old"
    shutil.copytree(run_dir, old)
    model_config = old / "model_config.json"
    model_config.write_text(json.dumps(_old_spelling(json.loads(model_config.read_text()))))
    config = json.loads((old / "config.json").read_text())
    config["model"] = _old_spelling(config["model"])
    (old / "config.json").write_text(json.dumps(config))
    metas = sorted(old.glob("**/meta/metadata"))
    assert metas
    for path in metas:
        meta = json.loads(path.read_text())
        meta["config"]["model"] = _old_spelling(meta["config"]["model"])
        meta["signature"]["model"] = _old_spelling(meta["signature"]["model"])
        path.write_text(json.dumps(meta))
    assert "rope_scaling" in json.loads(model_config.read_text())

    with pytest.warns(DeprecationWarning, match="rope_scaling as position_options.rope.scaling"):
        run = load_run(str(old))
    assert run.model.config == load_run(str(run_dir)).model.config
    args = ["decode", "--workdir", str(old), "--rope-scaling", "yarn", "--rope-scaling-factor", "2"]
    assert cli.main([*args, *TEXTS]) == 0  # a sinusoidal run: RoPE's scaling changes nothing
    assert capsys.readouterr().out.split("\n")[:-1] == expected(run, "greedy")

    longer = [("num_train_steps", "8"), ("eval_splits", "()"), ("allow_schedule_change", "true")]
    config = apply_overrides(load_config(SMOKE), longer)
    train_and_evaluate(config, str(old))  # resumes: the saved flat keys equal today's options
    assert load_run(str(old)).step == 8
    assert "position_options" in json.loads(model_config.read_text())  # rewritten, today's
