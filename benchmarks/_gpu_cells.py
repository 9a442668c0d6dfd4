"""The cells of benchmarks/gpu.py, each run in a child process of its own.

`gpu.py --cell '<json>' --rows <file>` imports this (jax with it: only a child
does) and runs `CELL_KINDS[spec["kind"]]`, which appends each measurement to
`<file>` as it finishes, so rows finished before a crash survive. A check
compares outputs and gradients against the "xla" path in float64 on the host,
within `TOLERANCE` of the largest reference value (float32 dots are three TF32
passes: 1e-4, 5x the CPU tests' bound; bf16 3e-2, theirs)."""

from __future__ import annotations

import dataclasses
import json
import time

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np
from aot import TILE_FLAGS, flash_kwargs, score_mod_of

import jattn
from jattn import positions
from jattn.attention.pallas import backend as kb
from jattn.attention.pallas import flash_attention as fa

SHAW_K = 16
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # of the largest reference value
# A score mod's params gradient sums a term over every logit (T * S of them),
# so its float32 rounding grows with the row; 10x the arrays' bound.
PARAMS_TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-1}


def _reference(fn, tree) -> list:
    """`fn(*tree)` in float64 on the host CPU, as float64 numpy leaves (cuBLAS has no
    float64 GEMM under jaxlib 0.11's XLA, the first H200 run)."""
    host = jax.devices("cpu")[0]

    def move(x):  # typed PRNG keys move as they are
        x = jax.device_put(x, host)
        return x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x

    with jax.enable_x64(True), jax.default_device(host):
        return [np.asarray(x, np.float64) for x in jax.tree.leaves(fn(*jax.tree.map(move, tree)))]


_leaves64 = lambda t: [np.asarray(x, np.float32).astype(np.float64) for x in jax.tree.leaves(t)]
# The largest absolute error over the largest reference value.
_rel_error = lambda got, want: float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


def _emit(path: str, shape: tuple | None = None, **row) -> None:
    """Appends one row; `shape` (B, T, N, H, causal, dtype, backward) fills its columns."""
    if shape is not None:
        keys = ("batch", "L", "heads", "head_dim", "causal", "dtype", "backward")
        row = dict(zip(keys, shape, strict=True)) | {"mode": "fwd+bwd"} | row
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _inputs(b, t, s, n, kh, hd, dtype, shaw, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q, ct = (jax.random.normal(x, (b, t, n, hd), dtype) for x in (ks[0], ks[3]))
    k, v = (jax.random.normal(x, (b, s, kh, hd), dtype) for x in ks[1:3])
    rows = (2 * SHAW_K + 1, hd)
    tables = tuple(0.3 * jax.random.normal(x, rows, jnp.float32) for x in ks[4:]) if shaw else None
    return q, k, v, tables, ct


def _attention(impl: str, spec: dict):
    """`fn(q, k, v, tables, causal, **extra) -> out` for one implementation."""

    def fn(q, k, v, tables, causal, **extra):
        rel = tables and jattn.ShawRelative(key=tables[0], value=tables[1], max_distance=SHAW_K)
        if impl == "cudnn":  # jax.nn's cuDNN path, as the rule hands it a call
            kw = dict(is_causal=causal, implementation="cudnn")
            return jattn.dot_product_attention(q, k, v, **kw, **extra)
        if impl == "xla_jax":
            kw = dict(is_causal=causal, implementation="xla")
            return jax.nn.dot_product_attention(q, k, v, **kw, **extra)
        if impl == "mosaic_gpu":  # plain attention only (mosaic_gpu_attention)
            nf = jattn.normalise(q, k, v, visibility=jattn.Visibility(is_causal=causal), **extra)
            return fa.flash_attention(nf, backend="mosaic_gpu")[0]
        if impl == "pallas":
            vis, rest = jattn.visibility.split_keywords(dict(extra, is_causal=causal))
            rate, rng = rest.pop("dropout_rate", 0.0), rest.pop("dropout_rng", None)
            rest.update(dropout=jattn.dropout.Dropout(rate, rng), relative=rel)
            nf = jattn.normalise(q, k, v, visibility=vis, **rest)
            tiles = flash_kwargs({n: spec[n] for n in TILE_FLAGS if spec.get(n)})
            return fa.flash_attention(nf, backward=spec.get("backward", "split"), **tiles)[0]
        kw = dict(is_causal=causal, relative=rel, implementation=impl)
        return jattn.dot_product_attention(q, k, v, **kw, **extra)

    return fn


def _vjp(fn, causal, **extra):
    """Jitted `(q, k, v, tables, ct)` -> `(out, grads)` by `ct`, and the gradient of a sum."""

    def f(q, k, v, tables, ct):
        out, pull = jax.vjp(lambda *a: fn(*a, causal, **extra), q, k, v, tables)
        return out, pull(ct.astype(out.dtype))

    def loss_grad(q, k, v, tables, ct):
        loss = lambda *a: jnp.sum(fn(*a, causal, **extra).astype(jnp.float32) * ct)
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, tables)

    return jax.jit(f), jax.jit(loss_grad)


