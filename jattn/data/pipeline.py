"""The grain input pipeline: shard, shuffle, tokenize, drop/truncate, pack, batch.

    range(len(split))[index::count]               example indices of this shard
      .shuffle(seed) .repeat(num_epochs)          a new permutation every epoch (seed
                                                  None: the split's order)
      .batch(256) .map(read_block)                one batched array_record read, tokenize
    -> examples: drop or truncate those with inputs longer than max_input_len or
       targets longer than max_len (counted)
      -> pack (first fit over `batch_size` rows) or pad (one example a row)
      -> batch(batch_size)                        a short last batch gets empty rows
      -> prefetch (a background thread)

Encoder rows hold `max_input_len` tokens and decoder rows `max_len` (by default
the same): a task whose sources are much shorter than its targets (digits to
number words) would otherwise spend most of the encoder on padding.

Everything is a deterministic function of (task, split, arguments, seed), and the
iterator's `get_state()` is a small JSON-able dict, so a run restored from a
checkpoint sees exactly the batches an uninterrupted run would (see
`jattn.data.checkpoint` for the orbax glue).
"""

from __future__ import annotations

import atexit
import copy
import time
import weakref
from typing import Any

import grain
import numpy as np

from jattn.data import packing
from jattn.data.tasks import Task

OVERLONG = ("drop", "truncate")


class _ExamplesIterDataset(grain.IterDataset):
    """Blocks of tokenized examples -> single examples, over-long ones dropped or cut.

    `lengths` ({"inputs": n, "targets": m}) limits each side on its own: an example
    is over-long when either side is; "drop" skips it, "truncate" cuts each side to
    its own limit (a side within its limit is kept whole).
    """

    def __init__(
        self,
        blocks: grain.IterDataset,
        lengths: dict[str, int],
        overlong: str,
        num_examples: int | None = None,
    ):
        super().__init__(blocks)
        self._lengths = lengths
        self._overlong = overlong
        self._num_examples = num_examples

    def __iter__(self) -> _ExamplesIterator:
        return _ExamplesIterator(
            self._parent.__iter__(), self._lengths, self._overlong, self._num_examples
        )


class _ExamplesIterator(grain.DatasetIterator):
    """State: the blocks' state before the current block, the offset in it, the counts.

    The counts are per example: one that is over-long on both sides counts once.
    Dropping `num_examples` examples in a row (a whole pass over the shard)
    is an error: no example fits, and a repeating stream would otherwise
    spin forever without yielding.
    """

    def __init__(
        self,
        blocks: grain.DatasetIterator,
        lengths: dict[str, int],
        overlong: str,
        num_examples: int | None = None,
    ):
        super().__init__(blocks)
        self._lengths = lengths
        self._overlong = overlong
        self._num_examples = num_examples
        self._dropped_in_a_row = 0
        self.counts = {"examples": 0, "dropped": 0, "truncated": 0}
        self._block_state = blocks.get_state()
        self._block: list | None = None  # None: not read yet (fresh or restored)
        self._offset = 0  # examples of the current block already taken

    def __next__(self) -> dict[str, np.ndarray]:
        while True:
            if self._block is None:
                self._block = next(self._parent)
            if self._offset == len(self._block):
                before = self._parent.get_state()
                block = next(self._parent)  # at the end: raises, leaving the state whole
                self._block_state, self._block, self._offset = before, block, 0
                continue
            example = self._block[self._offset]
            self._offset += 1
            self.counts["examples"] += 1
            if all(len(example[k]) <= n for k, n in self._lengths.items()):
                self._dropped_in_a_row = 0
                return example
            if self._overlong == "drop":
                self.counts["dropped"] += 1
                self._dropped_in_a_row += 1
                if self._num_examples and self._dropped_in_a_row >= self._num_examples:
                    raise ValueError(
                        f"no example fits the row lengths {self._lengths} (tokens, EOS "
                        f"included): all {self._num_examples} were dropped; raise them or "
                        "use overlong='truncate'"
                    )
                continue
            self.counts["truncated"] += 1
            return {k: example[k][:n] for k, n in self._lengths.items()}

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._block_state, "offset": self._offset, "counts": dict(self.counts)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._block_state = state["parent"]
        self._block = next(self._parent, None) if state["offset"] else None
        if self._block is None and state["offset"]:
            raise ValueError(f"cannot restore {state}: the data ended before it")
        self._offset = state["offset"]
        self.counts = dict(state["counts"])


