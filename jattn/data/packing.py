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
in a lean form) with a resumable iterator state; `unpack` is its inverse and
`pad_to_row` the unpacked (one example a row) layout.
"""

from __future__ import annotations

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
    out = {}
    for key in FEATURES:
        ids = np.asarray(example[key], np.int32)  # [n]
        n, length = len(ids), lengths[key]
        if n > length:
            raise ValueError(f"{key} has {n} tokens, more than {_limit_name(key)}={length}")
        row = np.zeros([length], np.int32)
        row[:n] = ids
        seg = np.zeros([length], np.int32)
        seg[:n] = 1
        pos = np.zeros([length], np.int32)
        pos[:n] = np.arange(n, dtype=np.int32)
        out[key], out[f"{key}_segment_ids"], out[f"{key}_positions"] = row, seg, pos
    return out


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
    deterministic) and skips those rows.
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
        self._capacity = np.array([lengths[k] for k in FEATURES], np.int64)  # [2]
        self._num_bins = num_bins
        self._reset(parent.get_state(), emitted=0)

    def _reset(self, group_state, emitted: int) -> None:
        self._group_state = group_state  # parent state where the current group starts
        self._rows: list[dict[str, np.ndarray]] | None = None  # None: not packed yet
        self._emitted = emitted  # rows of the current group already returned
        self._carry = None  # (example, parent state before it): starts the next group

    def _pack_group(self) -> list[dict[str, np.ndarray]]:
        free = np.repeat(self._capacity[:, None], self._num_bins, axis=1)  # [inputs|targets, bins]
        bins: list[list[dict[str, np.ndarray]]] = [[] for _ in range(self._num_bins)]
        pending = [self._carry] if self._carry is not None else []
        self._carry = None
        while True:
            if pending:
                example, before = pending.pop()
            else:
                before = self._parent.get_state()
                try:
                    example = next(self._parent)
                except StopIteration:
                    break
            lengths = (len(example["inputs"]), len(example["targets"]))
            if np.any(np.array(lengths) > self._capacity):
                raise ValueError(
                    f"example of (inputs, targets) lengths {lengths} does not fit a row of "
                    f"{tuple(self._capacity.tolist())}"
                )
            fits = np.flatnonzero((free[0] >= lengths[0]) & (free[1] >= lengths[1]))
            if len(fits) == 0:
                self._carry = (example, before)
                break
            b = fits[0]
            bins[b].append(example)
            free[:, b] -= lengths
        return [_make_row(examples, self._lengths) for examples in bins if examples]

    def __next__(self) -> dict[str, np.ndarray]:
        if self._rows is None:  # fresh or restored: (re-)pack the current group
            self._rows = self._pack_group()
        while self._emitted >= len(self._rows):  # used up: the next group starts
            self._group_state = self._carry[1] if self._carry else self._parent.get_state()
            self._emitted = 0
            self._rows = self._pack_group()
            if not self._rows:
                raise StopIteration
        row = self._rows[self._emitted]
        self._emitted += 1
        return row

    def get_state(self) -> dict:
        return {"parent": self._group_state, "emitted": self._emitted}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self._reset(state["parent"], emitted=state["emitted"])


def _make_row(
    examples: list[dict[str, np.ndarray]], lengths: dict[str, int]
) -> dict[str, np.ndarray]:
    """Concatenates whole examples into one row: the six BATCH_KEYS, each feature's
    three int32 [lengths[feature]]; example i gets segment id i + 1 on both sides."""
    out = {}
    for key in FEATURES:
        row = np.zeros([lengths[key]], np.int32)
        seg = np.zeros([lengths[key]], np.int32)
        pos = np.zeros([lengths[key]], np.int32)
        start = 0
        for segment, example in enumerate(examples, start=1):
            n = len(example[key])
            row[start : start + n] = example[key]
            seg[start : start + n] = segment
            pos[start : start + n] = np.arange(n, dtype=np.int32)
            start += n
        out[key], out[f"{key}_segment_ids"], out[f"{key}_positions"] = row, seg, pos
    return out


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
