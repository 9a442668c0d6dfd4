"""Distance-table score mods in the Pallas kernels (interpret modes): Toeplitz tiles.

With default positions a `ScoreMod.from_distance` mod reaches the Triton and
Mosaic kernels as one `[bq, bk]` tile per tile diagonal, built in XLA
(`jattn.attention.pallas.distance_tiles`), and its params' gradient comes
from a kernel that walks the diagonals (`triton_distance_grad`,
`mosaic_distance_grad`). Checked, in both families (Triton `interpret`,
Mosaic `tpu_interpret`):
outputs and the q, k, v and params gradients equal the per-logit path (the
same mod without its distance form) and a float64 reference, for T5, KERPLE,
Sandwich (built by their schemes, tests/registry_mods.py) and a learned
per-head table written here; causal and not, bq != bk, T != S (padding), the
split and fused backward (Triton); the kernels never call the per-logit
`fn`; a mod whose `fn` does not lower in-kernel runs; given positions keep
the per-logit path; the kernels lower for CUDA and TPU on this CPU host; the
diagonal kernel runs only when the params need a gradient; composed with a
bias, segment ids, a local window and dropout the tiles equal the per-logit kernels;
different forward and backward tilings (the GPU defaults) are right.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import registry_mods
from attention_cases import normal_form
from flash_harness import F32_TOL, _qkv, cuda_target
from test_pallas_score_mod import _compare, _cot, _reference

import jattn
from jattn.attention.pallas import distance_tiles, preparation, score_mod_tiles
from jattn.attention.pallas import flash_attention as fa

N_HEADS = registry_mods.SMALL["num_heads"]


def _learned(params, head, distance):
    """A learned per-head table over distances [-64, 64] (clipped beyond),
    looked up by a one-hot sum so that its per-logit form lowers in-kernel too."""
    row = params["table"][head]  # [..., 129]
    ids = (jnp.clip(distance, -64, 64) + 64)[..., None]
    hit = ids == jnp.reshape(jnp.arange(129), (1,) * (ids.ndim - 1) + (129,))
    row = jnp.reshape(row, (1,) * (hit.ndim - row.ndim) + row.shape)
    return jnp.sum(jnp.where(hit, row, 0.0), axis=-1)


LEARNED = jattn.ScoreMod.from_distance(
    _learned,
    {"table": jnp.asarray(np.random.default_rng(3).standard_normal((N_HEADS, 129)), jnp.float32)},
    name="learned_table",
)


def _registry(name: str) -> jattn.ScoreMod:
    mod = registry_mods.small_mods()[registry_mods.label_of(name)].mod
    assert mod.distance is not None, name
    return mod


MODS = {"t5": "t5", "kerple": "kerple_log", "sandwich": "sandwich"}


def _mod(name: str) -> jattn.ScoreMod:
    return LEARNED if name == "learned" else _registry(MODS[name])


def _per_logit(mod: jattn.ScoreMod) -> jattn.ScoreMod:
    """The same mod without its distance form: the kernels call `fn` per logit."""
    return jattn.ScoreMod(mod.fn, mod.params, mod.name)


@functools.partial(jax.jit, static_argnames=("is_causal", "backend", "backward", "bq", "bk"))
def _run(inputs, mod, cot, *, is_causal, backend="interpret", backward="split", bq, bk):
    """Output and gradients (query, key, value, params) through the kernels;
    `mod` keeps its distance form if it has one; positions from `inputs` if given."""

    def f(q, k, v, params):
        nf = normal_form(
            q, k, v, is_causal=is_causal, score_mod=dataclasses.replace(mod, params=params),
            q_positions=inputs.get("q_positions"), kv_positions=inputs.get("kv_positions"),
        )  # fmt: skip
        return fa.flash_attention(nf, block_q=bq, block_k=bk, backend=backend, backward=backward)[0]

    out, vjp = jax.vjp(f, inputs["query"], inputs["key"], inputs["value"], mod.params)
    return out, vjp(cot)


def _same(got, want, tol=F32_TOL):
    """Two kernel runs agree to float32 rounding (outputs and every gradient)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape and np.all(np.isfinite(a))
        assert np.max(np.abs(a - b)) <= tol * max(np.max(np.abs(b)), 1e-6)


CASES = [  # (mod, causal, T, S, bq, bk, backward)
    ("t5", True, 64, 64, 16, 32, "split"),
    ("kerple", False, 80, 48, 32, 16, "split"),
    ("sandwich", True, 64, 64, 32, 32, "fused"),
    ("learned", False, 72, 100, 64, 32, "split"),
    ("learned", True, 64, 64, 16, 32, "fused"),
]


# Mosaic: block_k a multiple of 128 or every key (one key tile).
MOSAIC_CASES = [
    ("t5", True, 64, 64, 16, 64, "split"),
    ("learned", False, 96, 256, 32, 128, "split"),
]


