"""jattn.data: tfds builders, tokenizers, packing, the grain pipeline, orbax resume."""

import collections
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds

import jattn.data as data
from jattn.data import builders, packing, tokenizers
from jattn.data import checkpoint as data_ckpt

tfds.disable_progress_bar()


# ---------------------------------------------------------------------------
# Stand-in corpora with the features of real translation data sets.
# ---------------------------------------------------------------------------


def _pairs(lo, hi):
    from num2words import num2words

    return [(num2words(n, lang="de"), num2words(n, lang="en")) for n in range(lo, hi)]


class JattnTestTranslate(builders.LocalBuilder):
    """Like wmt14_translate/de-en: one Translation feature, supervised_keys (de, en)."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="de-en")]

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.Translation(languages=("de", "en")),
            supervised_keys=("de", "en"),
        )

    def _split_generators(self, dl_manager):
        return {
            "train": self._generate_examples(_pairs(0, 400)),
            "validation": self._generate_examples(_pairs(400, 420)),
        }

    def _generate_examples(self, pairs):
        for i, (de, en) in enumerate(pairs):
            yield i, {"de": de, "en": en}


class JattnTestTexts(builders.LocalBuilder):
    """Two Text features and an int one, no supervised_keys; `empty` has an empty split."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="full"), tfds.core.BuilderConfig(name="empty")]

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {"src": tfds.features.Text(), "tgt": tfds.features.Text(), "id": np.int64}
            ),
        )

    def _split_generators(self, dl_manager):
        n_val = 0 if self.builder_config.name == "empty" else 3
        return {
            "train": self._generate_examples(30),
            "validation": self._generate_examples(n_val),
        }

    def _generate_examples(self, n):
        for i in range(n):
            yield i, {"src": f"q{i}", "tgt": f"a{i}" * 2, "id": i}


class JattnTestNumbersV1(builders.JattnNumbers):
    """`numbers/de_tiny` as version 1.0.0 generated it (1-6 digits, test 7-8): the
    batches `BEFORE_SEPARATE_LENGTHS` pins were recorded on it. Generation is a
    pure function of the config, so the same config gives the same examples."""

    BUILDER_CONFIGS = [
        builders.NumbersConfig(
            name="de_tiny",
            language="de",
            num_train=600,
            num_validation=50,
            num_test_longer=50,
            train_digits=(1, 2, 3, 4, 5, 6),
            test_digits=(7, 8),
        )
    ]


# ---------------------------------------------------------------------------
# Fixtures: every builder is prepared once per session.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def numbers(data_dir):
    return data.load("numbers", data_dir=data_dir)


@pytest.fixture(scope="session")
def tiny(data_dir):
    return data.load("numbers/de_tiny", data_dir=data_dir)


@pytest.fixture(scope="session")
def tiny_v1(data_dir):
    return data.load("jattn_test_numbers_v1/de_tiny", data_dir=data_dir)


@pytest.fixture(scope="session")
def numbers_v1(data_dir):
    """`numbers` 1.0.0's default split, kept as the config de_7to8."""
    return data.load("numbers/de_7to8", data_dir=data_dir)


@pytest.fixture(scope="session")
def strings(data_dir):
    return {name: data.load(f"{name}/tiny", data_dir=data_dir) for name in ("copy", "reverse")}


@pytest.fixture(scope="session")
def translate(data_dir):
    return data.load("jattn_test_translate", data_dir=data_dir, tokenizer="spm", vocab_size=64)


def records(task, split):
    src = task.source(split)
    return [(ex["inputs"], ex["targets"]) for ex in src.__getitems__(range(len(src)))]


def encoded(task, split):
    """Tokenized examples of a split as (inputs tuple, targets tuple)."""
    enc = task.tokenizer.encode
    return [(tuple(enc(i)), tuple(enc(t))) for i, t in records(task, split)]


def batches(loader, n=None):
    it = iter(loader)
    out = []
    for b in it:
        out.append(b)
        if n is not None and len(out) == n:
            break
    return out


def unpacked(batch_list):
    return [
        (tuple(ex["inputs"].tolist()), tuple(ex["targets"].tolist()))
        for b in batch_list
        for ex in data.unpack(b)
    ]


# ---------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------


def test_numbers_german_default(numbers):
    assert numbers.splits == ("train", "validation", "test_longer")
    train, val, test = (records(numbers, s) for s in numbers.splits)
    assert (len(train), len(val), len(test)) == (20_000, 1_000, 1_000)
    pairs = dict(train + val)
    # Every 3-digit number fits in the default sizes, so 342 is in train or validation.
    assert pairs["342"] == "dreihundertzweiundvierzig"
    assert pairs["21"] == "einundzwanzig"  # units before tens
    assert pairs["7"] == "sieben"
    assert all(1 <= len(i) <= 5 and i.isdigit() for i, _ in train + val)
    assert {len(i) for i, _ in test} == {6}
    assert all("tausend" in t for _, t in test)
    train_in, val_in = {i for i, _ in train}, {i for i, _ in val}
    assert len(train_in) == len(train)  # distinct numbers
    assert not train_in & val_in
    assert not train_in & {i for i, _ in test}
    # Even spread over digit counts (water filling): all 1-3 digit numbers, all
    # 9,000 four-digit ones, and the rest of the 21,000 five-digit.
    counts = collections.Counter(len(i) for i, _ in train + val)
    assert counts[1] == 10 and counts[2] == 90 and counts[3] == 900
    assert counts[4] == 9_000 and counts[5] == 11_000


