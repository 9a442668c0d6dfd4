"""The grain input pipeline: shard, shuffle, tokenize, drop/truncate, pack, batch.

    range(len(split))[index::count]               example indices of this shard
      .shuffle(seed) .repeat(num_epochs)          a new permutation every epoch
      .batch(256) .map(read_block)                tokens of 256 examples in flat arrays
                                                  (jattn.data.reading: the shard read
                                                  and tokenized once, kept in memory)
    -> examples: drop or truncate those with inputs longer than max_input_len or
       targets longer than max_len (counted)
      -> pack (first fit over `batch_size` rows) or pad (one example a row)
      -> batch(batch_size)                        a short last batch gets empty rows
      -> prefetch (a background thread)

Examples travel one at a time only where the order matters (dropping and
first fit); tokenizing, reading and building a group's rows work on arrays
of a whole block or group (docs/benchmarks.md, "A config's rows, this tree
against an earlier one": about 5x the batches a second of the per-example
pipeline before it, batch for batch and state for state the same).

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
from typing import Any, NamedTuple

import grain
import numpy as np

from jattn.data import packing, reading
from jattn.data.ragged import Ragged
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


class _Block:
    """A block's examples as the packer takes them: those it yields (all, or those that
    fit when over-long ones are dropped, each side cut to its limit when truncated),
    and the counts an offset into the block stands for."""

    def __init__(self, block: dict[str, Ragged], lengths: dict[str, int], overlong: str):
        inputs, targets = block["inputs"], block["targets"]
        self.size = len(inputs)
        n_in, n_tg = inputs.lengths, targets.lengths  # [size]
        fits = (n_in <= lengths["inputs"]) & (n_tg <= lengths["targets"])
        if overlong == "drop":
            kept, truncated = np.flatnonzero(fits), np.zeros(self.size, bool)
            n_in, n_tg = n_in[kept], n_tg[kept]
        else:
            kept, truncated = np.arange(self.size), ~fits
            n_in = np.minimum(n_in, lengths["inputs"])
            n_tg = np.minimum(n_tg, lengths["targets"])
        self.examples = packing.ExampleBlock(
            inputs.ids, inputs.offsets[kept], n_in.tolist(),
            targets.ids, targets.offsets[kept], n_tg.tolist(),
        )  # fmt: skip
        self.offset_after = (kept + 1).tolist()  # [K]: the offset just after example k
        is_kept = np.zeros(self.size, np.int64)
        is_kept[kept] = 1
        # [size + 1]: examples kept, resp. truncated, among the first i of the block.
        self.kept_before = np.concatenate([[0], np.cumsum(is_kept)]).tolist()
        self.truncated_before = np.concatenate([[0], np.cumsum(truncated)]).tolist()

    def counts(self, start: int, stop: int) -> tuple[int, int, int]:
        """(examples, dropped, truncated) of offsets start..stop-1."""
        kept = self.kept_before[stop] - self.kept_before[start]
        truncated = self.truncated_before[stop] - self.truncated_before[start]
        return stop - start, stop - start - kept, truncated


class _ExamplesIterator(grain.DatasetIterator):
    """State: the blocks' state before the current block, the offset in it, the counts.

    The packer takes examples a span at a time (`next_span`: the examples of one block
    from here, tokens in flat arrays) and says how many it used (`commit`); the state
    moves only on a commit, so an example looked at and left for the next group is
    before the state. `next()` gives one example, as a dict of views. The counts are
    per example: one that is over-long on both sides counts once. Dropping
    `num_examples` examples in a row (a whole pass over the shard) is an error: no
    example fits, and a repeating stream would otherwise spin forever without yielding.
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
        self.counts = {"examples": 0, "dropped": 0, "truncated": 0}
        self._block_state = blocks.get_state()
        self._offset = 0  # examples of the current block already taken
        # Blocks read: the current one first (once read), then those looked ahead into,
        # each with the blocks' state before it.
        self._ahead: list[tuple[Any, _Block]] = []

    def _read(self) -> bool:
        before = self._parent.get_state()
        block = next(self._parent, None)
        if block is None:
            return False
        self._ahead.append((before, _Block(block, self._lengths, self._overlong)))
        return True

    def next_span(self) -> tuple[packing.ExampleBlock, int] | None:
        """(examples, k): the examples to take next are examples[k:]; None at the end."""
        i, offset, dropped = 0, self._offset, 0
        while True:
            if i == len(self._ahead) and not self._read():
                if self._ahead:  # the end: the drops after the last example are counted
                    self._move(len(self._ahead) - 1, self._ahead[-1][1].size)
                return None
            block = self._ahead[i][1]
            k = block.kept_before[offset]  # the first kept example at or after `offset`
            stop = block.offset_after[k] - 1 if k < len(block.examples) else block.size
            dropped += stop - offset
            if self._num_examples and dropped >= self._num_examples:
                raise ValueError(
                    f"no example fits the row lengths {self._lengths} (tokens, EOS "
                    f"included): all {self._num_examples} were dropped; raise them or "
                    "use overlong='truncate'"
                )
            if k < len(block.examples):
                return block.examples, k
            i, offset = i + 1, 0

    def commit(self, examples: packing.ExampleBlock, stop: int) -> None:
        """The examples of `next_span`'s block before `stop` are taken."""
        i = next(i for i, (_, b) in enumerate(self._ahead) if b.examples is examples)
        self._move(i, self._ahead[i][1].offset_after[stop - 1])

    def _move(self, i: int, offset: int) -> None:
        """To `offset` in the i-th block read, counting the examples passed."""
        for j in range(i + 1):
            block = self._ahead[j][1]
            start = self._offset if j == 0 else 0
            passed = block.counts(start, offset if j == i else block.size)
            for key, n in zip(("examples", "dropped", "truncated"), passed, strict=True):
                self.counts[key] += n
        self._block_state, self._offset = self._ahead[i][0], offset
        del self._ahead[:i]

    def __next__(self) -> dict[str, np.ndarray]:
        span = self.next_span()
        if span is None:
            raise StopIteration
        examples, k = span
        self.commit(examples, k + 1)
        return examples.example(k)

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._block_state, "offset": self._offset, "counts": dict(self.counts)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._block_state = state["parent"]
        self._ahead = []
        if state["offset"] and not self._read():
            raise ValueError(f"cannot restore {state}: the data ended before it")
        self._offset = state["offset"]
        self.counts = dict(state["counts"])


