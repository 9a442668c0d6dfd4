"""Packing: several examples a row, with segment ids and positions; and the inverse.

A packed row holds whole examples one after the other, in `max_input_len` encoder
slots and `max_len` decoder slots (the two may differ: in a translation task
whose sources are much shorter than its targets, equal lengths would leave
most encoder slots as padding). For each of "inputs" and "targets":

- ``<key>_segment_ids[b, t]``: 1, 2, ... for the 1st, 2nd, ... example of the row,
  0 for padding;
- ``<key>_positions[b, t]``: 0, 1, ... restarting at every segment, 0 for padding.

An example's inputs and targets land in the same row with the same segment id,
so the attention masks (`q_segment_ids == kv_segment_ids`) keep encoder,
decoder and cross attention inside one example. No example is ever split
across rows, and an example goes into a row only if both of its sides fit
there; each side fills its own budget.

`PackIterDataset` packs first fit (the algorithm of grain's FirstFitPackIterDataset,
in a lean form) with a resumable iterator state; `PadIterDataset` puts one example
in a row (`pad_to_row`, the unpacked layout); both give k rows at once
(`next_rows`), built by one scatter of all their tokens rather than a row and an
example at a time. `unpack` is the inverse.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import grain
import numpy as np

FEATURES = ("inputs", "targets")
BATCH_KEYS = (
    "inputs",
    "targets",
    "inputs_segment_ids",
    "targets_segment_ids",
    "inputs_positions",
    "targets_positions",
)


def row_lengths(max_len: int, max_input_len: int | None = None) -> dict[str, int]:
    """Tokens a row per feature: {"inputs": max_input_len or max_len, "targets": max_len}.

    Args:
      max_len: decoder (targets) slots a row; also the encoder's when `max_input_len`
        is None.
      max_input_len: encoder (inputs) slots a row; None: `max_len`.

    Raises:
      ValueError: a length that is not a positive int (0 included: a row needs room
        for at least the EOS token).
    """

    def positive(arg: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            hint = " or None (= max_len)" if arg == "max_input_len" else ""
            raise ValueError(f"{arg} must be a positive int{hint}, got {value!r}")
        return int(value)

    targets = positive("max_len", max_len)
    inputs = targets if max_input_len is None else positive("max_input_len", max_input_len)
    return {"inputs": inputs, "targets": targets}


def _limit_name(key: str) -> str:
    return "max_input_len" if key == "inputs" else "max_len"


def pad_to_row(
    example: dict[str, np.ndarray], max_len: int, max_input_len: int | None = None
) -> dict[str, np.ndarray]:
    """One example in a row: segment id 1 on its tokens, 0 on padding.

    Args:
      example: {"inputs": int [Li], "targets": int [Lt]} with Li <= max_input_len
        and Lt <= max_len.
      max_len: targets row length (and inputs', when `max_input_len` is None).
      max_input_len: inputs row length; None: `max_len`.

    Returns:
      The six BATCH_KEYS: "inputs*" int32 [max_input_len], "targets*" int32 [max_len].
    """
    lengths = row_lengths(max_len, max_input_len)
    block = ExampleBlock.of([example])
    _check_fits(block, 0, lengths)
    rows = _Rows(lengths)
    rows.add(_Piece(block, 0, 1, [0], {"inputs": [0], "targets": [0]}, [1]))
    return {k: v[0] for k, v in rows.build(1).items()}


@dataclasses.dataclass(frozen=True)
class ExampleBlock:
    """Examples as the packer reads them: their lengths as Python ints (first fit is a
    loop over them) and their tokens where they lie, in flat arrays.

    Example k's inputs are ``inputs[inputs_starts[k]:][:inputs_lengths[k]]``, its
    targets likewise.
    """

    inputs: np.ndarray  # int32 [any]
    inputs_starts: np.ndarray  # int64 [K]
    inputs_lengths: list[int]  # [K]
    targets: np.ndarray
    targets_starts: np.ndarray
    targets_lengths: list[int]

    @classmethod
    def of(cls, examples: list[dict[str, np.ndarray]]) -> ExampleBlock:
        """A block of {"inputs", "targets"} examples (int sequences), each key's tokens
        copied end to end."""
        fields = {}
        for key in FEATURES:
            sides = [np.asarray(ex[key], np.int32).reshape(-1) for ex in examples]
            lengths = [len(x) for x in sides]
            fields[key] = np.concatenate(sides) if sides else np.zeros(0, np.int32)
            fields[f"{key}_starts"] = np.cumsum([0, *lengths], dtype=np.int64)[:-1]
            fields[f"{key}_lengths"] = lengths
        return cls(**fields)

    def __len__(self) -> int:
        return len(self.inputs_lengths)

    def example(self, k: int) -> dict[str, np.ndarray]:
        """Example k, {"inputs": int32 [n], "targets": int32 [m]}: views of the block."""
        out = {}
        for key in FEATURES:
            start = int(getattr(self, f"{key}_starts")[k])
            out[key] = getattr(self, key)[start : start + getattr(self, f"{key}_lengths")[k]]
        return out


def _check_fits(block: ExampleBlock, k: int, lengths: dict[str, int]) -> None:
    for key in FEATURES:
        n = getattr(block, f"{key}_lengths")[k]
        if n > lengths[key]:
            raise ValueError(f"{key} has {n} tokens, more than {_limit_name(key)}={lengths[key]}")


class _Piece(NamedTuple):
    """Examples first..stop-1 of a block, placed: one entry each in the lists."""

    block: ExampleBlock
    first: int
    stop: int
    rows: list[int]
    columns: dict[str, list[int]]  # per side: the slot where the example's tokens start
    segments: list[int]


class _Rows:
    """Rows being filled: where each placed example goes, then all tokens at once."""

    def __init__(self, lengths: dict[str, int]):
        self._lengths = lengths
        self._pieces: list[_Piece] = []

    def add(self, piece: _Piece) -> None:
        if piece.stop > piece.first:
            self._pieces.append(piece)

    def build(self, num_rows: int) -> dict[str, np.ndarray]:
        """The six BATCH_KEYS, int32 [num_rows, row length of the side]."""
        out = {}
        for key in FEATURES:
            width = self._lengths[key]
            tokens, segments, positions = (np.zeros(num_rows * width, np.int32) for _ in "tsp")
            for p in self._pieces:
                n = np.array(getattr(p.block, f"{key}_lengths")[p.first : p.stop], np.int64)  # [E]
                # Token t of the piece is token `within` of its example.
                within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # [T]
                starts = getattr(p.block, f"{key}_starts")[p.first : p.stop]
                source = np.repeat(starts, n) + within
                slot = np.array(p.rows, np.int64) * width + np.array(p.columns[key], np.int64)
                target = np.repeat(slot, n) + within  # [T]
                tokens[target] = getattr(p.block, key)[source]
                segments[target] = np.repeat(np.array(p.segments, np.int32), n)
                positions[target] = within
            out[key] = tokens.reshape(num_rows, width)
            out[f"{key}_segment_ids"] = segments.reshape(num_rows, width)
            out[f"{key}_positions"] = positions.reshape(num_rows, width)
        return out


class _OneAtATime:
    """Blocks of one example from an iterator of {"inputs", "targets"} dicts, with the
    span protocol of the pipeline's examples iterator (`next_span`, `commit`,
    `get_state`): an example looked at but not committed is given again, and the
    state is the one before it."""

    def __init__(self, parent: grain.DatasetIterator):
        self._parent = parent
        self._pending = None  # (parent state before the example, its block)

    def next_span(self) -> tuple[ExampleBlock, int] | None:
        if self._pending is None:
            before = self._parent.get_state()
            try:
                example = next(self._parent)
            except StopIteration:
                return None
            self._pending = (before, ExampleBlock.of([example]))
        return self._pending[1], 0

    def commit(self, block: ExampleBlock, stop: int) -> None:
        self._pending = None

    def get_state(self):
        return self._pending[0] if self._pending else self._parent.get_state()

    def set_state(self, state) -> None:
        self._pending = None
        self._parent.set_state(state)


def _spans(parent: grain.DatasetIterator):
    """`parent` if it gives spans of examples (the pipeline's), else one at a time."""
    return parent if hasattr(parent, "next_span") else _OneAtATime(parent)


class PackIterDataset(grain.IterDataset):
    """First-fit packing of {"inputs", "targets"} int32 examples into rows.

    A row has `max_input_len` inputs slots and `max_len` targets slots (both
    `max_len` when `max_input_len` is None). Examples are taken in order and each
    goes into the first of `num_bins` rows where both its inputs and its targets
    still fit, each side in its own budget. When one fits nowhere, the non-empty
    rows are emitted in order and a new group of rows starts with it. Every example
    must already fit an empty row (see the pipeline's `overlong`).

    The iterator state is the parent's state at the start of the current group plus
    the number of its rows already emitted; restoring re-packs that group (packing is
    deterministic) and skips those rows. Besides one row per `next()`, the iterator
    gives the next k rows at once as arrays (`next_rows(k)`), which the pipeline's
    batches take. A parent with `next_span` / `commit` (the pipeline's examples
    iterator) hands over whole blocks of examples, so that first fit is a loop over
    ints and a group's rows are built by one scatter of all its tokens.
    """

    def __init__(
        self,
        parent: grain.IterDataset,
        *,
        max_len: int,
        num_bins: int,
        max_input_len: int | None = None,
    ):
        super().__init__(parent)
        self._lengths = row_lengths(max_len, max_input_len)
        if isinstance(num_bins, bool) or not isinstance(num_bins, int | np.integer) or num_bins < 1:
            raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
        self._num_bins = int(num_bins)

    def __iter__(self) -> _PackIterator:
        return _PackIterator(self._parent.__iter__(), self._lengths, self._num_bins)


class _PackIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, lengths: dict[str, int], num_bins: int):
        super().__init__(parent)
        self._lengths = lengths
        self._num_bins = num_bins
        self._examples = _spans(parent)
        self._reset(self._examples.get_state(), emitted=0)

    def _reset(self, group_state, emitted: int) -> None:
        self._group_state = group_state  # parent state where the current group starts
        self._rows: dict[str, np.ndarray] | None = None  # None: not packed yet
        self._num_rows = 0
        self._emitted = emitted  # rows of the current group already returned

    def _pack_group(self) -> None:
        """Packs the next group into self._rows (no rows: the parent has ended)."""
        capacity_in, capacity_tg = self._lengths["inputs"], self._lengths["targets"]
        num_bins = self._num_bins
        free_in, free_tg = [capacity_in] * num_bins, [capacity_tg] * num_bins
        count = [0] * num_bins  # examples a bin holds
        used = 0  # bins 0 .. used-1 hold examples: first fit fills them in order
        rows = _Rows(self._lengths)
        full = False
        while not full:
            span = self._examples.next_span()
            if span is None:
                break
            block, first = span
            lengths_in, lengths_tg = block.inputs_lengths, block.targets_lengths
            bins, columns_in, columns_tg, segments = [], [], [], []
            k = first
            for k in range(first, len(block)):
                n_in, n_tg = lengths_in[k], lengths_tg[k]
                for b in range(used):
                    if free_in[b] >= n_in and free_tg[b] >= n_tg:
                        break
                else:
                    if n_in > capacity_in or n_tg > capacity_tg:
                        raise ValueError(
                            f"example of (inputs, targets) lengths {(n_in, n_tg)} does not "
                            f"fit a row of {(capacity_in, capacity_tg)}"
                        )
                    if used == num_bins:
                        full = True
                        break
                    b = used
                    used += 1
                bins.append(b)
                columns_in.append(capacity_in - free_in[b])
                columns_tg.append(capacity_tg - free_tg[b])
                count[b] += 1
                segments.append(count[b])
                free_in[b] -= n_in
                free_tg[b] -= n_tg
            else:
                k = len(block)
            columns = {"inputs": columns_in, "targets": columns_tg}
            rows.add(_Piece(block, first, k, bins, columns, segments))
            if k > first:
                self._examples.commit(block, k)
        self._rows = rows.build(used)
        self._num_rows = used

    def next_rows(self, k: int) -> dict[str, np.ndarray] | None:
        """The next (up to) `k` rows as arrays [m, L], m < k only where the data ends;
        None: no row is left. The state after it is the state after m `next()` calls."""
        parts = []
        while k > 0:
            if self._rows is None:  # fresh or restored: (re-)pack the current group
                self._pack_group()
            if self._emitted >= self._num_rows:  # used up: the next group starts
                self._group_state = self._examples.get_state()
                self._emitted = 0
                self._pack_group()
                if not self._num_rows:
                    break
                continue
            stop = min(self._num_rows, self._emitted + k)
            parts.append({key: v[self._emitted : stop] for key, v in self._rows.items()})
            k -= stop - self._emitted
            self._emitted = stop
        if len(parts) <= 1:
            return parts[0] if parts else None
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    def __next__(self) -> dict[str, np.ndarray]:
        rows = self.next_rows(1)
        if rows is None:
            raise StopIteration
        return {k: v[0] for k, v in rows.items()}

    def get_state(self) -> dict:
        return {"parent": self._group_state, "emitted": self._emitted}

    def set_state(self, state: dict) -> None:
        self._examples.set_state(state["parent"])
        self._reset(state["parent"], emitted=state["emitted"])