@pytest.mark.parametrize(
    "language, expected",
    [("en", "three hundred and forty-two"), ("fr", "trois cent quarante-deux")],
)
def test_numbers_other_languages(tmp_path, language, expected):
    config = builders.NumbersConfig(
        name=f"{language}_test",
        language=language,
        num_train=850,
        num_validation=50,
        num_test_longer=20,
        train_digits=(3,),
    )
    b = builders.JattnNumbers(data_dir=str(tmp_path), config=config, file_format="array_record")
    b.download_and_prepare()
    src = b.as_data_source()
    pairs = {
        ex["inputs"].decode(): ex["targets"].decode()
        for s in ("train", "validation")
        for ex in src[s]
    }
    assert len(pairs) == 900  # all 3-digit numbers, each once
    assert pairs["342"] == expected
    assert {len(ex["inputs"]) for ex in src["test_longer"]} == {6}


def test_numbers_with_round_millions_in_train(tmp_path):
    config = builders.NumbersConfig(
        name="de_millions_test",
        train_extra=builders.ROUND_MILLIONS,
        num_train=300,
        num_validation=20,
        num_test_longer=300,
        train_digits=(1, 2, 3, 4, 5, 6),
        test_digits=(7, 8),
    )
    splits = {
        split: [(ex["inputs"], ex["targets"]) for _, ex in examples]
        for split, examples in builders.numbers_splits(config).items()
    }
    train = dict(splits["train"])
    assert len(train) == 300 + 99
    assert train["12000000"] == "zwölf Millionen" and train["1000000"] == "eine Million"
    assert not {i for i, _ in splits["test_longer"]} & set(train)
    assert not {i for i, _ in splits["validation"]} & set(train)
    assert {len(i) for i, _ in splits["test_longer"]} == {7, 8}
    # Every character (and "Million(en)") of test_longer is seen in training.
    train_chars = {c for t in train.values() for c in t}
    assert {c for _, t in splits["test_longer"] for c in t} <= train_chars
    # The default config keeps 6-digit numbers entirely out of training.
    default = builders.numbers_splits(builders.NumbersConfig(name="x", num_train=300))
    assert all(len(ex["inputs"]) <= 5 for _, ex in default["train"])


@pytest.mark.parametrize("name", ["copy", "reverse"])
def test_copy_reverse(strings, name):
    task = strings[name]
    train, val, test = (records(task, s) for s in task.splits)
    assert (len(train), len(val), len(test)) == (600, 50, 50)
    for i, t in train + val + test:
        assert t == (i if name == "copy" else i[::-1])
        assert set(i) <= set("abcdefghijklmnop")
    assert {len(i) for i, _ in train + val} <= set(range(1, 16))
    assert {len(i) for i, _ in test} <= set(range(16, 31))
    assert not {i for i, _ in train} & {i for i, _ in val}


def test_same_seed_same_data(tmp_path):
    def generate(directory, seed):
        config = builders.StringsConfig(
            name=f"seed{seed}", num_train=200, num_validation=10, num_test_longer=10, seed=seed
        )
        b = builders.JattnReverse(
            data_dir=str(directory), config=config, file_format="array_record"
        )
        b.download_and_prepare()
        return {s: [ex["inputs"] for ex in d] for s, d in b.as_data_source().items()}

    a = generate(tmp_path / "a", seed=1)
    assert a == generate(tmp_path / "b", seed=1)
    assert a["train"] != generate(tmp_path / "c", seed=2)["train"]


def test_sampling_helpers_exact_and_distinct():
    rng = np.random.default_rng(0)
    assert builders.even_allocation(10, [1, 10, 10]) == [1, 5, 4]
    with pytest.raises(ValueError, match="cannot draw"):
        builders.even_allocation(5, [1, 2])
    x = builders.sample_numbers(rng, 300, (1, 2, 8))
    assert len(set(x.tolist())) == 300
    assert collections.Counter(len(str(v)) for v in x.tolist()) == {1: 10, 2: 90, 8: 200}


# ---------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------


def test_char_tokenizer(numbers, data_dir):
    tok = numbers.tokenizer
    assert (data.PAD_ID, data.EOS_ID, data.UNK_ID) == (0, 1, 2)
    chars = sorted({c for i, t in records(numbers, "train") for c in i + t})
    assert tok.vocab_size == len(chars) + 3
    ids = tok.encode("342")
    assert ids == [3 + chars.index(c) for c in "342"] + [data.EOS_ID]
    assert tok.decode(ids + [5, 6]) == "342"  # stops at EOS
    assert tok.decode([*tok.encode("null")[:-1], data.PAD_ID, 7]) == "null"  # and at PAD
    assert tok.decode(tok.encode("zwölf!")) == "zwölf" + tokenizers.UNK_TEXT
    # Cached: a second load reads the file and gives the same vocabulary.
    again = data.load("numbers", data_dir=data_dir)
    assert again.tokenizer.chars == tok.chars


def test_sentencepiece_shared_vocab(translate, data_dir):
    tok = translate.tokenizer
    assert isinstance(tok, data.SentencePieceTokenizer)
    assert tok.vocab_size == 64
    assert translate.source_key == "de" and translate.target_key == "en"
    de, en = records(translate, "validation")[0]
    for text in (de, en):  # one vocabulary for both languages
        ids = tok.encode(text)
        assert ids[-1] == data.EOS_ID and data.PAD_ID not in ids and data.UNK_ID not in ids
        assert tok.decode(ids + [9, 9]) == text
    path = tokenizers.vocab_path(
        os.path.join(data_dir, "jattn_vocab", translate.full_name), "spm", 64
    )
    mtime = os.path.getmtime(path)
    again = data.load("jattn_test_translate", data_dir=data_dir, tokenizer="spm", vocab_size=64)
    assert os.path.getmtime(path) == mtime  # reused, not retrained
    assert again.tokenizer.encode(de) == tok.encode(de)