class _BatchIterDataset(grain.IterDataset):
    """`batch_size` rows a batch from a packer's or padder's `next_rows`; a short
    last batch gets empty rows (segment id 0). The state is the rows' state."""

    def __init__(self, parent: grain.IterDataset, batch_size: int):
        super().__init__(parent)
        self._batch_size = batch_size

    def __iter__(self) -> _BatchIterator:
        return _BatchIterator(self._parent.__iter__(), self._batch_size)


class _BatchIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, batch_size: int):
        super().__init__(parent)
        self._batch_size = batch_size

    def __next__(self) -> dict[str, np.ndarray]:
        rows = self._parent.next_rows(self._batch_size)
        if rows is None:
            raise StopIteration
        short = self._batch_size - len(rows["inputs"])
        if short:  # the last batch of a finite stream
            rows = {
                k: np.concatenate([v, np.zeros((short, v.shape[1]), np.int32)])
                for k, v in rows.items()
            }
        return {key: rows[key] for key in packing.BATCH_KEYS}  # [batch_size, L]

    def get_state(self):
        return self._parent.get_state()

    def set_state(self, state) -> None:
        self._parent.set_state(state)


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


class LoaderIO(NamedTuple):
    """How `make_loader` reads a split: none of it changes the batches.

    Attributes:
      threads: threads reading and tokenizing examples (grain ReadOptions); 0 reads
        in the iterating thread, best for local files on few cores.
      prefetch: batches prepared ahead in a background thread (overlapping training
        steps); 0 prepares each batch when asked for.
      cache: read and tokenize this process's shard of the split whole on the first
        batch and keep its tokens in memory; None: when the stream repeats
        (`num_epochs` not 1) and the shard has at most
        `jattn.data.reading.CACHE_EXAMPLES` examples.
    """

    threads: int = 0
    prefetch: int = 2
    cache: bool | None = None


