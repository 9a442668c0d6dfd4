"""Ragged int32 sequences in two flat arrays: many examples' tokens without an object each.

The input pipeline reads, tokenizes and caches examples a block at a time: a
Python list and a numpy array per example cost more than the work on their
tokens, so a block is one array of every token and one of offsets.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Ragged:
    """Sequence i is ``ids[offsets[i]:offsets[i + 1]]``.

    Attributes:
      ids: int32 [offsets[-1]], the sequences end to end.
      offsets: int64 [n + 1], nondecreasing from 0.
    """

    ids: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_lengths(cls, ids: np.ndarray, lengths: np.ndarray) -> Ragged:
        """Sequences of `lengths` (int [n]) tokens, end to end in `ids` (int [sum])."""
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if offsets[-1] != len(ids):
            raise ValueError(f"lengths add up to {offsets[-1]}, but there are {len(ids)} ids")
        return cls(np.asarray(ids, np.int32), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """int64 [n]."""
        return np.diff(self.offsets)

    def take(self, indices: np.ndarray) -> Ragged:
        """The sequences at `indices` (int [m], repeats allowed), in that order."""
        indices = np.asarray(indices, np.int64)
        starts = self.offsets[indices]  # [m]
        lengths = self.offsets[indices + 1] - starts  # [m]
        out = Ragged.from_lengths(np.empty(int(lengths.sum()), np.int32), lengths)
        # Token t of the result comes from ids[t + (its sequence's start there - here)].
        shift = np.repeat(starts - out.offsets[:-1], lengths)  # [total]
        out.ids[:] = self.ids[np.arange(len(out.ids)) + shift]
        return out


def concatenate(parts: list[Ragged]) -> Ragged:
    """The sequences of `parts` in order, as one."""
    lengths = np.concatenate([p.lengths for p in parts]) if parts else np.zeros(0, np.int64)
    ids = np.concatenate([p.ids for p in parts]) if parts else np.zeros(0, np.int32)
    return Ragged.from_lengths(ids, lengths)