def test_mismatched_vocabulary_file(translate, data_dir, tmp_path):
    cache = os.path.join(data_dir, "jattn_vocab", translate.full_name)
    # A 64-piece model where a 48-piece one is expected, with matching settings.
    small = tokenizers.vocab_path(cache, "spm", 48)
    os.link(tokenizers.vocab_path(cache, "spm", 64), small)
    with open(tokenizers.vocab_path(cache, "spm", 64) + ".settings.json") as f:
        settings = json.load(f)
    with open(small + ".settings.json", "w") as f:
        json.dump(dict(settings, vocab_size=48), f)
    with pytest.raises(ValueError, match="has 64 pieces but vocab_size=48"):
        data.load("jattn_test_translate", data_dir=data_dir, tokenizer="spm", vocab_size=48)
    # A cached vocabulary learned with other keys.
    with pytest.raises(
        ValueError, match=r"does not match.*source_key: cached 'de' vs requested 'en'"
    ):
        data.load(
            "jattn_test_translate",
            data_dir=data_dir,
            tokenizer="spm",
            vocab_size=64,
            source_key="en",
            target_key="de",
        )


def test_text_source_indexing(tiny):
    src = tiny.source("validation")
    assert len(src) == 50 and src[-1] == src[49]
    with pytest.raises(IndexError):
        src[50]
    assert list(src) == src.__getitems__(range(50))


def test_fast_reads_equal_tfds_decoding(tiny, translate):
    for task in (tiny, translate):
        src = task.source("train")
        assert src._fast  # the fast path is taken for array_record Text features
        indices = list(range(len(src)))[::-1]
        assert src.__getitems__(indices) == [src[i] for i in indices]


def test_tfds_translation_names_resolve(tmp_path):
    """wmt14_translate is found (tfds registers it lazily) and its keys are checked."""
    from jattn.data import tasks

    builder = tasks.make_builder("wmt14_translate/de-en", str(tmp_path))
    assert builder.info.supervised_keys == ("de", "en")
    assert tasks.resolve_key(builder.info, "en", "source_key", "wmt14") == "en"
    with pytest.raises(ValueError, match="target_key='fr' is not a feature.*'de', 'en'"):
        tasks.resolve_key(builder.info, "fr", "target_key", "wmt14")
    assert not os.listdir(tmp_path)  # nothing prepared or downloaded


def test_two_text_features_with_keys(data_dir):
    task = data.load("jattn_test_texts/full", data_dir=data_dir, source_key="src", target_key="tgt")
    assert ("q3", "a3a3") in records(task, "train")  # tfds stores examples shuffled by key
    loader = data.make_loader(task, "validation", batch_size=4, max_len=8, seed=0, num_epochs=1)
    batch = next(iter(loader))
    assert sorted(unpacked([batch])) == sorted(encoded(task, "validation"))


# ---------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------


def test_pack_hand_example():
    import grain

    examples = [
        {"inputs": np.array([3, 4, 1], np.int32), "targets": np.array([5, 1], np.int32)},
        {"inputs": np.array([6, 1], np.int32), "targets": np.array([7, 8, 1], np.int32)},
        {"inputs": np.array([9, 9, 9, 1], np.int32), "targets": np.array([1], np.int32)},
    ]
    ds = grain.MapDataset.source(examples).to_iter_dataset()
    rows = list(packing.PackIterDataset(ds, max_len=5, num_bins=2))
    assert len(rows) == 2
    r0, r1 = rows
    np.testing.assert_array_equal(r0["inputs"], [3, 4, 1, 6, 1])
    np.testing.assert_array_equal(r0["inputs_segment_ids"], [1, 1, 1, 2, 2])
    np.testing.assert_array_equal(r0["inputs_positions"], [0, 1, 2, 0, 1])
    np.testing.assert_array_equal(r0["targets"], [5, 1, 7, 8, 1])
    np.testing.assert_array_equal(r0["targets_segment_ids"], [1, 1, 2, 2, 2])
    np.testing.assert_array_equal(r0["targets_positions"], [0, 1, 0, 1, 2])
    np.testing.assert_array_equal(r1["inputs"], [9, 9, 9, 1, 0])
    np.testing.assert_array_equal(r1["inputs_segment_ids"], [1, 1, 1, 1, 0])
    np.testing.assert_array_equal(r1["targets"], [1, 0, 0, 0, 0])
    np.testing.assert_array_equal(r1["targets_segment_ids"], [1, 0, 0, 0, 0])
    assert all(r[k].dtype == np.int32 for r in rows for k in data.BATCH_KEYS)
    back = data.unpack({k: np.stack([r0[k], r1[k]]) for k in data.BATCH_KEYS})
    assert [(e["inputs"].tolist(), e["targets"].tolist()) for e in back] == [
        (x["inputs"].tolist(), x["targets"].tolist()) for x in examples
    ]


