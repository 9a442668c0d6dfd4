"""Packing: several examples a row, with segment ids and positions; and the inverse.

A packed row of length L holds whole examples one after the other. For each of
"inputs" and "targets":

- ``<key>_segment_ids[b, t]``: 1, 2, ... for the 1st, 2nd, ... example of the row,
  0 for padding;
- ``<key>_positions[b, t]``: 0, 1, ... restarting at every segment, 0 for padding.

An example's inputs and targets land in the same row with the same segment id,
so the attention masks (`q_segment_ids == kv_segment_ids`) keep encoder,
decoder and cross attention inside one example. No example is ever split
across rows.

Packing uses grain's first-fit packer (`grain.experimental.FirstFitPackIterDataset`),
whose iterator state makes packed streams resumable; `unpack` is its inverse and
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


def pad_to_row(example: dict[str, np.ndarray], max_len: int) -> dict[str, np.ndarray]:
    """One example in a row of `max_len`: segment id 1 on its tokens, 0 on padding.

    Args:
      example: {"inputs": int [Li], "targets": int [Lt]} with Li, Lt <= max_len.
      max_len: row length.

    Returns:
      The six BATCH_KEYS, each int32 [max_len].
    """
    out = {}
    for key in FEATURES:
        ids = np.asarray(example[key], np.int32)  # [L]
        n = len(ids)
        if n > max_len:
            raise ValueError(f"{key} has {n} tokens, more than max_len={max_len}")
        row = np.zeros([max_len], np.int32)
        row[:n] = ids
        seg = np.zeros([max_len], np.int32)
        seg[:n] = 1
        pos = np.zeros([max_len], np.int32)
        pos[:n] = np.arange(n, dtype=np.int32)
        out[key], out[f"{key}_segment_ids"], out[f"{key}_positions"] = row, seg, pos
    return out


def pack(ds: grain.IterDataset, *, max_len: int, num_bins: int, seed: int) -> grain.IterDataset:
    """Packs a stream of {"inputs", "targets"} int32 arrays into rows of `max_len`.

    First fit over `num_bins` rows: each example goes into the first row where both
    its inputs and its targets still fit; when one fits nowhere, the `num_bins` rows
    are emitted (in order) and a new set starts with it. Every example must already
    be at most `max_len` long.

    Returns:
      An IterDataset of rows: the six BATCH_KEYS, each int32 [max_len].
    """
    packed = grain.experimental.FirstFitPackIterDataset(
        ds,
        length_struct={key: max_len for key in FEATURES},
        num_packing_bins=num_bins,
        seed=seed,
        shuffle_bins=False,
    )
    return packed.map(lambda row: {k: np.asarray(row[k], np.int32) for k in BATCH_KEYS})


def unpack(rows: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The examples of packed rows, in row-major order (row 0's segments first).

    Args:
      rows: the six BATCH_KEYS, int [B, L] (or a single row, [L]).

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