def make_loader(
    task: Task,
    split: str,
    *,
    batch_size: int,
    max_len: int,
    seed: int,
    max_input_len: int | None = None,
    shuffle: bool = True,
    num_epochs: int | None = None,
    pack: bool = True,
    overlong: str = "drop",
    shard: tuple[int, int] = (0, 1),
    io: LoaderIO = LoaderIO(),  # noqa: B008 (an immutable default)
) -> grain.IterDataset:
    """The batches of one split, for one process.

    Args:
      task: from `jattn.data.load`.
      split: one of `task.splits`.
      batch_size: rows per batch on this process.
      max_len: target tokens per row (EOS included); also input tokens per row when
        `max_input_len` is None.
      seed: shuffles the examples (a new permutation every epoch).
      max_input_len: input (encoder) tokens per row, EOS included; None: `max_len`,
        which gives exactly the batches of a loader built without it. Packing fills
        each side's budget on its own and places an example only where both fit.
      shuffle: False keeps the split's order (evaluation).
      num_epochs: passes over the data; None repeats forever.
      pack: several examples a row (first fit); False: one example a row.
      overlong: examples with more than `max_input_len` input tokens or more than
        `max_len` target tokens are "drop"ped or "truncate"d (each side cut to its
        own limit, losing its EOS; a side that fits is kept whole); both counted once
        per example, see `loader_stats`.
      shard: `(index, count)`: this process reads examples index, index + count, ...
        (usually `(jax.process_index(), jax.process_count())`).
      io: how the split is read (threads, prefetch, cache; `LoaderIO`), which never
        changes the batches.

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
    read_threads, prefetch, cache = io
    if read_threads < 0 or prefetch < 0:
        raise ValueError(f"io: threads and prefetch must be >= 0, got {read_threads}, {prefetch}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be None or >= 1, got {num_epochs}")
    source = task.source(split)
    if len(source) == 0:
        raise ValueError(f"split {split!r} of task {task.name!r} is empty")
    per_pass = reading.shard_size(len(source), shard_index, shard_count)
    if per_pass == 0:
        raise ValueError(
            f"shard {shard_index} of {shard_count} of split {split!r} ({len(source)} examples) "
            "is empty"
        )
    indices = reading.index_blocks(
        len(source),
        shard_index=shard_index,
        shard_count=shard_count,
        seed=seed if shuffle else None,  # with a seed: a new permutation every epoch
        num_epochs=num_epochs,
    )
    if cache is None and num_epochs == 1:
        cache = False  # one pass reads each example once: keeping them would read ahead
    read_block = reading.read_blocks_fn(
        source, task.tokenizer, shard_index=shard_index, shard_count=shard_count, cache=cache
    )
    read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=2 * read_threads)
    examples = _ExamplesIterDataset(
        indices.map(read_block).to_iter_dataset(read),
        lengths,
        overlong,
        # A repeating stream that drops a whole pass would spin forever; a finite one ends.
        num_examples=per_pass if num_epochs is None else None,
    )
    if pack:
        rows = packing.PackIterDataset(
            examples,
            max_len=lengths["targets"],
            max_input_len=lengths["inputs"],
            num_bins=batch_size,
        )
    else:
        rows = packing.PadIterDataset(
            examples, max_len=lengths["targets"], max_input_len=lengths["inputs"]
        )
    batches = _BatchIterDataset(rows, batch_size)
    return _PrefetchIterDataset(batches, prefetch) if prefetch else batches


def loader_stats(iterator: grain.DatasetIterator) -> dict[str, int]:
    """Counts of an iterator from `make_loader`: examples read, dropped, truncated.

    Counts run to the last example the packer has taken, in rows not yet emitted
    too; the example a full group of rows left for the next group is not counted yet
    (the state, restored, gives it again).
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
    loader_kwargs.setdefault("io", LoaderIO(prefetch=0))
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
