"""`jattn.dot_product_attention`: one entry point, several implementations.

The public function checks its inputs once (with chex, `jattn.checks`),
gathers its visibility keywords into one `jattn.visibility.Visibility`, puts
everything in one normal form and hands it to an implementation picked by
name:

- ``"xla"``: the readable reference. Materialises the `[B, N, T, S]` logits.
- ``"chunked"``: pure JAX, tiled over queries and keys with an online softmax
  and a custom VJP that recomputes weights from the saved log-sum-exp, so
  forward and backward need O(T + S) memory per head, not O(T·S).
- ``"pallas"``: the tiled Pallas kernel: Triton on GPUs, Mosaic on TPU,
  interpret mode on the CPU.

Every implementation takes one `jattn.NormalForm` (built by
`jattn.normalise`, see `jattn.attention.normal_form`) and returns `(out [B, T, N, Hv],
lse [B, T, N] float32)`; the entry point drops the lse unless asked for it.

Shapes everywhere in this package and in `jattn.models` use the letters of
`jattn.attention.legend` (one letter per dimension, `E` for the value head
dim `Hv` in einsum strings, `V` only for the vocabulary).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jattn import checks
from jattn.attention import rule
from jattn.attention.chunked import attention_chunked
from jattn.attention.normal_form import EMPTY_ROW_LSE, NormalForm, normalise
from jattn.attention.xla import attention_xla
from jattn.dropout import Dropout
from jattn.positions import ShawRelative
from jattn.score_mod import ScoreMod
from jattn.visibility import Visibility, split_keywords

Array = jax.Array

__all__ = [
    "IMPLEMENTATIONS",
    "attention_weights",
    "call_features",
    "default_implementation",
    "dot_product_attention",
]


def _pallas(nf: NormalForm, **options) -> tuple[Array, Array]:
    """The Pallas kernels, imported on first use: `import jattn` does not
    import Pallas, and a jax without it fails only when asked for it."""
    from jattn.attention.pallas.flash_attention import flash_attention

    return flash_attention(nf, **options)


# name -> implementation: each takes a `NormalForm` (and its own tuning
# keywords) and returns `(out [B, T, N, Hv], lse [B, T, N])`.
IMPLEMENTATIONS: dict[str, Callable[..., tuple[Array, Array]]] = {
    "xla": attention_xla,
    "chunked": attention_chunked,
    "pallas": _pallas,
}


def call_features(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    visibility: Visibility | None = None,
    scale=None,
    relative=None,
    score_mod=None,
    row_col_bias=None,
    dropout_rate: float = 0.0,
    **_ignored,
) -> rule.Call:
    """What `jattn.attention.rule` reads of a `dot_product_attention` call:
    its features, dtype and sizes (shapes only; nothing is computed).
    `_ignored`: the call's other keywords (the rule does not read them)."""
    qs, ks, vs = np.shape(query), np.shape(key), np.shape(value)
    batch = 1 if len(qs) == 3 else qs[0]
    vis = Visibility() if visibility is None else visibility
    window = vis.local_window_size
    given = {
        "causal": vis.is_causal,
        "segments": vis.segments,
        "positions": vis.positions,
        "window": window is not None,
        "window_right": window is not None and window[1] > 0 and not vis.is_causal,
        "lengths": vis.lengths,
        "mask": mask is not None,
        "bias": bias is not None,
        "shaw": relative is not None,
        "score_mod": score_mod is not None,
        "row_col": row_col_bias is not None,
        "dropout": dropout_rate > 0,
        "traced_scale": scale is not None and not isinstance(scale, numbers.Real),
    }
    mod = ""  # which mod, in which form (a ScoreMod; anything else is refused later)
    if score_mod is not None:
        mod_name = getattr(score_mod, "name", "") or "score_mod"
        default = vis.default_positions or not vis.positions  # as `normalised` sets it
        tiles = getattr(score_mod, "distance", None) is not None and default
        mod = rule.mod_form(mod_name, tiles)
    return rule.Call(
        t=qs[-3],
        s=ks[-3],
        head_dim=qs[-1],
        value_head_dim=vs[-1],
        batch_heads=batch * qs[-2],
        dtype=np.dtype(getattr(query, "dtype", None) or jnp.asarray(query).dtype).name,
        features=frozenset(name for name, on in given.items() if on),
        score_mod=mod,
    )


