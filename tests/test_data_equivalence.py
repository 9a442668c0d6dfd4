"""The array pipeline (`jattn.data.reading`, spans of examples, rows built at once)
gives exactly the batches and iterator states of the per-example pipeline before it.

Three references: fingerprints of what commit 6ec37ab's pipeline gave (batches and
`get_state()` after each, every key, in order); grain's own index chain and first-fit
packer, example by example; and `Tokenizer.encode`, text by text.
"""

import hashlib
import itertools
import json

import grain
import numpy as np
import pytest

import jattn.data as data
from jattn.data import reading, tokenizers
from jattn.data.ragged import Ragged, concatenate


def _fingerprint(batches, states):
    """sha256 (first 16 hex digits) of batches (keys, shapes, dtypes, bytes) and the
    iterator's state after each."""
    h = hashlib.sha256()
    for batch, state in zip(batches, states, strict=True):
        for key in data.BATCH_KEYS:
            h.update(key.encode())
            h.update(str(batch[key].shape).encode())
            h.update(str(batch[key].dtype).encode())
            h.update(np.ascontiguousarray(batch[key]).tobytes())
        h.update(json.dumps(state, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _run(loader, n=None):
    """(batches, state after each) of a loader's iterator, at most n batches."""
    it = iter(loader)
    batches, states = [], []
    for batch in itertools.islice(it, n):
        batches.append(batch)
        states.append(it.get_state())
    return batches, states


# What the per-example pipeline of commit 6ec37ab gave (prefetch=0): batches and
# the state after each. The builders are byte-for-byte deterministic.
BEFORE = [
    # configs/chomsky.py's rows (the Delétang tape model's) on the tiny data, 3 epochs.
    ("reverse_string/tiny", dict(batch_size=128, max_len=41, max_input_len=41, seed=0), 8,
     "2e3684d89b177964"),
    # configs/numbers.py's (16 input and 64 target slots), packed.
    ("numbers/de_tiny", dict(batch_size=16, max_len=64, max_input_len=16, seed=1), 12,
     "718b63fb5c6ea4a1"),
    ("numbers/de_tiny", dict(batch_size=8, max_len=24, seed=3, pack=False, overlong="truncate"),
     10, "26ac4e950a10ed0b"),
    # Over-long examples dropped, a shard, two epochs to the end (a short last batch).
    ("numbers/de_tiny", dict(batch_size=16, max_len=24, max_input_len=8, seed=2, num_epochs=2,
                             shard=(1, 2)), None, "46e1138d6e7f37d6"),
    # Evaluation's loader: in order, one example a row, one pass.
    ("numbers/de_tiny", dict(batch_size=64, max_len=96, seed=0, shuffle=False, pack=False,
                             num_epochs=1), None, "6e139f640e264c25"),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, kwargs, n, before",
    BEFORE,
    ids=["tape", "seq2seq", "unpacked-truncate", "drop-shard-epochs", "eval"],
)
@pytest.mark.parametrize("cache", [True, False], ids=["cached", "read"])
def test_batches_and_states_are_those_of_before(data_dir, name, kwargs, n, before, cache):
    task = data.load(name, data_dir=data_dir)
    loader = data.make_loader(task, "train", io=data.LoaderIO(prefetch=0, cache=cache), **kwargs)
    batches, states = _run(loader, n)
    assert _fingerprint(batches, states) == before


@pytest.mark.parametrize(
    "n, shard_index, shard_count, seed, num_epochs",
    [(600, 0, 1, 0, None), (600, 1, 3, 7, 2), (37, 0, 1, 5, 3), (37, 2, 4, None, 2),
     (1, 0, 1, 3, 4)],
)  # fmt: skip
def test_index_blocks_are_grains_chain(n, shard_index, shard_count, seed, num_epochs):
    """Blocks across epoch boundaries, a finite stream's short last block, and an
    index past the length (grain's batch gives the elements after it)."""
    chain = grain.MapDataset.range(n)[shard_index::shard_count]
    if seed is not None:
        chain = chain.shuffle(seed=seed)
    chain = chain.repeat(num_epochs).batch(16, drop_remainder=False)
    ours = reading.index_blocks(
        n, shard_index=shard_index, shard_count=shard_count, seed=seed, num_epochs=num_epochs,
        block=16,
    )  # fmt: skip
    assert len(ours) == len(chain)
    ks = range(min(len(chain), 40)) if num_epochs is None else range(len(chain) + 3)
    for k in ks:
        assert ours[k].dtype == np.int64
        np.testing.assert_array_equal(ours[k], chain[k])


def test_index_blocks_refuse_a_seed_grain_refuses():
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\)"):
        reading.index_blocks(10, seed=2**32)


def _reference_batches(task, *, batch_size, max_len, max_input_len, seed, num_batches):
    """The training batches from grain's own pieces, an example at a time: its index
    chain, `source[i]`, `tokenizer.encode`, dropping over-long ones, its first-fit
    packer (`shuffle_bins=False`: bins in order) and its batch, short batches padded."""
    source, encode = task.source("train"), task.tokenizer.encode
    lengths = {"inputs": max_input_len, "targets": max_len}

    def read(i):
        ex = source[i]
        return {k: np.asarray(encode(ex[k]), np.int32) for k in ("inputs", "targets")}

    examples = (
        grain.MapDataset.range(len(source))
        .shuffle(seed=seed)
        .repeat(None)
        .map(read)
        .filter(lambda ex: all(len(ex[k]) <= n for k, n in lengths.items()))
        .to_iter_dataset()
    )
    rows = grain.experimental.FirstFitPackIterDataset(
        examples, length_struct=lengths, num_packing_bins=batch_size, shuffle_bins=False
    )
    batches = rows.batch(batch_size)
    return [
        {k: np.asarray(b[k], np.int32) for k in data.BATCH_KEYS}
        for b in itertools.islice(batches, num_batches)
    ]


@pytest.mark.parametrize(
    "name, max_input_len, max_len",
    [("reverse_string/tiny", 41, 41), ("numbers/de_tiny", 8, 24), ("numbers/de_tiny", 16, 64)],
    ids=["tape", "drop-both-sides", "seq2seq"],
)
def test_packed_batches_are_grains_example_by_example(data_dir, name, max_input_len, max_len):
    task = data.load(name, data_dir=data_dir)
    kw = dict(batch_size=32, max_len=max_len, max_input_len=max_input_len, seed=4)
    ours, _ = _run(data.make_loader(task, "train", io=data.LoaderIO(prefetch=0), **kw), 25)
    reference = _reference_batches(task, num_batches=25, **kw)
    assert len(ours) == len(reference) == 25
    for a, b in zip(ours, reference, strict=True):
        for key in data.BATCH_KEYS:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_resuming_mid_group_restores_the_examples_left_for_the_next_one(data_dir):
    """States taken between batches of one packing group (batch 8 of 16 bins' rows is
    not a group boundary: `next_rows` of half a group) restore to the same stream."""
    task = data.load("numbers/de_tiny", data_dir=data_dir)
    kw = dict(batch_size=8, max_len=64, max_input_len=16, seed=6, num_epochs=2)
    kw["io"] = data.LoaderIO(prefetch=0)
    loader = data.make_loader(task, "train", **kw)
    batches, states = _run(loader)
    for k in range(0, len(states) - 1, 5):
        it = iter(loader)
        it.set_state(json.loads(json.dumps(states[k])))
        rest = list(it)
        assert len(rest) == len(batches) - k - 1
        for a, b in zip(rest, batches[k + 1 :], strict=True):
            for key in data.BATCH_KEYS:
                np.testing.assert_array_equal(a[key], b[key])


def _texts():
    return ["", "a", "abc", "zz top", "ÄÖü ß", "😀 emoji", "\ud800 lone", "new\nline", "x" * 300]


def test_char_encode_flat_is_encode_text_by_text():
    tok = data.CharTokenizer(sorted(set("abcxyz ÄÖüß😀\n")))
    texts = _texts()
    ids, lengths = tokenizers.encode_flat(tok, texts)
    expected = [tok.encode(t) for t in texts]
    assert ids.dtype == np.int32 and lengths.dtype == np.int64
    assert lengths.tolist() == [len(e) for e in expected]
    assert ids.tolist() == [i for e in expected for i in e]
    assert data.UNK_ID in ids.tolist()  # "t", "o", "p", "l", ... and the lone surrogate
    empty_ids, empty_lengths = tokenizers.encode_flat(tok, [])
    assert empty_ids.shape == (0,) and empty_lengths.shape == (0,)
    nothing = data.CharTokenizer([])  # every character unknown
    assert tokenizers.encode_flat(nothing, ["ab"])[0].tolist() == nothing.encode("ab")


def test_word_and_sentencepiece_encode_flat_is_encode_text_by_text():
    words = data.WordTokenizer(["jump", "left", "twice", "walk"])
    pieces = data.SentencePieceTokenizer.train(
        [f"{a} {b} {c}" for a in ("eins", "zwei", "drei") for b in ("und", "oder")
         for c in ("vier", "fünf", "sechs")] * 5,
        vocab_size=20,
    )  # fmt: skip
    cases = [
        (words, ["jump left", "walk twice twice", "", "run"]),
        (pieces, ["eins und vier", "drei oder sechs", "", "unbekannt"]),
    ]
    for tok, texts in cases:
        ids, lengths = tokenizers.encode_flat(tok, texts)
        expected = [tok.encode(t) for t in texts]
        assert lengths.tolist() == [len(e) for e in expected]
        assert ids.tolist() == [i for e in expected for i in e]


def test_ragged_take_and_concatenate():
    seqs = [[5, 6], [], [7], [8, 9, 10]]
    r = Ragged.from_lengths(np.array([5, 6, 7, 8, 9, 10]), np.array([2, 0, 1, 3]))
    picked = r.take(np.array([3, 0, 3, 1]))
    assert picked.lengths.tolist() == [3, 2, 3, 0]
    assert picked.ids.tolist() == [*seqs[3], *seqs[0], *seqs[3]]
    both = concatenate([r, picked])
    assert len(both) == 8 and both.ids.tolist() == [5, 6, 7, 8, 9, 10, 8, 9, 10, 5, 6, 8, 9, 10]
    with pytest.raises(ValueError, match="lengths add up to 3, but there are 2 ids"):
        Ragged.from_lengths(np.array([1, 2]), np.array([1, 2]))