class _PrefetchIterDataset(grain.IterDataset):
    """grain's thread prefetch, with its iterators closed at interpreter exit.

    grain closes a `ThreadPrefetchDatasetIterator` (stopping its daemon thread) when it
    is garbage collected; one still alive at exit is otherwise closed during module
    teardown, which fails and can abort the process. Open ones are closed at exit.
    """

    def __init__(self, parent: grain.IterDataset, buffer_size: int):
        super().__init__(parent)
        self._buffer_size = buffer_size

    def __iter__(self) -> grain.DatasetIterator:
        it = _PrefetchIterator(self._parent.__iter__(), self._buffer_size)
        _OPEN_PREFETCHERS.add(it)
        return it


class _PrefetchIterator(grain.experimental.ThreadPrefetchDatasetIterator):
    def close(self) -> None:
        if not self._closed:  # a second close (from __del__ at teardown) would fail
            super().close()


_OPEN_PREFETCHERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_prefetchers() -> None:
    for it in list(_OPEN_PREFETCHERS):
        it.close()


_BLOCK = 256  # examples read (and tokenized) together


def _read_block_fn(source, tokenizer):
    encode = tokenizer.encode

    def read_block(indices: np.ndarray) -> list[dict[str, np.ndarray]]:
        return [
            {
                "inputs": np.asarray(encode(ex["inputs"]), np.int32),
                "targets": np.asarray(encode(ex["targets"]), np.int32),
            }
            for ex in source.__getitems__(indices.tolist())
        ]

    return read_block


def _batch_fn(batch_size: int):
    def stack_and_pad(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        out = {}
        for key in packing.BATCH_KEYS:
            x = np.stack([r[key] for r in rows]).astype(np.int32)  # [n, L]
            if len(rows) < batch_size:  # the last batch of a finite stream
                x = np.concatenate([x, np.zeros((batch_size - len(rows), x.shape[1]), np.int32)])
            out[key] = x  # [batch_size, L]
        return out

    return stack_and_pad


def make_loader(
    task: Task,
    split: str,
    *,
    batch_size: int,
    max_len: int,
    seed: int | None,
    max_input_len: int | None = None,
    num_epochs: int | None = None,
    pack: bool = True,
    overlong: str = "drop",
    shard: tuple[int, int] = (0, 1),
    read_threads: int = 0,
    prefetch: int = 2,
) -> grain.IterDataset:
    """The batches of one split, for one process.

    Args:
      task: from `jattn.data.load`.
      split: one of `task.splits`.
      batch_size: rows per batch on this process.
      max_len: target tokens per row (EOS included); also input tokens per row when
        `max_input_len` is None.
      seed: shuffles the examples (a new permutation every epoch); None keeps the
        split's order (evaluation).
      max_input_len: input (encoder) tokens per row, EOS included; None: `max_len`,
        which gives exactly the batches of a loader built without it. Packing fills
        each side's budget on its own and places an example only where both fit.
      num_epochs: passes over the data; None repeats forever.
      pack: several examples a row (first fit); False: one example a row.
      overlong: examples with more than `max_input_len` input tokens or more than
        `max_len` target tokens are "drop"ped or "truncate"d (each side cut to its
        own limit, losing its EOS; a side that fits is kept whole); both counted once
        per example, see `loader_stats`.
      shard: `(index, count)`: this process reads examples index, index + count, ...
        (usually `(jax.process_index(), jax.process_count())`).
      read_threads: threads reading and tokenizing examples (grain ReadOptions); 0 reads
        in the iterating thread, best for local files on few cores.
      prefetch: batches prepared ahead in a background thread (overlapping training
        steps); 0 prepares each batch when asked for. Does not change the batches.

    Returns:
      A grain IterDataset; `iter()` of it yields dicts of int32 arrays: "inputs",
      "inputs_segment_ids", "inputs_positions" [batch_size, max_input_len] and
      "targets", "targets_segment_ids", "targets_positions" [batch_size, max_len];
      segment id k marks the same example on both sides. The iterator has `get_state()` /
      `set_state(state)`. With a finite `num_epochs`, the last batch is padded with
      empty rows (segment id 0 everywhere), and shards may yield different numbers of
      batches.

    Raises:
      ValueError: unknown split, an empty split or shard, bad sizes (a `max_len` or
        `max_input_len` below 1 included) or `overlong`.
    """
    if split not in task.splits:
        raise ValueError(f"task {task.name!r} has no split {split!r}; splits: {task.splits}")
    if not isinstance(batch_size, int | np.integer) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    lengths = packing.row_lengths(max_len, max_input_len)  # {"inputs": Li, "targets": Lt}
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    shard_index, shard_count = shard
    if not (isinstance(shard_count, int) and shard_count >= 1 and 0 <= shard_index < shard_count):
        raise ValueError(f"need shard=(index, count) with 0 <= index < count, got {shard!r}")
    if read_threads < 0 or prefetch < 0:
        raise ValueError(f"read_threads and prefetch must be >= 0, got {read_threads}, {prefetch}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be None or >= 1, got {num_epochs}")
    source = task.source(split)
    if len(source) == 0:
        raise ValueError(f"split {split!r} of task {task.name!r} is empty")
    indices = grain.MapDataset.range(len(source))[shard_index::shard_count]
    if len(indices) == 0:
        raise ValueError(
            f"shard {shard_index} of {shard_count} of split {split!r} ({len(source)} examples) "
            "is empty"
        )
    indices_per_pass = indices
    if seed is not None:
        indices = indices.shuffle(seed=seed)
    indices = indices.repeat(num_epochs)  # with shuffle: a new permutation every epoch
    # Read and tokenize blocks of examples: one batched array_record read per block.
    blocks = indices.batch(_BLOCK, drop_remainder=False).map(_read_block_fn(source, task.tokenizer))
    read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=2 * read_threads)
    examples = _ExamplesIterDataset(
        blocks.to_iter_dataset(read),
        lengths,
        overlong,
        # A repeating stream that drops a whole pass would spin forever; a finite one ends.
        num_examples=len(indices_per_pass) if num_epochs is None else None,
    )
    if pack:
        rows = packing.PackIterDataset(
            examples,
            max_len=lengths["targets"],
            max_input_len=lengths["inputs"],
            num_bins=batch_size,
        )
    else:
        rows = examples.map(
            lambda ex: packing.pad_to_row(ex, lengths["targets"], lengths["inputs"])
        )
    batches = rows.batch(batch_size, drop_remainder=False, batch_fn=_batch_fn(batch_size))
    return _PrefetchIterDataset(batches, prefetch) if prefetch else batches