def default_implementation(
    query, key, value, bias=None, mask=None, *, platform: str | None = None, **options
) -> str:
    """The implementation `dot_product_attention(query, key, value, bias, mask,
    **options)` runs with `implementation=None` on `platform` (default: jax's
    default backend): `jattn.attention.rule.choose` of the call's features,
    dtype and sizes. Says nothing; the call itself announces its choice once.
    `options` are `dot_product_attention`'s keywords."""
    visibility, rest = split_keywords(options)
    call = call_features(query, key, value, bias, mask, visibility=visibility, **rest)
    return rule.choose(call, platform or _platform()).name


def _resolve(name: str) -> Callable[..., Array]:
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"dot_product_attention: unknown implementation {name!r}; "
            f"choose one of {sorted(IMPLEMENTATIONS)} or None"
        )
    return IMPLEMENTATIONS[name]


def _platform() -> str:
    """jax's default backend, with a ROCm GPU named "rocm" (jax calls both "gpu")."""
    name = jax.default_backend()
    return "rocm" if name == "gpu" and _gpu_is_rocm() else name


@functools.cache
def _gpu_is_rocm() -> bool:
    version = getattr(jax.devices("gpu")[0].client, "platform_version", "")
    return "rocm" in str(version).lower()


def _by_rule(call: rule.Call) -> str:
    """`implementation=None` resolved: the rule's choice for this call on jax's
    default backend, announced once per process per path (`rule.announce`)."""
    platform = _platform()
    choice = rule.choose(call, platform)
    rule.announce(choice, call, platform)
    return choice.name


def _cudnn(query, key, value, bias, mask, *, visibility: Visibility, scale, return_residual):
    """Hand the call to jax.nn's cuDNN path, with the visibility it takes
    (causal, lengths, window; `_refuse_for_cudnn` names what it cannot)."""
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=visibility.is_causal,
        query_seq_lengths=visibility.query_seq_lengths,
        key_value_seq_lengths=visibility.key_value_seq_lengths,
        local_window_size=visibility.local_window_size,
        implementation="cudnn",
        return_residual=return_residual,
    )


def _refuse_for_cudnn(unsupported: dict[str, bool]) -> None:
    """A one-line error naming the first argument jax.nn's cuDNN path cannot take."""
    for name, given in unsupported.items():
        if given:
            raise ValueError(
                f'dot_product_attention: implementation="cudnn" (jax.nn\'s cuDNN path) '
                f"cannot take {name}; use implementation=None, 'xla', 'chunked' or 'pallas'"
            )


def _unbatched(x, ndim: int):
    """Add a batch axis of 1 to a rank-3 input (jax.nn's `[T, N, H]` form)."""
    return None if x is None else jnp.asarray(x)[None] if ndim == 3 else x


def _check_ranks(query, key, value) -> int:
    """The rank of the call: query, key and value all rank 4 or all rank 3 (chex)."""
    ndim = np.ndim(query)
    message = (
        "dot_product_attention: query, key and value must all have rank 4 "
        "([B, T|S, heads, head_dim]) or all rank 3 (no batch axis), got shapes "
        f"{list(np.shape(query))}, {list(np.shape(key))}, {list(np.shape(value))}"
    )
    for ranks, x in (({3, 4}, query), (ndim, key), (ndim, value)):
        x = x if hasattr(x, "shape") else np.asarray(x)  # chex reads a list as several inputs
        checks.rank(x, ranks, message)
    return ndim