def test_pack_hand_example_with_separate_lengths():
    """3 inputs slots, 6 targets slots: an example goes where both of its sides fit."""
    import grain

    examples = [
        {"inputs": np.array([3, 1], np.int32), "targets": np.array([5, 5, 5, 1], np.int32)},
        # Its targets would fit row 0 (2 free), its inputs not (1 free): row 1.
        {"inputs": np.array([4, 1], np.int32), "targets": np.array([6, 1], np.int32)},
        # Its inputs would fit row 0 (1 free), its targets not (2 free): row 1.
        {"inputs": np.array([1], np.int32), "targets": np.array([8, 8, 1], np.int32)},
    ]
    ds = grain.MapDataset.source(examples).to_iter_dataset()
    r0, r1 = packing.PackIterDataset(ds, max_len=6, max_input_len=3, num_bins=2)
    np.testing.assert_array_equal(r0["inputs"], [3, 1, 0])
    np.testing.assert_array_equal(r0["inputs_segment_ids"], [1, 1, 0])
    np.testing.assert_array_equal(r0["targets"], [5, 5, 5, 1, 0, 0])
    np.testing.assert_array_equal(r0["targets_segment_ids"], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(r1["inputs"], [4, 1, 1])  # full: 3 of 3
    np.testing.assert_array_equal(r1["inputs_segment_ids"], [1, 1, 2])
    np.testing.assert_array_equal(r1["inputs_positions"], [0, 1, 0])
    np.testing.assert_array_equal(r1["targets"], [6, 1, 8, 8, 1, 0])
    np.testing.assert_array_equal(r1["targets_segment_ids"], [1, 1, 2, 2, 2, 0])
    np.testing.assert_array_equal(r1["targets_positions"], [0, 1, 0, 1, 2, 0])
    for r in (r0, r1):
        assert {k: r[k].shape for k in data.BATCH_KEYS} == {
            k: (3,) if k.startswith("inputs") else (6,) for k in data.BATCH_KEYS
        }
    back = data.unpack({k: np.stack([r0[k], r1[k]]) for k in data.BATCH_KEYS})
    assert [(e["inputs"].tolist(), e["targets"].tolist()) for e in back] == [
        (x["inputs"].tolist(), x["targets"].tolist()) for x in examples
    ]
    row = data.pad_to_row(examples[0], 6, max_input_len=3)
    np.testing.assert_array_equal(row["inputs"], [3, 1, 0])
    np.testing.assert_array_equal(row["targets_positions"], [0, 1, 2, 3, 0, 0])


def _random_examples(n, max_len, seed):
    rng = np.random.default_rng(seed)
    return [
        {
            "inputs": rng.integers(3, 9, size=rng.integers(1, max_len + 1)).astype(np.int32),
            "targets": rng.integers(3, 9, size=rng.integers(1, max_len + 1)).astype(np.int32),
        }
        for _ in range(n)
    ]


@pytest.mark.parametrize("max_input_len", [None, 5, 20], ids=["same", "shorter", "longer"])
def test_packer_matches_grain_first_fit(max_input_len):
    """Our packer against grain's FirstFitPackIterDataset (same algorithm), row by row,
    with inputs rows as long as, shorter than and longer than the targets rows."""
    import grain

    examples = _random_examples(300, 12, seed=0)
    examples = [
        {"inputs": ex["inputs"][: max_input_len or 12], "targets": ex["targets"]} for ex in examples
    ]
    ds = grain.MapDataset.source(examples).to_iter_dataset()
    ours = list(packing.PackIterDataset(ds, max_len=12, num_bins=5, max_input_len=max_input_len))
    reference = list(
        grain.experimental.FirstFitPackIterDataset(
            ds,
            length_struct={"inputs": max_input_len or 12, "targets": 12},
            num_packing_bins=5,
            shuffle_bins=False,
        )
    )
    assert len(ours) == len(reference) > 300 / 4
    assert ours[0]["inputs"].shape == (max_input_len or 12,) and ours[0]["targets"].shape == (12,)
    for a, b in zip(ours, reference, strict=True):
        for key in data.BATCH_KEYS:
            np.testing.assert_array_equal(a[key], b[key])


def test_packer_resumes_from_every_row():
    import grain

    ds = grain.MapDataset.source(_random_examples(60, 8, seed=1)).to_iter_dataset()
    packed = packing.PackIterDataset(ds, max_len=8, num_bins=3)
    it = iter(packed)
    states, rows = [it.get_state()], []
    for row in it:
        rows.append(row)
        states.append(json.loads(json.dumps(it.get_state())))
    for k, state in enumerate(states):
        resumed = iter(packed)
        resumed.set_state(state)
        rest = list(resumed)
        assert len(rest) == len(rows) - k
        for a, b in zip(rest, rows[k:], strict=True):
            np.testing.assert_array_equal(a["targets_segment_ids"], b["targets_segment_ids"])
            np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_pad_to_row():
    row = data.pad_to_row({"inputs": [7, 1], "targets": [8, 9, 1]}, 4)
    np.testing.assert_array_equal(row["inputs"], [7, 1, 0, 0])
    np.testing.assert_array_equal(row["inputs_segment_ids"], [1, 1, 0, 0])
    np.testing.assert_array_equal(row["targets_positions"], [0, 1, 2, 0])
    with pytest.raises(ValueError, match="more than max_len=2"):
        data.pad_to_row({"inputs": [7, 1], "targets": [8, 9, 1]}, 2)


def test_unpack_rejects_broken_rows():
    good = data.pad_to_row({"inputs": [7, 1], "targets": [8, 1]}, 4)
    bad_pos = dict(good, inputs_positions=np.array([0, 2, 0, 0]))
    with pytest.raises(ValueError, match="positions"):
        data.unpack(bad_pos)
    split = dict(
        good,
        targets=np.array([8, 0, 1, 0]),
        targets_segment_ids=np.array([1, 0, 1, 0]),
        targets_positions=np.array([0, 0, 1, 0]),
    )
    with pytest.raises(ValueError, match="not contiguous"):
        data.unpack(split)
    mixed = dict(good, targets_segment_ids=np.array([2, 2, 0, 0]))
    with pytest.raises(ValueError, match="differ"):
        data.unpack(mixed)


def assert_row_invariants(batch, max_len, max_input_len=None):
    """Independent check of the packed layout, row by row (inputs rows of
    `max_input_len` tokens, default `max_len`; targets rows of `max_len`)."""
    lengths = {"inputs": max_input_len or max_len, "targets": max_len}
    for key in packing.FEATURES:
        ids, seg, pos = (batch[key], batch[f"{key}_segment_ids"], batch[f"{key}_positions"])
        assert ids.shape == seg.shape == pos.shape == (len(ids), lengths[key])
        for b in range(len(ids)):
            real = seg[b] > 0
            n = int(real.sum())
            assert real[:n].all() and not real[n:].any()  # padding only at the end
            assert not ids[b][~real].any() and not pos[b][~real].any()
            s, p = seg[b][:n], pos[b][:n]
            starts = np.flatnonzero(np.diff(s, prepend=0) != 0)  # [num_segments]
            assert np.array_equal(s[starts], np.arange(1, len(starts) + 1))  # 1, 2, ... in order
            assert np.all(np.diff(s) >= 0)  # contiguous segments
            assert np.array_equal(p[starts], np.zeros(len(starts)))  # positions restart
            assert np.all(np.diff(p)[np.diff(s) == 0] == 1)  # and count up inside
            assert ids[b][starts[1:] - 1].tolist() == [data.EOS_ID] * (len(starts) - 1)
    for b in range(len(batch["inputs"])):  # the same examples in inputs and targets
        assert set(batch["inputs_segment_ids"][b].tolist()) - {0} == set(
            batch["targets_segment_ids"][b].tolist()
        ) - {0}


@pytest.mark.parametrize("pack", [True, False])
def test_one_epoch_unpacks_to_the_split(tiny, pack):
    loader = data.make_loader(
        tiny, "train", batch_size=16, max_len=96, seed=0, num_epochs=1, pack=pack
    )
    got = batches(loader)
    for b in got:
        assert set(b) == set(data.BATCH_KEYS)
        assert all(v.dtype == np.int32 and v.shape == (16, 96) for v in b.values())
        assert_row_invariants(b, 96)
        if not pack:
            assert b["targets_segment_ids"].max() <= 1
    # Every example exactly once, whole: nothing split across rows, nothing lost.
    assert collections.Counter(unpacked(got)) == collections.Counter(encoded(tiny, "train"))
    rows = sum(int((b["targets_segment_ids"].max(axis=1) > 0).sum()) for b in got)
    assert (rows < 600 / 1.5) if pack else (rows == 600)


def test_packed_batches_of_the_default_task(numbers):
    got = batches(data.make_loader(numbers, "train", batch_size=32, max_len=64, seed=1), 5)
    for b in got:
        assert_row_invariants(b, 64)
    originals = set(encoded(numbers, "train"))
    assert set(unpacked(got)) <= originals


def test_overlong_drop_and_truncate(tiny):
    max_len = 24
    lengths = [max(len(i), len(t)) for i, t in encoded(tiny, "train")]
    n_over = sum(n > max_len for n in lengths)
    assert 0 < n_over < len(lengths)
    drop = data.make_loader(tiny, "train", batch_size=16, max_len=max_len, seed=0, num_epochs=1)
    it = iter(drop)
    got = list(it)
    assert data.loader_stats(it) == {"examples": 600, "dropped": n_over, "truncated": 0}
    assert len(unpacked(got)) == 600 - n_over
    trunc = data.make_loader(
        tiny, "train", batch_size=16, max_len=max_len, seed=0, num_epochs=1, overlong="truncate"
    )
    it = iter(trunc)
    examples = unpacked(list(it))
    assert data.loader_stats(it) == {"examples": 600, "dropped": 0, "truncated": n_over}
    assert len(examples) == 600
    cut = [e for e in examples if max(len(e[0]), len(e[1])) == max_len and data.EOS_ID not in e[1]]
    assert len(cut) > 0


# ---------------------------------------------------------------------------
# Separate row lengths for inputs (encoder) and targets (decoder)
# ---------------------------------------------------------------------------


def _fingerprint(batch_list):
    """sha256 (first 16 hex digits) of the keys, shapes and int32 bytes of batches."""
    import hashlib

    h = hashlib.sha256()
    for b in batch_list:
        for key in data.BATCH_KEYS:
            h.update(key.encode())
            h.update(np.ascontiguousarray(b[key], np.int32).tobytes())
            h.update(str(b[key].shape).encode())
    return h.hexdigest()[:16]


# The first 6 batches as make_loader gave them before max_input_len existed
# (commit fc09a0c, on numbers 1.0.0's data; the builders are byte-for-byte
# deterministic, and that data is still generated by the configs below).
BEFORE_SEPARATE_LENGTHS = [
    ("tiny_v1", dict(batch_size=8, max_len=64, seed=3), "8145cc9da6d247f5"),
    ("tiny_v1", dict(batch_size=8, max_len=96, seed=3, pack=False), "f00ed2ad2447ca38"),
    ("tiny_v1", dict(batch_size=8, max_len=24, seed=3, overlong="truncate"), "15262e0fc5383c86"),
    ("numbers_v1", dict(batch_size=16, max_len=64, seed=0), "2f4cb285378a0041"),
]


@pytest.mark.parametrize(
    "task_name, kwargs, before",
    BEFORE_SEPARATE_LENGTHS,
    ids=["packed", "unpacked", "truncate", "numbers"],
)
def test_default_input_length_gives_exactly_the_batches_of_before(
    request, task_name, kwargs, before
):
    task = request.getfixturevalue(task_name)
    for same in ({}, {"max_input_len": None}, {"max_input_len": kwargs["max_len"]}):
        it = iter(data.make_loader(task, "train", io=data.LoaderIO(prefetch=0), **kwargs, **same))
        assert _fingerprint([next(it) for _ in range(6)]) == before, same


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("max_input_len", [8, 12])
def test_separate_input_length_one_epoch(tiny, pack, max_input_len):
    """`max_input_len` inputs and 64 targets slots: shapes per side, every example once
    and whole, its inputs and targets under the same segment id of the same row. With
    8 slots the inputs (2-7 tokens) limit the packing, with 12 the targets do."""
    loader = data.make_loader(
        tiny,
        "train",
        batch_size=16,
        max_len=64,
        max_input_len=max_input_len,
        seed=0,
        num_epochs=1,
        pack=pack,
    )
    got = batches(loader)
    for b in got:
        assert {k: v.shape for k, v in b.items()} == {
            k: (16, max_input_len) if k.startswith("inputs") else (16, 64) for k in data.BATCH_KEYS
        }
        assert_row_invariants(b, 64, max_input_len=max_input_len)
    # unpack pairs segment s of the inputs with segment s of the targets: equal to the
    # split's (inputs, targets) pairs only if no example's sides were mixed with another's.
    assert collections.Counter(unpacked(got)) == collections.Counter(encoded(tiny, "train"))
    rows = sum(int((b["targets_segment_ids"].max(axis=1) > 0).sum()) for b in got)
    assert (rows < 600 / 1.25) if pack else (rows == 600)
    if pack:
        fill = sum(int(np.count_nonzero(b["inputs_segment_ids"])) for b in got) / (
            rows * max_input_len
        )
        assert fill > 0.45  # about 0.12 with 64 inputs slots (5 tokens, 1.5 examples a row)


def test_model_sees_each_packed_example_as_if_alone(tiny):
    """Real packed rows (12 inputs, 64 targets slots) through a Transformer: each
    example's logits equal those of the example alone in a row. Misaligned segment
    ids or positions, or any leakage between examples, would change them."""
    import jax

    from jattn.models import Transformer, TransformerConfig
    from jattn.train.steps import model_kwargs

    loader = data.make_loader(
        tiny,
        "train",
        batch_size=4,
        max_len=64,
        max_input_len=12,
        seed=1,
        io=data.LoaderIO(prefetch=0),
    )
    # The first batch with a row of three examples.
    packed = next(b for b in loader if b["targets_segment_ids"].max() >= 3)
    config = TransformerConfig(
        vocab_size=tiny.tokenizer.vocab_size,
        d_model=16,
        num_heads=2,
        num_layers=1,
        d_ff=32,
        dropout_rate=0.0,
        max_len=64,
        position="sinusoidal+shaw",  # absolute and relative positions both matter
        position_options={"shaw": {"max_distance": 4}},
        attention_impl="xla",
    )
    model = Transformer(config)
    alone_rows = [data.pad_to_row(ex, 64, max_input_len=12) for ex in data.unpack(packed)]
    alone = {k: np.stack([r[k] for r in alone_rows]) for k in data.BATCH_KEYS}  # [E, L]
    params = model.init(jax.random.key(0), alone["inputs"], alone["targets"])["params"]
    logits = lambda b: np.asarray(
        model.apply({"params": params}, b["inputs"], b["targets"], **model_kwargs(b))
    )  # [rows, 64, V]
    packed_logits, alone_logits = logits(packed), logits(alone)
    example = 0
    for row in range(4):  # unpack's order: row by row, segments in order
        seg = packed["targets_segment_ids"][row]
        for s in range(1, seg.max() + 1):
            where = np.flatnonzero(seg == s)  # [n]
            np.testing.assert_allclose(
                packed_logits[row, where],
                alone_logits[example, : len(where)],
                rtol=1e-5,
                atol=1e-5,
            )
            example += 1
    assert example == len(alone_rows)


@pytest.mark.parametrize(
    "max_input_len, max_len", [(5, 96), (8, 24), (3, 48)], ids=["inputs", "targets", "both"]
)
def test_overlong_per_side(tiny, max_input_len, max_len):
    """Over-long inputs are measured against max_input_len, targets against max_len;
    "truncate" cuts each side to its own limit and leaves a side that fits whole."""
    originals = encoded(tiny, "train")
    over = [len(i) > max_input_len or len(t) > max_len for i, t in originals]
    assert 0 < sum(over) < len(originals)
    kw = dict(batch_size=16, max_len=max_len, max_input_len=max_input_len, seed=0, num_epochs=1)

    it = iter(data.make_loader(tiny, "train", **kw))
    got = unpacked(list(it))
    assert data.loader_stats(it) == {"examples": 600, "dropped": sum(over), "truncated": 0}
    kept = [e for e, o in zip(originals, over, strict=True) if not o]
    assert collections.Counter(got) == collections.Counter(kept)

    it = iter(data.make_loader(tiny, "train", overlong="truncate", **kw))
    got = unpacked(list(it))
    assert data.loader_stats(it) == {"examples": 600, "dropped": 0, "truncated": sum(over)}
    cut = [(i[:max_input_len], t[:max_len]) for i, t in originals]
    assert collections.Counter(got) == collections.Counter(cut)


def test_measure_loader_counts_each_side_against_its_own_length(numbers):
    """On `numbers` inputs of at most 7 tokens never bind at 16 slots: the same rows,
    so the encoder's real-token fraction is exactly 4x that at 64 slots."""
    wide = data.measure_loader(numbers, batch_size=16, max_len=64, num_batches=10)
    narrow = data.measure_loader(
        numbers, batch_size=16, max_len=64, max_input_len=16, num_batches=10
    )
    assert narrow["inputs_efficiency"] == pytest.approx(4 * wide["inputs_efficiency"])
    for key in ("targets_efficiency", "examples_per_row", "dropped_fraction"):
        assert narrow[key] == wide[key]
    assert wide["inputs_efficiency"] < 0.15 < 0.35 < narrow["inputs_efficiency"]


# ---------------------------------------------------------------------------
# Determinism, shuffling, epochs
# ---------------------------------------------------------------------------


def _same(a, b):
    if len(a) != len(b):
        return False
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


def test_same_seed_same_batches(tiny):
    make = lambda seed, **kw: data.make_loader(
        tiny, "train", batch_size=8, max_len=96, seed=seed, **kw
    )
    a = batches(make(3), 6)
    assert _same(a, batches(make(3), 6))
    assert _same(
        a, batches(make(3, io=data.LoaderIO(prefetch=0)), 6)
    )  # prefetching changes nothing
    assert not _same(a, batches(make(4), 6))
    ordered = batches(make(3, shuffle=False, pack=False, num_epochs=1), 2)
    first = [(tuple(e[0]), tuple(e[1])) for e in encoded(tiny, "train")[:16]]
    assert unpacked(ordered) == first


def test_epochs_reshuffle(tiny):
    got = unpacked(
        batches(
            data.make_loader(
                tiny, "train", batch_size=50, max_len=96, seed=0, pack=False, num_epochs=2
            )
        )
    )
    first, second = got[:600], got[600:]
    assert len(second) == 600
    assert collections.Counter(first) == collections.Counter(second)
    assert first != second


# ---------------------------------------------------------------------------
# Orbax: the iterator saved with the train state at step k resumes exactly
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(pack=True),
        dict(pack=False, overlong="truncate", max_len=24, io=data.LoaderIO(prefetch=0)),
    ],
    ids=["packed", "unpacked-truncate"],
)
def test_checkpoint_resume_gives_the_same_batches(tiny, tmp_path, kwargs):
    kwargs = dict(dict(batch_size=8, max_len=96, seed=5), **kwargs)
    make = lambda: iter(data.make_loader(tiny, "train", **kwargs))
    k, m = 70, 8  # past the end of the first epoch (~60 batches)
    ref_it = make()
    reference = [next(ref_it) for _ in range(k + m)]

    state = {"params": jnp.arange(6.0).reshape(2, 3), "step": jnp.asarray(k)}
    it = make()
    for _ in range(k):
        next(it)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(
            k,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=data_ckpt.save_args(it)
            ),
        )
        next(it)  # moving on after save() does not change what was saved
        mngr.wait_until_finished()
    del it  # the run "dies"

    fresh = make()
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        assert mngr.latest_step() == k
        restored = mngr.restore(
            k,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(state), data=data_ckpt.restore_args(fresh)
            ),
        )
    np.testing.assert_array_equal(restored["state"]["params"], state["params"])
    assert restored["data"] is fresh
    assert _same([next(fresh) for _ in range(m)], reference[k:])
    if "io" in kwargs:  # without read-ahead the counts are exact too
        assert data.loader_stats(fresh) == data.loader_stats(ref_it)
        assert data.loader_stats(fresh)["truncated"] > 0