def _timeit(fn, args, min_time: float) -> float:
    """Seconds per call: compile and warm up, then the best of 3 rounds of n calls,
    n making a round last about `min_time`."""
    jax.block_until_ready(fn(*args))
    (once,) = h.rounds([lambda: fn(*args)], 1, warm=False)[0]
    n = int(max(1, min(50, min_time / max(once, 1e-6))))
    (times,) = h.rounds([lambda: [fn(*args) for _ in range(n)][-1]], 3, warm=False)
    return min([once, *(t / n for t in times)])


def mosaic_gpu_unavailable() -> str | None:
    """Why the Mosaic GPU kernels cannot run here (they need an sm_90 GPU:
    wgmma, TMA, setmaxnreg), or None. A cell reports it as a skip row."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return f"skip: mosaic_gpu needs an sm_90 GPU, not runnable on {device.platform}"
    capability = getattr(device, "compute_capability", "?")
    if not str(capability).startswith("9."):
        return f"skip: mosaic_gpu needs an sm_90 GPU, got compute capability {capability}"
    return None


def _probe(spec, rows):
    row = dict(impl="probe", status="ok", note=kb.describe_backend())
    keys = ("backend", "forward_blocks", "forward_warps", "backward_blocks", "backward_warps")
    try:
        for shaw in (False, True):
            rep = kb.kernel_report(8192, 8192, 128, shaw=shaw, dtype="bfloat16")
            figures = ", ".join(f"{k}={rep[k]}" for k in (*keys, "precision"))
            row["note"] += f" | 8k H128{' shaw' * shaw}: {figures}"
    except kb.PallasBackendError as e:
        row.update(status=f"FAIL {e}")
    _emit(rows, **row, share={"platform": jax.default_backend()})


def _peak(spec, rows):
    n = spec["n"]
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
    tf = 2.0 * n**3 / _timeit(f, (a, a), 0.3) / 1e12
    _emit(rows, impl="matmul_peak", dtype="bfloat16", tflops=f"{tf:.1f}", share={"peak": tf})


def _smoke(spec, rows):
    fn, dtype = _attention("pallas", spec), spec["dtype"]
    for b, t, n, kh, hd, causal, shaw in spec["shapes"]:
        t0 = time.perf_counter()
        q, k, v, tables, ct = _inputs(b, t, t, n, kh, hd, jnp.dtype(dtype), shaw)
        got = _leaves64(_vjp(fn, causal)[0](q, k, v, tables, ct))
        status = "ok" if all(np.all(np.isfinite(x)) for x in got) else "FAIL non-finite"
        shape = (b, t, n, hd, causal, dtype, spec.get("backward", "split"))
        seconds = f"{time.perf_counter() - t0:.1f}"
        _emit(rows, shape, status=status, impl="pallas" + "_shaw" * shaw, seconds=seconds)


def _packed(b: int, t: int) -> dict:
    """Four packed sequences, positions restarting in each (T == S)."""
    seg = np.repeat(np.arange(1, 5), -(-t // 4))[:t]
    pos = np.concatenate([np.arange(c) for c in np.bincount(seg)[1:]])
    seg, pos = (jnp.asarray(np.tile(x, (b, 1)), jnp.int32) for x in (seg, pos))
    return dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)


def _cudnn_inputs(names, b, t, s, n, dtype) -> dict:
    """What else the rule hands cuDNN with a call: lengths (the last row's a third
    short), a mask (a random 80%, the diagonal kept: no empty row), a bias."""
    rng, short = np.random.default_rng(5), lambda x: jnp.int32([x] * (b - 1) + [x - x // 3])
    out = {}
    if "lengths" in names:
        out.update(query_seq_lengths=short(t), key_value_seq_lengths=short(s))
    if "mask" in names:
        out["mask"] = jnp.asarray((rng.random((b, 1, t, s)) < 0.8) | np.eye(t, s, dtype=bool))
    if "bias" in names:
        out["bias"] = jnp.asarray(0.5 * rng.standard_normal((b, n, t, s)), dtype)
    return out


def _check(spec, rows):
    b, t, s, n, kh, hd, dtype, causal, packed, shaw, window, dropout = spec["case"]
    q, k, v, tables, ct = _inputs(b, t, s, n, kh, hd, jnp.dtype(dtype), shaw, seed=1)
    extra = {"local_window_size": tuple(window)} if window is not None else {}
    if dropout:
        extra.update(dropout_rate=dropout, dropout_rng=jax.random.key(7))
    extra |= _packed(b, t) if packed else {}
    extra |= _cudnn_inputs(spec.get("inputs", ()), b, t, s, n, jnp.dtype(dtype))
    impl = spec.get("impl", "pallas")  # or "cudnn": jattn's cuDNN path, for what the rule sends
    shape = (b, t, n, hd, causal, dtype, "-")
    if impl == "mosaic_gpu" and (why := mosaic_gpu_unavailable()):
        _emit(rows, shape, status=why, impl=impl, note=spec["name"])
        return
    ref = lambda extra, *a: _vjp(_attention("xla", spec), causal, **extra)[0](*a)
    want = _reference(ref, (extra, q, k, v, tables, ct))
    for backward in spec["backwards"] if impl == "pallas" else ["-"]:
        fwd, _ = _vjp(_attention(impl, dict(spec, backward=backward)), causal, **extra)
        got = _leaves64(fwd(q, k, v, tables, ct))
        err = max(_rel_error(g, w) for g, w in zip(got, want, strict=True))
        ok = all(np.all(np.isfinite(g)) for g in got) and err <= TOLERANCE[dtype]
        note = f"{spec['name']}; {fa.matmul_precision_name(dtype)}"
        _emit(rows, (b, t, n, hd, causal, dtype, backward), status="PASS" if ok else "FAIL",
              impl=impl + "_shaw" * shaw, max_rel_err=f"{err:.2e}", tol=TOLERANCE[dtype],
              note=note)  # fmt: skip


def _random_params(params, seed: int):
    """`params` with a random normal (scale 0.05) added to every float leaf, so
    that no gradient is checked at a special point (T5's table starts at 0)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
    floating = lambda x: jnp.issubdtype(jnp.result_type(x), jnp.floating)
    moved = [x + 0.05 * jax.random.normal(key, jnp.shape(x), jnp.float32) if floating(x) else x
             for x, key in zip(leaves, keys, strict=False)]  # fmt: skip
    return jax.tree.unflatten(treedef, moved)


def _leaf_scale(want, largest: float) -> float:
    """What a params leaf's error is measured against: its own scale, floored at 1%
    of the largest leaf's; the largest's where it is 0 exactly (FIRE's per-head constant)."""
    size = float(np.max(np.abs(want)))
    return largest if size < 1e-6 * largest else max(size, 0.01 * largest, 1e-6)


def _check_mods(spec, rows):
    """Each score mod of aot.py in the kernels against the "xla" path in float64: the
    output, dq, dk, dv, and the params gradient (a leaf against `_leaf_scale`: a small
    exact gradient keeps the rounding of the large terms it sums, as in the tests)."""
    b, t, n, kh, hd, dtype = spec["shape"]
    q, k, v, _, ct = _inputs(b, t, t, n, kh, hd, jnp.dtype(dtype), False, seed=2)
    # Packed: non-default positions, so a distance mod runs per logit in the kernels
    # (as in packed training), not from distance tiles.
    packed = _packed(b, t) if spec.get("packed") else {}

    def vjp_of(mod, backward):  # backward None: the "xla" path; `_vjp`'s first
        def f(q, k, v, params, causal):
            m = dataclasses.replace(mod, params=params)
            if backward is None:
                kw = dict(is_causal=causal, score_mod=m, implementation="xla")
                return jattn.dot_product_attention(q, k, v, **kw, **packed)
            vis = jattn.Visibility(is_causal=causal, **packed)
            return fa.flash_attention(jattn.normalise(q, k, v, visibility=vis, score_mod=m),
                                      backward=backward)[0]  # fmt: skip

        return _vjp(f, True)[0]

    tol, ptol = TOLERANCE[dtype], PARAMS_TOLERANCE[dtype]
    for i, feature in enumerate(spec["mods"]):
        mod = score_mod_of(feature, n)
        if feature == "softcap":
            # At Gemma's cap of 50 the cap's gradient, tanh(s/c) - (s/c) sech^2(s/c)
            # ~ (2/3)(s/c)^3 per logit, is a float32 cancellation: the "xla" path
            # in float32 misses float64 by 1.8% there (T = 40). 2.5, as the tests.
            mod = positions.softcap_score_mod(2.5)
        params = _random_params(mod.params, seed=10 + i)
        want = _reference(vjp_of(mod, None), (q, k, v, params, ct))
        largest = max((float(np.max(np.abs(w))) for w in want[4:]), default=0.0)
        for backward in spec["backwards"]:
            start = time.perf_counter()
            got = _leaves64(vjp_of(mod, backward)(q, k, v, params, ct))
            err = max(_rel_error(g, w) for g, w in zip(got[:4], want[:4], strict=True))
            pairs = zip(got[4:], want[4:], strict=True)
            err_p = max((float(np.max(np.abs(g - w))) / _leaf_scale(w, largest) for g, w in pairs),
                        default=0.0)  # fmt: skip
            ok = all(np.all(np.isfinite(g)) for g in got) and err <= tol and err_p <= ptol
            _emit(rows, (b, t, n, hd, True, dtype, backward), status="PASS" if ok else "FAIL",
                  impl=f"pallas_{feature}", max_rel_err=f"{err:.2e}; params {err_p:.2e}",
                  tol=f"{tol}; params {ptol}", seconds=round(time.perf_counter() - start, 2),
                  note=f"score mod {feature}; {fa.matmul_precision_name(dtype)}")  # fmt: skip


def _time(spec, rows):
    impl, t, hd, causal, dtype = (spec[k] for k in ("impl", "L", "head_dim", "causal", "dtype"))
    b, n, shaw = max(1, spec["tokens"] // t), max(1, spec["d_model"] // hd), spec.get("shaw", False)
    if impl == "mosaic_gpu" and (why := mosaic_gpu_unavailable()):
        _emit(rows, (b, t, n, hd, causal, dtype, ""), status=why, impl=impl, mode="-")
        return
    q, k, v, tables, ct = _inputs(b, t, t, n, n, hd, jnp.dtype(dtype), shaw)
    fn, mod = _attention(impl, spec), spec.get("mod", "")  # a score mod of aot.py's, or ""
    if mod:  # params in the tables' place, differentiated where training learns them (T5's)
        attend, sm = fn, score_mod_of(mod, n)
        tables = sm.params if mod == "t5" else ()

        def fn(q, k, v, params, causal):
            sm_ = dataclasses.replace(sm, params=params) if mod == "t5" else sm
            return attend(q, k, v, None, causal, score_mod=sm_)

    _, grad = _vjp(fn, causal)
    fwd = jax.jit(lambda q, k, v, tables: fn(q, k, v, tables, causal))  # forward alone
    blocks = f"{spec['block_q']}x{spec['block_k']}" if spec.get("block_q") else ""
    warps = spec.get("num_warps") or ""
    if spec.get("backward_blocks"):  # the backward's own tiles; the forward's default
        blocks = "bwd {}x{}".format(*spec["backward_blocks"])
        warps = f"bwd {spec.get('backward_warps') or ''}"
    if spec.get("dq_blocks") or spec.get("dkv_blocks"):  # each backward kernel's own
        blocks = "dq {}x{} dkv {}x{}".format(*spec["dq_blocks"], *spec["dkv_blocks"])
        warps = f"dq {spec.get('dq_warps') or ''} dkv {spec.get('dkv_warps') or ''}"
    shape = (b, t, n, hd, causal, dtype, spec.get("backward", "") * (impl == "pallas"))
    for mode in spec["modes"]:
        flops = 4.0 * b * n * t * t * hd * (0.5 if causal else 1.0) * (1 if mode == "fwd" else 3.5)
        args = (q, k, v, tables) if mode == "fwd" else (q, k, v, tables, ct)
        sec = _timeit(fwd if mode == "fwd" else grad, args, spec["min_time"])
        tf, peak = flops / sec / 1e12, spec.get("shared", {}).get("peak")
        frac = f"{tf / peak:.3f}" if peak else ""
        _emit(rows, shape, impl="_".join(filter(None, (impl, "shaw" * shaw, mod))), mode=mode,
              blocks=blocks, warps=warps, ms=f"{sec * 1e3:.3f}", tflops=f"{tf:.4g}",
              frac_peak=frac)  # fmt: skip


CELL_KINDS = dict(
    probe=_probe, peak=_peak, smoke=_smoke, check=_check, check_mods=_check_mods, time=_time
)
