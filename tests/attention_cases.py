"""Shared helpers for the attention tests: random problems and a way to call
one implementation with explicit tile sizes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn.attention import IMPLEMENTATIONS
from jattn.dropout import Dropout
from jattn.visibility import split_keywords


def implementation(name: str):
    """The function behind `implementation=name` (takes a `jattn.NormalForm`)."""
    return IMPLEMENTATIONS[name]


def normal_form(q, k, v, bias=None, mask=None, **kw):
    """`jattn.normalise` of `dot_product_attention`'s arguments, as the entry
    point builds it: its visibility keywords as one `jattn.visibility.Visibility`,
    its dropout keywords as one `jattn.dropout.Dropout`, the others as given."""
    visibility, rest = split_keywords(kw)
    dropout = Dropout(
        rest.pop("dropout_rate", 0.0),
        rest.pop("dropout_rng", None),
        rest.pop("dropout_broadcast_batch", False),
    )
    return jattn.normalise(q, k, v, bias, mask, visibility=visibility, dropout=dropout, **rest)


def call(impl: str, q, k, v, *, options=None, residual=False, **kw):
    """Run one implementation on public-API arguments, with impl options
    (e.g. block sizes) that the public entry point does not expose. Returns
    the output, or `(out, lse)` with `residual=True`."""
    out, lse = implementation(impl)(normal_form(q, k, v, **kw), **(options or {}))
    return (out, lse) if residual else out


def make_problem(seed, b, t, s, n, kh, h, hv=None, dtype=np.float32):
    rng = np.random.default_rng(seed)
    hv = hv or h
    q = rng.normal(size=(b, t, n, h)).astype(dtype)
    k = rng.normal(size=(b, s, kh, h)).astype(dtype)
    v = rng.normal(size=(b, s, kh, hv)).astype(dtype)
    return q, k, v


def shaw(seed, n, h, hv, k, *, per_head_key=False, per_head_value=True, key=True, value=True):
    rng = np.random.default_rng(seed + 100)
    r = 2 * k + 1
    kt = rng.normal(size=((n, r, h) if per_head_key else (r, h))).astype(np.float32)
    vt = rng.normal(size=((n, r, hv) if per_head_value else (r, hv))).astype(np.float32)
    return jattn.ShawRelative(key=kt if key else None, value=vt if value else None, max_distance=k)


def packed_ids(lengths: list[int], total: int) -> np.ndarray:
    """Segment ids 1, 2, ... for consecutive lengths, then 0 padding."""
    ids = np.zeros(total, np.int32)
    at = 0
    for i, n in enumerate(lengths):
        ids[at : at + n] = i + 1
        at += n
    return ids


def packed_positions(ids: np.ndarray) -> np.ndarray:
    pos = np.zeros_like(ids)
    for i in range(1, len(ids)):
        pos[i] = pos[i - 1] + 1 if ids[i] == ids[i - 1] else 0
    return pos


@functools.cache
def grad_fn(impl: str, options: tuple = (), static: tuple = ()):
    """A jitted `(out, vjp grads)` function for one implementation, cached so
    tests with the same shapes share compilations."""
    opts = dict(options)
    stat = dict(static)

    def f(q, k, v, bias, rel_key, rel_value, mask, qseg, kvseg, qpos, kvpos, ct):
        rel = None
        if "max_distance" in stat:
            rel = jattn.ShawRelative(rel_key, rel_value, stat["max_distance"])

        def g(q, k, v, bias, rk, rv):
            r = None if rel is None else jattn.ShawRelative(rk, rv, rel.max_distance)
            return call(
                impl,
                q,
                k,
                v,
                options=opts,
                bias=bias,
                mask=mask,
                is_causal=stat.get("is_causal", False),
                q_segment_ids=qseg,
                kv_segment_ids=kvseg,
                q_positions=qpos,
                kv_positions=kvpos,
                relative=r,
                scale=stat.get("scale"),
            )

        out, vjp = jax.vjp(g, q, k, v, bias, rel_key, rel_value)
        return out, vjp(ct.astype(out.dtype))

    return jax.jit(f)


def run_with_grads(impl, q, k, v, *, options=None, ct=None, **kw):
    """Output and gradients dict (query, key, value, bias, rel_key, rel_value)."""
    rel = kw.get("relative")
    static = dict(is_causal=kw.get("is_causal", False), scale=kw.get("scale"))
    if rel is not None:
        static["max_distance"] = rel.max_distance
    fn = grad_fn(impl, tuple(sorted((options or {}).items())), tuple(sorted(static.items())))
    if ct is None:
        ct = np.random.default_rng(7).normal(size=q.shape[:3] + (v.shape[-1],))
    out, grads = fn(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        kw.get("bias"),
        None if rel is None else rel.key,
        None if rel is None else rel.value,
        kw.get("mask"),
        kw.get("q_segment_ids"),
        kw.get("kv_segment_ids"),
        kw.get("q_positions"),
        kw.get("kv_positions"),
        jnp.asarray(ct),
    )
    names = ("query", "key", "value", "bias", "rel_key", "rel_value")
    return np.asarray(out), {
        n: (None if g is None else np.asarray(g)) for n, g in zip(names, grads, strict=True)
    }