def test_get_set_state_roundtrip(tiny):
    make = lambda: iter(data.make_loader(tiny, "train", batch_size=8, max_len=96, seed=2))
    it = make()
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # JSON-able
    expected = [next(it) for _ in range(4)]
    other = make()
    other.set_state(state)
    assert _same([next(other) for _ in range(4)], expected)


@pytest.mark.parametrize("max_input_len", [None, 6], ids=["same", "separate"])
def test_pipeline_resumes_from_every_batch(tiny, max_input_len):
    """Through block boundaries (256 examples), packer groups and the end of the data
    (a state taken after the last, short batch restores to an empty iterator)."""
    loader = data.make_loader(
        tiny,
        "train",
        batch_size=16,
        max_len=64,
        max_input_len=max_input_len,
        seed=9,
        num_epochs=1,
        io=data.LoaderIO(prefetch=0),
    )
    it = iter(loader)
    states, reference = [it.get_state()], []
    for batch in it:
        reference.append(batch)
        states.append(it.get_state())
    assert len(reference) > 20
    for k in [*range(0, len(states), 3), len(states) - 1]:  # the state after the end too
        resumed = iter(loader)
        resumed.set_state(states[k])
        assert _same(list(resumed), reference[k:])


def test_checkpoint_args_reject_non_iterators(tiny):
    with pytest.raises(TypeError, match="make_loader"):
        data_ckpt.save_args(data.make_loader(tiny, "train", batch_size=2, max_len=8, seed=0))