@pytest.mark.parametrize(
    "case, backend",
    [(c, "interpret") for c in CASES] + [(c, "tpu_interpret") for c in MOSAIC_CASES],
    ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else c,
)
def test_tiles_match_per_logit_and_float64(case, backend):
    name, causal, t, s, bq, bk, backward = case
    mod = _mod(name)
    inputs = _qkv(11, 2, t, s, N_HEADS, 2, 16)
    cot = _cot(inputs)
    kw = dict(is_causal=causal, bq=bq, bk=bk, backward=backward, backend=backend)
    got = _run(inputs, mod, cot, **kw)
    _compare(got, _reference(inputs, mod, cot, is_causal=causal))
    _same(got, _run(inputs, _per_logit(mod), cot, **kw))


def test_build_is_the_term_at_each_tiles_distances():
    """`build`'s tile of (i, j) is `term(h, j*bk + c - i*bq - a)` for every tile."""
    tp, sp, bq, bk = 64, 96, 32, 16
    tiles = np.asarray(distance_tiles.build(LEARNED, N_HEADS, tp, sp, bq, bk))
    table = np.asarray(LEARNED.params["table"])
    a, c = np.arange(bq)[:, None], np.arange(bk)[None, :]
    for i in range(tp // bq):
        for j in range(sp // bk):
            idx = distance_tiles.diagonal(i, j, tp, bq, bk)
            d = j * bk + c - i * bq - a
            want = table[:, np.clip(d, -64, 64) + 64]
            np.testing.assert_array_equal(tiles[:, idx * bq : (idx + 1) * bq], want)
    assert tiles.shape[1] == distance_tiles.num_diagonals(tp, sp, bq, bk) * bq


@pytest.mark.parametrize("backend, bk", [("interpret", 32), ("tpu_interpret", 64)])
def test_kernels_never_call_the_per_logit_fn(backend, bk):
    """Tracing the whole call (forward, split backward and the params'
    gradient) calls only the distance form, in XLA."""
    calls = {"fn": 0, "distance": 0}

    def distance_fn(params, head, distance):
        calls["distance"] += 1
        return _learned(params, head, distance)

    base = jattn.ScoreMod.from_distance(distance_fn, LEARNED.params, name="spy")

    def fn(*args):
        calls["fn"] += 1
        return base.fn(*args)

    mod = dataclasses.replace(base, fn=fn)
    inputs = _qkv(12, 1, 64, 64, N_HEADS, 2, 16)
    run = functools.partial(_run, is_causal=True, bq=16, bk=bk, backend=backend)
    jax.make_jaxpr(lambda i, m: run(i, m, _cot(i)))(inputs, mod)
    assert calls["fn"] == 0 and calls["distance"] > 0


def _gather_fn(params, score, batch, head, q_position, kv_position):
    """A per-logit form the kernels refuse (a gather by an array index)."""
    return score + params["table"][head, jnp.clip(kv_position - q_position, -64, 64) + 64]


def test_mod_whose_fn_does_not_lower_runs_from_tiles():
    mod = dataclasses.replace(LEARNED, fn=_gather_fn)
    inputs = _qkv(13, 1, 64, 64, N_HEADS, 2, 16)
    cot = _cot(inputs)
    with pytest.raises(score_mod_tiles.ScoreModLoweringError):
        _run(inputs, _per_logit(mod), cot, is_causal=True, bq=16, bk=32)
    got = _run(inputs, mod, cot, is_causal=True, bq=16, bk=32)
    _compare(got, _reference(inputs, LEARNED, cot, is_causal=True))


def test_given_positions_keep_the_per_logit_path():
    """With positions given (shifted, so distances differ from `arange`'s) the
    kernels run `fn` per logit and match float64."""
    calls = {"fn": 0}

    def fn(*args):
        calls["fn"] += 1
        return LEARNED.fn(*args)

    mod = dataclasses.replace(LEARNED, fn=fn)
    inputs = _qkv(14, 2, 64, 48, N_HEADS, 2, 16)
    inputs["q_positions"] = np.broadcast_to(np.arange(64, dtype=np.int32) + 9, (2, 64))
    inputs["kv_positions"] = np.broadcast_to(np.arange(48, dtype=np.int32) + 2, (2, 48))
    cot = _cot(inputs)
    got = _run(inputs, mod, cot, is_causal=False, bq=32, bk=16)
    assert calls["fn"] > 0
    _compare(got, _reference(inputs, LEARNED, cot, is_causal=False))


def _lowered_text(mod, *, platform="cuda", backend="gpu", backward="split", with_params=True):
    """StableHLO text of the forward and backward lowered for `platform` (no
    device needed: `cuda_target`)."""
    inputs = _qkv(15, 1, 200, 200, N_HEADS, 2, 64, dtype=jnp.bfloat16)

    def f(q, k, v, params):
        def loss(q, k, v, params):
            nf = normal_form(
                q, k, v, is_causal=True, score_mod=dataclasses.replace(mod, params=params)
            )
            out = fa.flash_attention(nf, backend=backend, backward=backward)[0]
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2, 3) if with_params else (0, 1, 2))(q, k, v, params)

    args = (inputs["query"], inputs["key"], inputs["value"], mod.params)
    if platform != "cuda":
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    with cuda_target():
        return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("backward", ["split", "fused"])
