"""Reading a split for the pipeline: a shard's shuffled index blocks and their tokens.

    index_blocks(n, ...)[k]        int64 [<= BLOCK]: source indices of block k,
                                   exactly grain's range[shard::count].shuffle.repeat.batch
    read_blocks_fn(source, ...)    block -> {"inputs": Ragged, "targets": Ragged}

Why not grain's own chain: its `MapDataset`s move one index at a time through
five Python layers, which cost as much as everything else the pipeline does
to an example. `index_blocks` computes a block at once (calling grain's own
`index_shuffle`, so the order is grain's) and keeps the chain's length, so
the iterator's state (``{"next_index": k}``) is the one it replaces.

A shard of at most `CACHE_EXAMPLES` examples is read and tokenized whole on
first use and kept in memory as two flat arrays (about 4 bytes a token): a
training run repeats its data many times, and a random read from array_record
plus its tf.Example parse (about 18 us an example on the shared CPU of
docs/benchmarks.md) cost as much as all the rest of an example's way to a
batch. Larger shards are read a block at a time.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable
from typing import Any

import grain
import numpy as np
from grain.experimental import index_shuffle

from jattn.data import tokenizers
from jattn.data.ragged import Ragged, concatenate

BLOCK = 256  # examples read (and tokenized) together: one index of the blocks' state
CACHE_EXAMPLES = 1 << 18  # shards up to this many examples are kept in memory, tokenized
_READ_CHUNK = 4096  # examples a read while filling the cache


def shard_size(num_examples: int, shard_index: int, shard_count: int) -> int:
    """Examples of shard `shard_index` of `shard_count`: indices shard_index, + count, ..."""
    return len(range(shard_index, num_examples, shard_count))


class _IndexBlocks(grain.MapDataset):
    """See `index_blocks`."""

    def __init__(
        self,
        num_examples: int,
        shard_index: int,
        shard_count: int,
        seed: int | None,
        num_epochs: int | None,
        block: int,
    ):
        super().__init__()
        self._shard_index, self._shard_count = shard_index, shard_count
        self._per_epoch = shard_size(num_examples, shard_index, shard_count)
        self._seed = seed
        self._block = block
        # grain's lengths: repeat() forever is sys.maxsize elements, batch() rounds up.
        self._elements = sys.maxsize if num_epochs is None else num_epochs * self._per_epoch
        self._length = -(-self._elements // block)

    def __len__(self) -> int:
        return self._length

    def __str__(self) -> str:
        return f"IndexBlocks(shard={self._shard_index}/{self._shard_count}, block={self._block})"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        # grain's batch(): past its length, the blocks of the elements after its length.
        rounds, index = divmod(index, self._length)
        start = index * self._block
        stop = min(self._elements, start + self._block)
        elements = np.arange(start, stop, dtype=np.int64) + rounds * self._elements
        epoch, position = np.divmod(elements, self._per_epoch)
        if self._seed is not None:  # grain's ShuffleMapDataset: a permutation per epoch
            seeds = ((self._seed + epoch) % 2**32).tolist()
            shuffled = map(
                index_shuffle,
                position.tolist(),
                itertools.repeat(self._per_epoch - 1),
                seeds,
                itertools.repeat(4),  # grain's rounds
            )
            position = np.fromiter(shuffled, np.int64, len(seeds))
        return self._shard_index + position * self._shard_count


def index_blocks(
    num_examples: int,
    *,
    shard_index: int = 0,
    shard_count: int = 1,
    seed: int | None = None,
    num_epochs: int | None = None,
    block: int = BLOCK,
) -> grain.MapDataset:
    """The example indices a shard reads, `block` at a time, in grain's order.

    Element k (int64 [block], the last of a finite stream shorter) is element k of
    ``grain.MapDataset.range(num_examples)[shard_index::shard_count]``
    ``.shuffle(seed=seed)`` (None: not shuffled) ``.repeat(num_epochs)``
    ``.batch(block, drop_remainder=False)``, and the length is that chain's:
    a new permutation every epoch, blocks running across epochs.

    Raises:
      ValueError: a seed outside [0, 2**32), as grain's shuffle.
    """
    if seed is not None and not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    return _IndexBlocks(num_examples, shard_index, shard_count, seed, num_epochs, block)


def read_examples(source: Any, tokenizer: Any, indices) -> dict[str, Ragged]:
    """The examples at `indices` of a `TextSource`, tokenized: {"inputs", "targets"}."""
    texts = source.__getitems__([int(i) for i in indices])
    out = {}
    for key in ("inputs", "targets"):
        ids, lengths = tokenizers.encode_flat(tokenizer, [ex[key] for ex in texts])
        out[key] = Ragged.from_lengths(ids, lengths)
    return out


class _ShardTokens:
    """Every example of one shard, tokenized, read on first use (once, across threads)."""

    def __init__(self, source: Any, tokenizer: Any, shard_index: int, shard_count: int):
        self._read = lambda indices: read_examples(source, tokenizer, indices)
        self._indices = range(shard_index, len(source), shard_count)
        self._lock = threading.Lock()
        self._tokens: dict[str, Ragged] | None = None

    def get(self) -> dict[str, Ragged]:
        if self._tokens is not None:
            return self._tokens
        with self._lock:
            if self._tokens is None:
                chunks = [
                    self._read(self._indices[i : i + _READ_CHUNK])
                    for i in range(0, len(self._indices), _READ_CHUNK)
                ]
                self._tokens = {k: concatenate([c[k] for c in chunks]) for k in chunks[0]}
            return self._tokens


def read_blocks_fn(
    source: Any,
    tokenizer: Any,
    *,
    shard_index: int = 0,
    shard_count: int = 1,
    cache: bool | None = None,
) -> Callable[[np.ndarray], dict[str, Ragged]]:
    """The function from a block of source indices to its examples, tokenized.

    Args:
      source: a `TextSource` (`Task.source(split)`), not empty.
      tokenizer: its task's tokenizer.
      shard_index, shard_count: the shard the indices come from (`index_blocks`).
      cache: keep the shard's tokens in memory, read whole on first use; None: when the
        shard has at most `CACHE_EXAMPLES` examples. The blocks are the same either way.
    """
    size = shard_size(len(source), shard_index, shard_count)
    if cache is None:
        cache = size <= CACHE_EXAMPLES
    if not cache:
        return lambda indices: read_examples(source, tokenizer, indices)
    shard = _ShardTokens(source, tokenizer, shard_index, shard_count)

    def read_block(indices: np.ndarray) -> dict[str, Ragged]:
        local = (np.asarray(indices, np.int64) - shard_index) // shard_count  # [block]
        return {key: tokens.take(local) for key, tokens in shard.get().items()}

    return read_block