# ---------------------------------------------------------------------------
# Sharding (in-process; tests/test_data_multiprocess.py runs real processes)
# ---------------------------------------------------------------------------


def test_shards_are_disjoint_and_cover(tiny):
    seen = []
    for index in range(3):
        loader = data.make_loader(
            tiny,
            "validation",
            batch_size=4,
            max_len=96,
            seed=0,
            num_epochs=1,
            shard=(index, 3),
        )
        seen.append(unpacked(batches(loader)))
    assert [len(s) for s in seen] == [17, 17, 16]
    all_seen = [e for s in seen for e in s]
    assert collections.Counter(all_seen) == collections.Counter(encoded(tiny, "validation"))


# ---------------------------------------------------------------------------
# Throughput and packing efficiency
# ---------------------------------------------------------------------------


def test_measure_loader(numbers):
    stats = data.measure_loader(numbers, batch_size=32, max_len=64, num_batches=10)
    assert stats["examples_per_s"] > 0 and stats["batches_per_s"] > 0
    assert 0 < stats["inputs_efficiency"] < stats["targets_efficiency"] <= 1
    assert stats["examples_per_row"] >= 1
    assert stats["dropped_fraction"] == 0  # German numbers up to 6 digits fit in 64
    short = data.measure_loader(numbers, batch_size=32, max_len=32, num_batches=3)
    assert short["dropped_fraction"] > 0.5  # most 5-6 digit numbers are longer than 32