def _unbatched_pair(pair, ndim: int):
    """`row_col_bias` of a rank-3 call (`[N, T]`, `[N, S]`) given its batch axis of 1."""
    if ndim == 4 or not isinstance(pair, tuple | list) or len(pair) != 2:
        return pair  # checked (and refused, if not a pair) by `normalise`
    return tuple(_unbatched(x, 3) for x in pair)


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    relative: ShawRelative | None = None,
    score_mod: ScoreMod | None = None,
    row_col_bias: tuple[Array, Array] | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    dropout_broadcast_batch: bool = False,
    assume_finite: bool = False,
    visibility: Visibility | None = None,
):
    """Scaled dot-product attention: jax.nn's function, plus packing, relative
    positions and dropout.

    `softmax(scale * (q·k + q·key_rel[r]) + bias, masked) @ (v + value_rel[r])`
    per head. Everything `jax.nn.dot_product_attention` accepts is accepted
    here with the same meaning (rank 3 or 4, bias and mask positional), so
    code written for jax.nn runs unchanged; jattn's own options follow.

    Args:
      query: `[B, T, N, H]` or `[T, N, H]`.
      key: `[B, S, K, H]` or `[S, K, H]`; K divides N (MHA K=N, GQA, MQA K=1).
      value: `[B, S, K, Hv]` or `[S, K, Hv]`.
      bias: float, broadcastable to `[B, N, T, S]`; added to the scaled logits.
      mask: bool, broadcastable to `[B, N, T, S]`; True = may attend.
      scale: logit scale, default `1/sqrt(H)`; may be traced (under jit it
        is multiplied into the query, see `jattn.attention.normal_form`).
      is_causal: a key is visible iff `kv_position <= q_position`.
      query_seq_lengths: int `[B]`; queries at or past the length attend to
        nothing and return 0 (as jax.nn).
      key_value_seq_lengths: int `[B]`; keys at or past the length are invisible.
      local_window_size: an int or `(left, right)`: a key is visible iff
        `q_position - left <= kv_position <= q_position + right` (as jax.nn,
        which uses indices; here positions, which default to indices). The
        chunked path and the kernels skip tiles outside the window.
      implementation: None (the rule of `jattn.attention.rule`: a pure
        function of the call's features, dtype, sizes and platform, which
        runs a GPU kernel only in a configuration checked against float64
        on a GPU, and says once which path it took), "xla", "chunked",
        "pallas", or "cudnn" (jax.nn's cuDNN path, for the arguments it
        takes).
      return_residual: also return the log-sum-exp `[B, T, N]` of each row's
        scaled, biased logits (as jax.nn: a residual, its cotangent ignored;
        `EMPTY_ROW_LSE` for a row with no visible key).
      q_segment_ids: int `[B, T]`; attend iff q and kv segment ids are equal
        and not 0: id 0 is padding, which sees no key and is seen by none
        (its query returns 0, as past `query_seq_lengths`).
      kv_segment_ids: int `[B, S]`; required with `q_segment_ids`.
      q_positions: int `[B, T]`; default `arange(T)`; used by causal, window
        and relative terms (packed rows restart them per segment; decoding
        offsets them into the cache).
      kv_positions: int `[B, S]`; default `arange(S)`.
      relative: `jattn.ShawRelative` tables, or None.
      score_mod: `jattn.ScoreMod(fn, params)`: `fn(params, score, batch,
        head, q_position, kv_position)` replaces each scaled logit (after
        Shaw's key term and `bias`) before visibility and softmax; applied
        per tile by the tiled implementations, with gradients to `params`.
      row_col_bias: `(a [B, N, T], c [B, N, S])`, float: logit (b, n, i, j)
        gains `a[b, n, i] + c[b, n, j]` (by index, with `bias`, before the
        score mod), read per tile in O(T + S) memory, with gradients (the
        row and column sums of dS) to both; the Forgetting Transformer's
        gate `c_i - c_j` is this form. xla and chunked only (the Pallas
        kernels refuse it; the rule picks a portable path).
      dropout_rate: attention-weight dropout rate in [0, 1).
      dropout_rng: a jax.random key; needed when `dropout_rate > 0`. The keep
        mask is a hash of `(rng, b, n, t, s)` (see `jattn.dropout`), the same
        in every implementation.
      dropout_broadcast_batch: one keep mask for all batch rows (flax's
        `broadcast_dropout`).
      assume_finite: the caller vouches that `key` and `value` hold no NaN or
        Inf (a model's own projections do): the guard below is skipped, which
        saves a few small XLA ops a call (3-4% of the main job's CPU train
        step). For finite inputs the arithmetic is the same; XLA may fuse
        the smaller program otherwise, so results are equal to float32
        rounding (bit for bit in the main job's train step, not in every
        program). Unchecked: a non-finite hidden key may then reach every
        query of its row.
      visibility: the visibility rules as one `jattn.visibility.Visibility` (how
        jattn's models and adapters pass them), combined (`&`) with those of
        the keywords above: `is_causal`, `query_seq_lengths`,
        `key_value_seq_lengths`, `local_window_size`, the segment ids and the
        positions, which the call gathers into one such value either way.

    Returns:
      `[B, T, N, Hv]` (`[T, N, Hv]` for rank-3 inputs) in the dtype of
      `query`, and with `return_residual` also the lse `[B, T, N]` (`[T, N]`).
      A query row with no visible key (by mask, bias, causal, window,
      segments, padding or lengths) returns exactly 0 and passes no
      gradient, and a NaN or Inf in the key or value of a key a query cannot
      see never reaches it (docs/reliability.md lists where this differs
      from jax.nn).
    """
    ndim = _check_ranks(query, key, value)
    keywords = Visibility(
        is_causal=is_causal,
        local_window_size=local_window_size,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_positions=q_positions,
        kv_positions=kv_positions,
    )
    visibility = keywords if visibility is None else keywords & visibility
    inputs = (query, key, value, bias, mask)
    terms = dict(scale=scale, relative=relative, score_mod=score_mod, row_col_bias=row_col_bias)
    if implementation is None:
        call = call_features(*inputs, visibility=visibility, dropout_rate=dropout_rate, **terms)
        implementation = _by_rule(call)
    if implementation == "cudnn":
        _refuse_for_cudnn(
            {
                "segment ids": visibility.segments,
                "positions": visibility.positions,
                "relative (Shaw) terms": relative is not None,
                "a score_mod": score_mod is not None,
                "row_col_bias": row_col_bias is not None,
                "dropout": dropout_rate > 0,
            }
        )
        return _cudnn(*inputs, visibility=visibility, scale=scale, return_residual=return_residual)
    if ndim == 3:  # ids and positions of one row ([T], [S]) serve the batch of 1
        query, key, value = (_unbatched(a, 3) for a in (query, key, value))
        terms["row_col_bias"] = _unbatched_pair(row_col_bias, ndim)
    nf = normalise(
        query,
        key,
        value,
        bias,
        mask,
        visibility=visibility,
        dropout=Dropout(dropout_rate, dropout_rng, dropout_broadcast_batch),
        assume_finite=assume_finite,
        **terms,
    )
    if 0 in (nf.query.shape[0], nf.query.shape[1], nf.key.shape[1]):
        out, lse = _empty(nf)  # as jax.nn: no batch, no query, or nothing to attend to
    else:
        out, lse = _resolve(implementation)(nf)
    if ndim == 3:
        out, lse = out[0], lse[0]
    if return_residual:
        return out, jax.lax.stop_gradient(lse).astype(out.dtype)
    return out