def loader_stats(iterator: grain.DatasetIterator) -> dict[str, int]:
    """Counts of an iterator from `make_loader`: examples read, dropped, truncated.

    Counts include examples read ahead into the packer but not yet emitted.
    """
    todo = [iterator]
    while todo:
        it = todo.pop()
        if isinstance(it, _ExamplesIterator):
            return copy.deepcopy(it.counts)
        todo.extend(getattr(it, "_parents", ()))
    raise ValueError(f"{iterator!r} is not an iterator of a make_loader dataset")


def measure_loader(
    task: Task,
    split: str = "train",
    *,
    batch_size: int = 64,
    max_len: int = 64,
    max_input_len: int | None = None,
    num_batches: int = 50,
    seed: int = 0,
    **loader_kwargs,
) -> dict[str, float]:
    """Packing efficiency and throughput of `make_loader` on this machine.

    Builds a loader (without background prefetch, so that the time measured is the
    pipeline's own), skips one warm-up batch, then times `num_batches` batches.

    Returns:
      examples_per_s: examples read (tokenized, packed or dropped) per second.
      batches_per_s: batches per second.
      examples_per_row: examples per row (packing factor).
      inputs_efficiency, targets_efficiency: real tokens / all tokens of that side of
        the batches (its row length is `max_input_len`, resp. `max_len`).
      dropped_fraction, truncated_fraction: of the examples read.
    """
    loader_kwargs.setdefault("prefetch", 0)
    loader = make_loader(
        task,
        split,
        batch_size=batch_size,
        max_len=max_len,
        max_input_len=max_input_len,
        seed=seed,
        **loader_kwargs,
    )
    it = iter(loader)
    next(it)
    start_counts = loader_stats(it)
    real = {"inputs": 0, "targets": 0}
    total = {"inputs": 0, "targets": 0}
    segments = 0
    start = time.perf_counter()
    for _ in range(num_batches):
        batch = next(it)
        for key in real:
            real[key] += int(np.count_nonzero(batch[f"{key}_segment_ids"]))
            total[key] += batch[f"{key}_segment_ids"].size
        segments += int(batch["targets_segment_ids"].max(axis=1).sum())
    elapsed = time.perf_counter() - start
    counts = loader_stats(it)
    read = counts["examples"] - start_counts["examples"]
    return {
        "examples_per_s": read / elapsed,
        "batches_per_s": num_batches / elapsed,
        "examples_per_row": segments / (num_batches * batch_size),
        "inputs_efficiency": real["inputs"] / total["inputs"],
        "targets_efficiency": real["targets"] / total["targets"],
        "dropped_fraction": (counts["dropped"] - start_counts["dropped"]) / max(read, 1),
        "truncated_fraction": (counts["truncated"] - start_counts["truncated"]) / max(read, 1),
    }