def test_triton_kernels_lower_for_cuda_with_tiles(backward):
    text = _lowered_text(_registry("sandwich"), backward=backward)
    assert "jattn_flash_fwd" in text and "jattn_flash_dtiles" in text
    assert ("jattn_flash_bwd_fused" in text) == (backward == "fused")


def test_mosaic_kernels_lower_for_tpu_with_tiles():
    text = _lowered_text(_registry("sandwich"), platform="tpu", backend="tpu")
    for kernel in ("fwd", "dq", "dkv", "dtiles"):
        assert f"jattn_flash_{kernel}_tpu" in text


def test_no_params_gradient_no_diagonal_kernel():
    """The diagonal kernel runs only when the params need a gradient."""
    jaxpr = str(
        jax.make_jaxpr(
            lambda q, k, v: jax.grad(
                lambda q: jnp.sum(
                    fa.flash_attention(
                        normal_form(q, k, v, is_causal=True, score_mod=LEARNED),
                        block_q=16, block_k=32, backend="interpret",
                    )[0]
                )
            )(q)
        )(*_qkv(16, 1, 64, 64, N_HEADS, 2, 16).values())
    )  # fmt: skip
    assert "jattn_flash_dq" in jaxpr and "jattn_flash_dtiles" not in jaxpr


@functools.partial(jax.jit, static_argnames=("backend", "bk"))
def _run_composed(inputs, mod, cot, *, backend, bk):
    """Tiles composed with a bias, segment ids, a local window and dropout
    (default positions): output and gradients of q, k, v, bias and params."""

    def f(q, k, v, bias, params):
        nf = normal_form(
            q, k, v, bias=bias, is_causal=True, local_window_size=(40, 0),
            q_segment_ids=inputs["segments"], kv_segment_ids=inputs["segments"],
            dropout_rate=0.25, dropout_rng=jax.random.key(5),
            score_mod=dataclasses.replace(mod, params=params),
        )  # fmt: skip
        return fa.flash_attention(nf, block_q=16, block_k=bk, backend=backend)[0]

    args = (inputs["query"], inputs["key"], inputs["value"], inputs["bias"], mod.params)
    out, vjp = jax.vjp(f, *args)
    return out, vjp(cot)


@pytest.mark.parametrize("backend, bk", [("interpret", 32), ("tpu_interpret", 64)])
def test_tiles_compose_with_bias_segments_window_dropout(backend, bk):
    """The same kernels with the per-logit form give the same output and
    gradients (bias's and params' included) to float32 rounding."""
    inputs = _qkv(17, 2, 64, 64, N_HEADS, 2, 16)
    rng = np.random.default_rng(17)
    inputs["bias"] = jnp.asarray(rng.standard_normal((1, N_HEADS, 64, 64)), jnp.float32)
    inputs["segments"] = jnp.asarray(np.repeat([[1] * 40 + [2] * 24], 2, axis=0), jnp.int32)
    cot = _cot(inputs)
    mod = _registry("kerple_log")
    got = _run_composed(inputs, mod, cot, backend=backend, bk=bk)
    run = functools.partial(_run_composed, backend=backend, bk=bk)
    assert "jattn_flash_dtiles" in str(jax.make_jaxpr(run)(inputs, mod, cot))  # the tiles path
    _same(got, _run_composed(inputs, _per_logit(mod), cot, backend=backend, bk=bk))
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(got[1][4]))  # params reached


def test_forward_and_backward_tilings_differ(monkeypatch):
    """On the GPU the default forward and backward tiles differ (two tile
    sets, the gradient all on the backward's): emulated in interpret mode."""
    monkeypatch.setattr(preparation, "default_blocks", lambda *a, **k: ((64, 32), (16, 32)))
    inputs = _qkv(18, 2, 64, 96, N_HEADS, 2, 16)
    cot = _cot(inputs)

    def run(mod):
        def f(q, k, v, params):
            nf = normal_form(q, k, v, score_mod=dataclasses.replace(mod, params=params))
            return fa.flash_attention(nf, backend="interpret")[0]

        out, vjp = jax.vjp(f, inputs["query"], inputs["key"], inputs["value"], mod.params)
        return out, vjp(cot)

    nf = normal_form(inputs["query"], inputs["key"], inputs["value"], score_mod=LEARNED)
    pre = fa.prepare(nf, fa.KernelOptions(backend="interpret"))
    assert (pre.fwd_cfg.block_q, pre.bwd_cfg.block_q) == (64, 16)
    assert pre.mod[0].shape != pre.mod[1].shape  # one tile set per tiling
    got = run(LEARNED)
    _compare(got, _reference(inputs, LEARNED, cot, is_causal=False))
    _same(got, run(_per_logit(LEARNED)))