class PadIterDataset(grain.IterDataset):
    """One example a row (`pad_to_row`), with `next_rows(k)` as `PackIterDataset`'s.

    The state is the parent's: a row is an example.
    """

    def __init__(
        self, parent: grain.IterDataset, *, max_len: int, max_input_len: int | None = None
    ):
        super().__init__(parent)
        self._lengths = row_lengths(max_len, max_input_len)

    def __iter__(self) -> _PadIterator:
        return _PadIterator(self._parent.__iter__(), self._lengths)


class _PadIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, lengths: dict[str, int]):
        super().__init__(parent)
        self._lengths = lengths
        self._examples = _spans(parent)

    def next_rows(self, k: int) -> dict[str, np.ndarray] | None:
        """The next (up to) `k` examples, a row each; None: no example is left."""
        rows = _Rows(self._lengths)
        taken = 0
        while taken < k:
            span = self._examples.next_span()
            if span is None:
                break
            block, first = span
            stop = min(len(block), first + k - taken)
            for i in range(first, stop):
                _check_fits(block, i, self._lengths)
            n = stop - first
            columns = {"inputs": [0] * n, "targets": [0] * n}
            rows.add(_Piece(block, first, stop, list(range(taken, taken + n)), columns, [1] * n))
            self._examples.commit(block, stop)
            taken += stop - first
        return rows.build(taken) if taken else None

    def __next__(self) -> dict[str, np.ndarray]:
        rows = self.next_rows(1)
        if rows is None:
            raise StopIteration
        return {k: v[0] for k, v in rows.items()}

    def get_state(self):
        return self._examples.get_state()

    def set_state(self, state) -> None:
        self._examples.set_state(state)