# ---------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------


def test_errors(data_dir, tiny):
    import grain

    with pytest.raises(ValueError, match="unknown dataset name 'no_such_set'"):
        data.load("no_such_set", data_dir=data_dir)
    with pytest.raises(ValueError, match="unknown config 'xx'.*'de', 'en', 'fr'"):
        data.load("numbers/xx", data_dir=data_dir)
    with pytest.raises(ValueError, match="unknown tokenizer 'words'"):
        data.load("numbers/de_tiny", data_dir=data_dir, tokenizer="words")
    with pytest.raises(ValueError, match="no \\(source, target\\) supervised_keys.*src"):
        data.load("jattn_test_texts/full", data_dir=data_dir)
    with pytest.raises(ValueError, match="source_key='fr' is not a feature.*'de', 'en'"):
        data.load("jattn_test_translate", data_dir=data_dir, source_key="fr", target_key="en")
    with pytest.raises(ValueError, match="target_key='id'.*not a Text feature"):
        data.load("jattn_test_texts/full", data_dir=data_dir, source_key="src", target_key="id")
    with pytest.raises(ValueError, match="empty split"):
        data.load("jattn_test_texts/empty", data_dir=data_dir, source_key="src", target_key="tgt")
    make = lambda **kw: data.make_loader(
        tiny, **dict(dict(split="train", batch_size=4, max_len=16, seed=0), **kw)
    )
    with pytest.raises(ValueError, match="no split 'test'"):
        make(split="test")
    with pytest.raises(ValueError, match="overlong must be one of"):
        make(overlong="wrap")
    with pytest.raises(ValueError, match="max_len must be a positive int, got 0"):
        make(max_len=0)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(
            ValueError,
            match=rf"max_input_len must be a positive int or None \(= max_len\), got {bad}",
        ):
            make(max_input_len=bad)
    with pytest.raises(ValueError, match="max_input_len must be a positive int"):
        packing.PackIterDataset(
            grain.MapDataset.source([]).to_iter_dataset(), max_len=8, max_input_len=-1, num_bins=2
        )
    with pytest.raises(ValueError, match="inputs has 3 tokens, more than max_input_len=2"):
        data.pad_to_row({"inputs": [7, 7, 1], "targets": [8, 1]}, 4, max_input_len=2)
    with pytest.raises(ValueError, match=r"0 <= index < count, got \(2, 2\)"):
        make(shard=(2, 2))
    with pytest.raises(ValueError, match="shard 700 of 800 .* is empty"):
        make(shard=(700, 800))


