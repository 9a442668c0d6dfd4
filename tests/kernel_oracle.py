"""Plain-JAX reference of the Pallas flash kernel's own contract (tests only).

The Pallas kernel does not compute `attention(q, k, v, tables)` directly: the
wrapper hands it the Shaw key term as a per-query table `qr` and gets back the
value-term masses `pr` and the log-sum-exp `lse`. This module computes exactly
those three outputs densely (`[B, N, T, S]` logits, so small shapes only), in
float32 with `jnp` only, sharing no code with the kernel, so a test can pin
the kernel's intermediate outputs and, through autodiff, the gradients its
custom VJP returns for `qr` and the bias (tests/test_pallas.py).

Shapes: the letters of `jattn.attention.legend` (Hv, the value head dim, is
`E` in einsum strings).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn import dropout, masks

Array = jax.Array

# The lse of a row with nothing visible, as the kernels store it: finite, and
# so large that `exp(s - lse)` is 0 for any logit.
EMPTY_LSE = float(np.finfo(np.float32).max)


def reference_parts(
    q: Array,
    k: Array,
    v: Array,
    *,
    qr: Array | None,
    bias: Array | None,
    mask: Array | None,
    is_causal: bool,
    q_segment_ids: Array | None,
    kv_segment_ids: Array | None,
    q_positions: Array,
    kv_positions: Array,
    max_distance: int,
    scale: float,
    with_pr: bool,
    window: tuple[int, int] | None = None,
    dropout_seed: Array | None = None,
    dropout_rate: float = 0.0,
    dropout_broadcast_batch: bool = False,
) -> tuple[Array, Array, Array | None]:
    """Dense `(o, lse, pr)` of the kernel contract.

    Args:
      q: `[B, T, N, H]`; k: `[B, S, K, H]`; v: `[B, S, K, Hv]`.
      qr: `[B, T, N, R]` float32, the already scaled key term
        `scale * q @ key_tableᵀ`, or None.
      bias, mask: `[B|1, N|1, T|1, S|1]` or None.
      q_positions, kv_positions: int `[B, T]`, `[B, S]`.
      with_pr: also return the weight mass per relative id.
      window: `(left, right)` local window on positions, or None.
      dropout_seed, dropout_rate, dropout_broadcast_batch: attention-weight
        dropout (`jattn.dropout.keep` at indices `(b, n, t, s)`), or None.

    Returns:
      `o [B, T, N, Hv]` (normalised `Σ_s w v_s` with w after dropout,
      float32), `lse [B, N, T]` (of the weights before dropout; `EMPTY_LSE`
      for a row with nothing visible) and `pr [B, T, N, R]` (the dropped
      weights' mass per relative id) or None.
    """
    f32 = jnp.float32
    n, kh = q.shape[2], k.shape[2]
    kk = jnp.repeat(k.astype(f32), n // kh, axis=2)  # [B, S, N, H]
    vv = jnp.repeat(v.astype(f32), n // kh, axis=2)  # [B, S, N, Hv]
    hi = jax.lax.Precision.HIGHEST
    s = scale * jnp.einsum("BTNH,BSNH->BNTS", q.astype(f32), kk, precision=hi)
    r = jnp.clip(kv_positions[:, None, :] - q_positions[:, :, None], -max_distance, max_distance)
    r = r + max_distance  # [B, T, S]
    num_rel = 2 * max_distance + 1
    onehot = jax.nn.one_hot(r, num_rel, dtype=f32)  # [B, T, S, R]
    if qr is not None:
        s = s + jnp.einsum("BTNR,BTSR->BNTS", qr, onehot, precision=hi)
    if bias is not None:
        s = s + bias.astype(f32)
    col = lambda x: None if x is None else x[:, None, :, None]  # noqa: E731  [B, 1, T, 1]
    row = lambda x: None if x is None else x[:, None, None, :]  # noqa: E731  [B, 1, 1, S]
    rule = masks.visible(
        col(q_positions),
        row(kv_positions),
        is_causal=is_causal,
        window=window,
        q_seg=col(q_segment_ids),
        kv_seg=row(kv_segment_ids),
    )
    vis = jnp.broadcast_to(True if rule is None else rule, s.shape)
    if mask is not None:
        vis &= mask
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(s - m)  # [B, N, T, S]
    den = jnp.sum(p, axis=-1, keepdims=True)
    safe = jnp.where(den == 0, 1.0, den)
    w = p / safe
    if dropout_seed is not None:
        b, _, t, s_len = w.shape
        idx = lambda size, axis: jnp.arange(size, dtype=jnp.int32).reshape(  # noqa: E731
            [size if a == axis else 1 for a in range(4)]
        )
        rows = jnp.zeros((1, 1, 1, 1), jnp.int32) if dropout_broadcast_batch else idx(b, 0)
        keep = dropout.keep(dropout_seed, dropout_rate, rows, idx(n, 1), idx(t, 2), idx(s_len, 3))
        w = jnp.where(keep, w * dropout.multiplier(dropout_rate), 0.0)
    o = jnp.einsum("BNTS,BSNE->BTNE", w, vv, precision=hi)
    lse = jnp.where(den[..., 0] == 0, EMPTY_LSE, m[..., 0] + jnp.log(safe[..., 0]))
    pr = jnp.einsum("BNTS,BTSR->BTNR", w, onehot, precision=hi) if with_pr else None
    return o, lse, pr