def unpack(rows: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The examples of packed rows, in row-major order (row 0's segments first).

    Args:
      rows: the six BATCH_KEYS, "inputs*" int [B, Li] and "targets*" int [B, Lt]
        (Li and Lt may differ), or a single row ([Li], [Lt]).

    Returns:
      [{"inputs": int [Li], "targets": int [Lt]}, ...], one per segment id >= 1.

    Raises:
      ValueError: if a row breaks the packing invariants (a segment not contiguous,
        positions not 0..n-1 inside a segment, padding with nonzero tokens or
        positions, inputs and targets with different segment ids).
    """
    rows = {k: np.atleast_2d(np.asarray(rows[k])) for k in BATCH_KEYS}
    examples = []
    for b in range(rows["inputs"].shape[0]):
        per_key = {}
        for key in FEATURES:
            ids, seg, pos = (
                rows[key][b],
                rows[f"{key}_segment_ids"][b],
                rows[f"{key}_positions"][b],
            )
            pad = seg == 0
            if np.any(ids[pad] != 0) or np.any(pos[pad] != 0):
                raise ValueError(f"row {b}: {key} padding has nonzero tokens or positions")
            segments = {}
            for s in np.unique(seg[~pad]):
                where = np.flatnonzero(seg == s)  # [n]
                if where[-1] - where[0] + 1 != len(where):
                    raise ValueError(f"row {b}: {key} segment {s} is not contiguous")
                if not np.array_equal(pos[where], np.arange(len(where))):
                    raise ValueError(f"row {b}: {key} positions of segment {s} are {pos[where]}")
                segments[int(s)] = ids[where]
            per_key[key] = segments
        if per_key["inputs"].keys() != per_key["targets"].keys():
            raise ValueError(
                f"row {b}: inputs segments {sorted(per_key['inputs'])} differ from targets "
                f"segments {sorted(per_key['targets'])}"
            )
        for s in sorted(per_key["inputs"]):
            examples.append({key: per_key[key][s] for key in FEATURES})
    return examples