def test_bench_data_script_reports_each_row_length(numbers, data_dir, monkeypatch, capsys):
    # benchmarks/train.py --data: one table row per (task, max_len, max_input_len,
    # pack); shorter input rows raise the inputs' share of real tokens.
    import runpy

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "train.py")
    main = runpy.run_path(path)["main"]
    assert main(
        ["--data", "--data_dir", data_dir, "--tasks", "numbers", "--max_lens", "64",
         "--max_input_lens", "0,16", "--num_batches", "3"]
    ) == 0  # fmt: skip
    table = capsys.readouterr().out
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| numbers")]
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("64", "64", "yes"), ("64", "64", "no"), ("64", "16", "yes"), ("64", "16", "no")
    ]  # fmt: skip
    inputs_real = {(r[2], r[3]): float(r[7]) for r in rows}
    assert inputs_real[("16", "yes")] > 2 * inputs_real[("64", "yes")]
    # As a script (`python benchmarks/train.py --data ...`), main() reads sys.argv.
    argv = ["train.py", "--data", "--data-dir", data_dir, "--tasks", "numbers", "--max-lens",
            "64", "--max-input-lens", "16", "--num-batches", "2"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert main() == 0
    assert "| numbers | 64 | 16 | yes |" in capsys.readouterr().out