def _empty(nf) -> tuple[Array, Array]:
    """`(out, lse)` of a call with B = 0, T = 0 or S = 0, in every implementation.

    jax.nn returns an empty output for B = 0 or T = 0 and zeros for S = 0 (a query
    with no key sees nothing: the fully-masked-row rule); the log-sum-exp of
    such a row is `EMPTY_ROW_LSE`, as for any row with no visible key.
    """
    b, t, n, _ = nf.query.shape
    out = jnp.zeros((b, t, n, nf.value.shape[3]), nf.query.dtype)  # [B, T, N, Hv]
    lse = jnp.full((b, t, n), EMPTY_ROW_LSE, jnp.float32)  # [B, T, N]
    return out, lse


def attention_weights(
    query: Array,
    key: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    *,
    visibility: Visibility | None = None,
    relative: ShawRelative | None = None,
    scale: float | None = None,
) -> Array:
    """The weights `dot_product_attention` mixes values with, for probing.

    Same arguments and visibility rules as `dot_product_attention`, its
    visibility keywords as one `jattn.visibility.Visibility` (the Shaw value
    table plays no part in the weights). Materialises `[B, N, T, S]` by
    design: for inspecting small inputs, never for training.

    Returns:
      float32 `[B, N, T, S]`; each row sums to 1 over its visible keys, and a
      row with no visible key is all zeros.
    """
    from jattn.attention.xla import attention_weights_xla

    nf = normalise(
        query, key, key, bias, mask, visibility=visibility, relative=relative, scale=scale
    )
    return attention_weights_xla(nf.replace(rel_value=None))
