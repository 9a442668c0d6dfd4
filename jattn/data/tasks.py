"""`load`: a task by name -> prepared tfds data (array_record), its sources and tokenizer.

Names: "numbers" (German), "numbers/en", "numbers/fr", "numbers/de_tiny", "copy",
"reverse", "copy/tiny", "reverse_digits", "duplicate_digits/small", "kz_copy",
"kz_reverse", "kz_addition" (`kazemnejad.py`), "scan/length", "scan/length_cutoff26"
(`scan.py`), ... (jattn's local builders, see `builders.py`), or any
tfds translation data set such as "wmt14_translate/de-en", whose source and
target keys default to its `supervised_keys`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from google.protobuf import json_format
from tensorflow_datasets.proto import tf_example_pb2

from jattn.data import integrity
from jattn.data import tokenizers as tokenizers_lib
from jattn.data.chomsky import TASKS as CHOMSKY_TASKS
from jattn.data.registry import BUILDERS

_SPLIT_ORDER = ("train", "validation", "test", "test_longer")
_TFDS_COLLECTIONS = ("translate", "text", "summarization")  # imported to find a builder
_TOKENIZER_SAMPLE = 1_000_000  # at most this many training examples teach the vocabulary

# Decoded metrics each task reports (`jattn.train.evaluation`). jattn's own tasks are
# character-level with one-word (or short) outputs, where BLEU's 4-grams make it 0:
# exact match and chrF. Word-level translation (any tfds data set, e.g. wmt14) adds
# sacrebleu BLEU.
CHAR_METRICS = ("exact_match", "chrf")
WORD_METRICS = ("exact_match", "bleu", "chrf")
TASK_METRICS: dict[str, tuple[str, ...]] = {
    "numbers": CHAR_METRICS,
    "copy": CHAR_METRICS,
    "reverse": CHAR_METRICS,
    "reverse_digits": CHAR_METRICS,
    "duplicate_digits": CHAR_METRICS,
    "kz_copy": CHAR_METRICS,
    "kz_reverse": CHAR_METRICS,
    "kz_addition": CHAR_METRICS,
    "kz_copy_rsc": CHAR_METRICS,
    "kz_copy_rsc2x": CHAR_METRICS,
    "kz_copy_rdc": CHAR_METRICS,
    "scan": ("exact_match",),  # the papers' metric; chrF of action words adds nothing
    **dict.fromkeys(CHOMSKY_TASKS, CHAR_METRICS),  # Delétang et al.'s (`chomsky.py`)
}


# Tasks whose tokens are not characters: the tokenizer `load` requires for them.
TASK_TOKENIZERS: dict[str, str] = {"scan": "word"}


def task_metrics(name: str) -> tuple[str, ...]:
    """The decoded metrics of the task `name` ("numbers/en", "wmt14_translate/de-en")."""
    return TASK_METRICS.get(name.partition("/")[0], WORD_METRICS)


class TextSource:
    """Random-access view of a tfds data source as `{"inputs": str, "targets": str}`.

    Batched reads (`__getitems__`) take a fast path where possible: the raw records
    from array_record in one call, parsed as tf.train.Example protos directly (about
    15x faster than tfds' generic decoding). It is used only if it gives the same
    result as tfds on the first record.

    Args:
      data_source: the tfds data source of one split (`builder.as_data_source()[split]`).
      source_key, target_key: feature paths ("de", or "translation/de" when nested).
    """

    def __init__(self, data_source: Any, source_key: str, target_key: str):
        self._data = data_source
        self._source = source_key.split("/")
        self._target = target_key.split("/")
        self._flat_keys = (source_key, target_key)  # tfds flattens nested keys with "/"
        self._fast = False
        if len(data_source):
            try:
                self._fast = self._parse_raw(self._raw_records([0]), [0]) == [self[0]]
            except Exception:  # noqa: BLE001 - any failure: keep tfds' decoding
                self._fast = False

    def __len__(self) -> int:
        return len(self._data)

    def _convert(self, record: Mapping, index: int) -> dict[str, str]:
        out = {}
        for name, path in (("inputs", self._source), ("targets", self._target)):
            try:
                value = _get(record, path)
            except (KeyError, TypeError):
                value = None
            if value is None:  # str(None) would train on the text "None"
                raise integrity.DataIntegrityError(
                    f"feature {'/'.join(path)!r} is missing in "
                    f"{integrity.record_location(self._data, index)}; the data is damaged: "
                    "delete its folder to prepare it again"
                )
            out[name] = _text(value)
        return out

    def _raw_records(self, indices: list[int]) -> list[bytes]:
        records = self._data.data_source.__getitems__(indices)
        if len(records) != len(indices):
            raise IndexError(f"asked for {len(indices)} records, got {len(records)}")
        return records

    def _parse_raw(self, records: list[bytes], indices: list[int]) -> list[dict[str, str]]:
        src, tgt = self._flat_keys
        out = []
        parse = tf_example_pb2.Example.FromString
        for record, index in zip(records, indices, strict=True):
            feature = parse(record).features.feature
            inputs, targets = feature[src].bytes_list.value, feature[tgt].bytes_list.value
            if not (inputs and targets):
                raise integrity.DataIntegrityError(
                    f"feature {src if not inputs else tgt!r} is missing in "
                    f"{integrity.record_location(self._data, index)}; the data is damaged: "
                    "delete its folder to prepare it again"
                )
            out.append({"inputs": inputs[0].decode("utf-8"), "targets": targets[0].decode("utf-8")})
        return out

    def __getitem__(self, index: int) -> dict[str, str]:
        n = len(self._data)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for a split of {n} examples")
        return self._convert(self._data[index % n], index % n)

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, str]]:
        indices = [int(i) for i in indices]
        if self._fast:
            return self._parse_raw(self._raw_records(indices), indices)
        if hasattr(self._data, "__getitems__"):
            records = self._data.__getitems__(indices)
        else:
            records = [self._data[i] for i in indices]
        return [self._convert(r, i) for r, i in zip(records, indices, strict=True)]

    def __iter__(self) -> Iterator[dict[str, str]]:
        for start in range(0, len(self), 1024):
            yield from self.__getitems__(range(start, min(start + 1024, len(self))))

    def __repr__(self) -> str:
        return f"TextSource({self._data!r}, inputs={'/'.join(self._source)!r}, " + (
            f"targets={'/'.join(self._target)!r})"
        )


def _get(record: Mapping, path: list[str]):
    for key in path:
        record = record[key]
    return record


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@dataclasses.dataclass(frozen=True)
class Task:
    """A prepared data set with its tokenizer.

    Attributes:
      name: the name given to `load`.
      tokenizer: `.encode(text) -> list[int]` ending with EOS_ID, `.decode(ids) -> str`,
        `.vocab_size` (PAD=0 and EOS=1 included).
      splits: the split names, e.g. ("train", "validation", "test_longer").
      full_name: the tfds builder's "name/config/version".
      source_key, target_key: the features used as inputs and targets.
      metrics: the decoded metrics evaluation reports for it (`task_metrics`):
        "exact_match", "chrf", and "bleu" for word-level translation.
      vocab_dir: where the vocabulary (and `jattn.data.producibility`'s
        check) is cached; "" for a task built by hand.
    """

    name: str
    tokenizer: tokenizers_lib.Tokenizer
    splits: tuple[str, ...]
    full_name: str = ""
    source_key: str = "inputs"
    target_key: str = "targets"
    metrics: tuple[str, ...] = WORD_METRICS
    vocab_dir: str = ""
    _data_sources: Mapping[str, Any] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )

    def source(self, split: str) -> TextSource:
        """Random-access source of `{"inputs": str, "targets": str}` for `split`."""
        if split not in self._data_sources:
            raise ValueError(f"task {self.name!r} has no split {split!r}; splits: {self.splits}")
        return TextSource(self._data_sources[split], self.source_key, self.target_key)


def make_builder(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    """The tfds builder of a task's data set name ("reverse_digits/small",
    "wmt14_translate/de-en"): jattn's own generating builders by class
    (`jattn.data.registry.BUILDERS`), any other name through `tfds.builder`."""
    base, _, config = name.partition("/")
    if base in BUILDERS:
        cls, default_config = BUILDERS[base]
        config_name, _, version = (config or default_config).partition(":")
        known = [c.name for c in cls.BUILDER_CONFIGS]
        if config_name not in known:
            raise ValueError(
                f"unknown config {config_name!r} in dataset name {name!r}; "
                f"{base!r} has configs {known}"
            )
        return cls(
            data_dir=data_dir,
            config=config_name,
            version=version or None,
            file_format="array_record",
        )
    try:
        return tfds.builder(name, data_dir=data_dir, file_format="array_record")
    except tfds.core.registered.DatasetNotFoundError:
        pass
    # Without TensorFlow, tfds imports its dataset collections lazily, so a builder such
    # as wmt14_translate is only registered once its collection has been imported.
    for collection in _TFDS_COLLECTIONS:
        try:
            importlib.import_module(f"tensorflow_datasets.{collection}")
        except Exception:  # noqa: BLE001, S112 - a collection that cannot load is skipped
            continue
    try:
        return tfds.builder(name, data_dir=data_dir, file_format="array_record")
    except tfds.core.registered.DatasetNotFoundError as e:
        raise ValueError(
            f"unknown dataset name {name!r}: neither a jattn task ({sorted(BUILDERS)}"
            " with an optional '/config') nor a registered tfds dataset"
        ) from e


def resolve_key(info: tfds.core.DatasetInfo, key: str | None, which: str, name: str) -> str:
    """The feature path a task reads as its source or target (`which`, the
    config key's name): `key` (may be nested, "a/b"), or with None the data
    set's supervised key for that side. A one-line ValueError naming the data
    set's features when it has no such feature or no supervised keys."""
    if key is None:
        keys = info.supervised_keys
        if not (
            isinstance(keys, tuple) and len(keys) == 2 and all(isinstance(k, str) for k in keys)
        ):
            raise ValueError(
                f"dataset {name!r} has no (source, target) supervised_keys ({keys!r}); pass "
                f"source_key and target_key (its features: {_feature_paths(info.features)})"
            )
        key = keys[0] if which == "source_key" else keys[1]
    feature = info.features
    for part in key.split("/"):
        if not isinstance(feature, tfds.features.FeaturesDict) or part not in feature:
            raise ValueError(
                f"{which}={key!r} is not a feature of dataset {name!r}; "
                f"its features: {_feature_paths(info.features)}"
            )
        feature = feature[part]
    if not isinstance(feature, tfds.features.Text):
        raise ValueError(
            f"{which}={key!r} of dataset {name!r} is a {type(feature).__name__}, not a Text feature"
        )
    return key


def _feature_paths(feature, prefix: str = "") -> list[str]:
    if isinstance(feature, tfds.features.FeaturesDict):
        out = []
        for k in feature.keys():
            out.extend(_feature_paths(feature[k], f"{prefix}{k}/"))
        return out
    return [prefix.rstrip("/")]


def _ordered_splits(names) -> tuple[str, ...]:
    names = list(names)
    return tuple([s for s in _SPLIT_ORDER if s in names] + sorted(set(names) - set(_SPLIT_ORDER)))


def _check_files(builder: tfds.core.DatasetBuilder) -> None:
    """Verifies the prepared files against their manifest, recording it the first time.

    The manifest is written when the data set is prepared (or first read, for
    data prepared before jattn recorded one); see `jattn.data.integrity`.

    Raises:
      DataIntegrityError: a missing, truncated, swapped or replaced shard, or a
        missing ``dataset_info.json`` (tfds takes the version folder's presence
        for "prepared" and reads the splits from that file: without it the data
        set has no splits at all, and would be refused for an empty 'train'
        split, which says nothing of why).
    """
    directory = os.fspath(builder.data_dir)
    info_path = os.path.join(directory, "dataset_info.json")
    if not os.path.exists(info_path):
        raise integrity.DataIntegrityError(
            f"{info_path} is missing; delete {directory} to prepare it again"
        )
    files = integrity.split_files(builder.info)
    expected = {name: split.num_examples for name, split in builder.info.splits.items()}
    if not os.path.exists(os.path.join(directory, integrity.MANIFEST)):
        missing = [p for paths in files.values() for p in paths if not os.path.exists(p)]
        if missing:
            raise integrity.DataIntegrityError(
                f"data file {missing[0]} is missing; delete {directory} to prepare the data "
                "set again"
            )
        integrity.record(directory, files, expected)
        return
    integrity.verify(directory, files, expected)


def training_texts(source: TextSource, limit: int = _TOKENIZER_SAMPLE) -> Iterator[str]:
    """Inputs and targets of (at most `limit`, a fixed random sample of) the examples."""
    n = len(source)
    if n > limit:
        indices = np.sort(np.random.default_rng(0).choice(n, size=limit, replace=False))
    else:
        indices = np.arange(n)
    for start in range(0, len(indices), 4096):
        for ex in source.__getitems__(indices[start : start + 4096].tolist()):
            yield ex["inputs"]
            yield ex["targets"]


def load(
    name: str,
    *,
    data_dir: str | None = None,
    tokenizer: str = "char",
    vocab_size: int = 8000,
    source_key: str | None = None,
    target_key: str | None = None,
) -> Task:
    """Prepares a data set (once) and returns it as a Task with its tokenizer.

    Args:
      name: "numbers" (German), "numbers/en", "numbers/fr", "numbers/de_tiny", "copy",
        "reverse", "copy/tiny", "reverse/tiny", "reverse_digits", "duplicate_digits"
        (with configs "small" and "tiny"), or any tfds translation data set
        ("wmt14_translate/de-en"); an optional ":version" may follow the config.
      data_dir: tfds data directory (default: $TFDS_DATA_DIR or ~/tensorflow_datasets).
        Prepared data goes to `data_dir/<builder>/<config>/<version>` as array_record;
        vocabularies to `data_dir/jattn_vocab/<builder>/<config>/<version>/`.
      tokenizer: "char", "word" (space-separated words: "scan"), "spm" (SentencePiece
        unigram), "spm_bpe".
      vocab_size: SentencePiece vocabulary size (37000 for the paper's WMT14 en-de);
        ignored by "char".
      source_key, target_key: features used as inputs and targets; default: the data
        set's supervised_keys. Nested features are written "translation/de".

    Returns:
      The Task, reading every split through `builder.as_data_source()`.

    Raises:
      ValueError: unknown name or config, a tokenizer the task cannot use ("scan"
        needs "word"), missing or non-text features, data prepared in
        another file format, an empty train split, a mismatched cached vocabulary.
      DataIntegrityError (a ValueError): damaged prepared data (a missing, truncated,
        swapped or replaced shard, an unreadable dataset_info.json), naming the file.
    """
    required = TASK_TOKENIZERS.get(name.partition("/")[0])
    if required and tokenizer != required:
        raise ValueError(
            f"dataset {name!r} is made of words: load it with tokenizer={required!r} "
            f"(config key `tokenizer`), not {tokenizer!r}"
        )
    try:
        builder = make_builder(name, data_dir)
        info = builder.info
    except json_format.Error as e:  # a damaged dataset_info.json (tfds: 58 lines of protobuf)
        raise integrity.DataIntegrityError(
            f"dataset {name!r}: its dataset_info.json under {data_dir or '~/tensorflow_datasets'} "
            f"cannot be read ({str(e).splitlines()[0]}); delete the data set's folder to prepare "
            "it again"
        ) from None
    source_key = resolve_key(info, source_key, "source_key", name)
    target_key = resolve_key(info, target_key, "target_key", name)
    try:
        builder.download_and_prepare()
    except ModuleNotFoundError as e:
        if e.name != "importlib_resources":
            raise
        raise ValueError(
            f"preparing tfds dataset {name!r} needs the package importlib_resources, which "
            "tfds 4.9 imports but does not install on Python >= 3.9 (pip install "
            "importlib_resources), or prepare it elsewhere as array_record (`tfds build "
            f"{name.partition('/')[0]} --file_format=array_record`) into data_dir"
        ) from e
    except AssertionError as e:  # tfds refuses to write a split without examples
        if "No examples were yielded" not in str(e):
            raise
        raise ValueError(
            f"dataset {name!r} has an empty split, which tfds cannot write: {e}"
        ) from e
    _check_files(builder)
    try:
        data_sources = builder.as_data_source()
    except (NotImplementedError, ValueError) as e:
        raise ValueError(
            f"dataset {name!r} in {builder.data_dir} cannot be read with as_data_source() "
            f"(prepared as {info.file_format}? jattn needs array_record): {e}"
        ) from e
    splits = _ordered_splits(data_sources)
    if "train" not in data_sources or len(data_sources["train"]) == 0:
        raise ValueError(
            f"dataset {name!r} has an empty or missing 'train' split (splits: "
            f"{ {s: len(data_sources[s]) for s in splits} }); the vocabulary is learned from it"
        )
    train = TextSource(data_sources["train"], source_key, target_key)
    cache_dir = os.path.join(os.fspath(builder.data_dir_root), "jattn_vocab", info.full_name)
    tok = tokenizers_lib.get_tokenizer(
        tokenizer,
        vocab_size=vocab_size,
        cache_dir=cache_dir,
        settings={
            "dataset": info.full_name,
            "split": "train",
            "source_key": source_key,
            "target_key": target_key,
            "num_examples": len(train),
        },
        texts=lambda: training_texts(train),
    )
    return Task(
        name=name,
        tokenizer=tok,
        splits=splits,
        full_name=info.full_name,
        source_key=source_key,
        target_key=target_key,
        metrics=task_metrics(name),
        vocab_dir=cache_dir,
        _data_sources=dict(data_sources),
    )
