"""Beam search by full recomputation: the oracle the KV-cache beam search
(`jattn.models.decoding.beam_search`) is checked against, for both
architectures (tests/test_schemes.py, tests/test_decoder_only.py).

It is the library's algorithm written again in numpy, without a cache and
without early stopping, so a disagreement points at the cache (or at a
positional scheme's step path), not at the search: GNMT length penalty
`((5 + n) / 6) ** alpha` on a hypothesis ending in EOS at length n (EOS
counted); of the top 2W candidates a step, the best W that did not end stay
live and the endings are merged into the best W finished; a row with no
finished hypothesis returns its best live one, scored `logp / penalty(L)`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jattn.models import decoding


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis, in the dtype of `x`."""
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _pick(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """`a[b, idx[b, j]]` for `a` `[B, W', ...]`, `idx` `[B, W]`."""
    return np.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), 1)


def _top(a: np.ndarray, k: int) -> np.ndarray:
    """Indices of the `k` largest entries of each row, ties to the lower index
    (as `lax.top_k`)."""
    return np.argsort(-a, axis=1, kind="stable")[:, :k]


def beam_by_recomputation(
    full: Callable,
    params,
    inputs: np.ndarray,
    *,
    max_length: int,
    beam_size: int,
    alpha: float,
) -> tuple[np.ndarray, np.ndarray]:
    """`decoding.beam_search`'s algorithm, each step a full forward pass.

    Args:
      full: `full(params, inputs [B*W, S], targets [B*W, L])` -> logits
        `[B*W, L, V]` of the ordinary (uncached) forward pass, every target
        slot a real token (the decoder is causal, so the zeros after step i
        do not reach the logits at i).
      params: passed to `full`.
      inputs: int `[B, S]` source tokens (0 = padding); row `b*W + j` of what
        `full` sees is beam j of source b, as in the library.
      max_length: L, the steps run (all of them: the library stops early
        only when no live beam can win, which leaves its result unchanged).
      beam_size: W.
      alpha: the length-penalty exponent.

    Returns:
      int32 `[B, L]` best hypotheses and float32 `[B]` their scores.
    """
    neg, w, big_l = decoding.NEG, beam_size, max_length
    b = inputs.shape[0]
    x = np.repeat(inputs, w, axis=0)  # [B*W, S]
    live = np.zeros((b, w, big_l), np.int32)
    live_logp = np.tile(np.array([0.0] + [neg] * (w - 1), np.float32), (b, 1))  # [B, W]
    fin = np.zeros((b, w, big_l), np.int32)
    fin_scores = np.full((b, w), neg, np.float32)
    fin_flags = np.zeros((b, w), bool)
    for i in range(big_l):
        logits = np.asarray(full(params, x, live.reshape(b * w, big_l)))[:, i]  # [B*W, V]
        v = logits.shape[-1]
        cand = (live_logp[:, :, None] + log_softmax(logits).reshape(b, w, v)).reshape(b, -1)
        idx = _top(cand, 2 * w)  # [B, 2W]
        top_logp = np.take_along_axis(cand, idx, 1)
        beam, tok = idx // v, (idx % v).astype(np.int32)
        seqs = _pick(live, beam).copy()  # [B, 2W, L]
        seqs[:, :, i] = tok
        ended = (tok == decoding.EOS) & (top_logp > neg / 2)  # not from an empty beam
        going = np.where(ended, neg, top_logp)
        keep = _top(going, w)
        live_logp, live = np.take_along_axis(going, keep, 1), _pick(seqs, keep)
        new = np.where(ended, top_logp / np.float32(((5.0 + i + 1) / 6.0) ** alpha), neg)
        scores = np.concatenate([fin_scores, new], 1)  # [B, 3W]
        best = _top(scores, w)
        fin_scores = np.take_along_axis(scores, best, 1)
        fin = _pick(np.concatenate([fin, seqs], 1), best)
        fin_flags = np.take_along_axis(np.concatenate([fin_flags, ended], 1), best, 1)
    any_fin = fin_flags.any(1)  # [B]
    seqs = np.where(any_fin[:, None], fin[:, 0], live[:, 0])
    scores = np.where(
        any_fin, fin_scores[:, 0], live_logp[:, 0] / np.float32(((5.0 + big_l) / 6.0) ** alpha)
    )
    return seqs, scores.astype(np.float32)
