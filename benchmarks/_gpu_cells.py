"""One cell of benchmarks/gpu.py, run in its own child process.

`python benchmarks/gpu.py --cell '<json>' --rows <file>` lands in
`cell_main`: the spec's `kind` picks the work (probe, peak, smoke, check,
time; `noop` for tests), and each finished measurement is appended to
`<file>` as one JSON object, so rows finished before a crash survive. jax is
imported here only, in the child, never by the stage runner.

Cell kinds:
- probe: versions, platform, `kernel_report` of the headline shapes.
- peak: bf16 matmul TFLOP/s (shared with later cells for `frac_peak`).
- smoke: forward + gradient once per shape; the outputs must be finite.
- check: outputs and every gradient against the "xla" path in float64, per
  backward variant; the tolerance (`TOLERANCE`, of the largest reference
  value) is set by the precision the kernels use: float32 dots are three
  TF32 passes (`tile_math.dot`, "tf32x3"), so 1e-4 (5x the CPU tests'
  2e-5); bf16 3e-2 (the CPU tests' bound, from the bf16 casts of the
  weights before `P·V` and `dS·K`).
- check_mods: the score mods (ALiBi, T5, softcap, FIRE, Sandwich) the same
  way, their params gradient included (`PARAMS_TOLERANCE`).
- time: one implementation at one shape, forward and forward+backward.
"""

from __future__ import annotations

import json
import os
import time

SHAW_K = 16
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # of the largest reference value
# A score mod's params gradient sums a term over every logit (T * S of them),
# so its float32 rounding grows with the row; 10x the arrays' bound.
PARAMS_TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-1}
# A time cell's per-kernel backward tiles (`flash_attention`'s BackwardTiles):
# `[block_q, block_k]` and warps of the dq kernel and of the dk/dv kernel.
PER_KERNEL = ("dq_blocks", "dkv_blocks", "dq_warps", "dkv_warps")


def _x64():
    """float64 on (`jax.enable_x64` as a context manager, or its older home)."""
    import jax

    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # pragma: no cover - older jax

    return enable_x64()


def _host():
    """Where the float64 references run: the host CPU. cuBLAS has no float64
    GEMM under jaxlib 0.11's XLA ("GEMM is not supported by cublasLt and
    legacy cublas fallback is removed", the first H200 run)."""
    import jax

    return jax.devices("cpu")[0]


def _to_host(tree, dtype=None):
    """`tree`'s arrays on the host CPU (typed PRNG keys included), cast to
    `dtype` where it is given and the leaf is a float."""
    import jax
    import jax.numpy as jnp

    def move(x):
        if x is None:
            return None
        x = jax.device_put(x, _host())
        if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(dtype)
        return x

    return jax.tree.map(move, tree)


def _emit(path: str, **row) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _rel_error(got, want) -> float:
    """Largest absolute error over the largest reference value."""
    import numpy as np

    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


def _emit_shaped(path: str, *, impl: str, shape: tuple, mode: str = "fwd+bwd", **row) -> None:
    """One row of a smoke, check or time cell: `shape` is (B, T, N, H,
    causal, dtype, backward)."""
    b, t, n, h, causal, dtype, backward = shape
    _emit(
        path,
        impl=impl,
        mode=mode,
        L=t,
        batch=b,
        heads=n,
        head_dim=h,
        causal=causal,
        dtype=dtype,
        backward=backward,
        **row,
    )


def _inputs(b, t, s, n, kh, h, dtype, shaw, seed=0):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (b, t, n, h), dtype)
    k = jax.random.normal(ks[1], (b, s, kh, h), dtype)
    v = jax.random.normal(ks[2], (b, s, kh, h), dtype)
    ct = jax.random.normal(ks[3], (b, t, n, h), dtype)
    tables = None
    if shaw:
        r = 2 * SHAW_K + 1
        tables = tuple(0.3 * jax.random.normal(x, (r, h), jnp.float32) for x in ks[4:])
    return q, k, v, tables, ct


def _attention(impl: str, spec: dict):
    """`fn(q, k, v, tables, causal, **extra) -> out` for one implementation."""
    import jax

    import jattn
    from jattn.attention.pallas import flash_attention as fa

    def rel(tables):
        if tables is None:
            return None
        return jattn.ShawRelative(key=tables[0], value=tables[1], max_distance=SHAW_K)

    def fn(q, k, v, tables, causal, **extra):
        if impl in ("cudnn", "xla_jax"):
            name = "cudnn" if impl == "cudnn" else "xla"
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=name)
        if impl == "pallas":
            vis, rest = jattn.masks.split_keywords(dict(extra, is_causal=causal))
            rate, rng = rest.pop("dropout_rate", 0.0), rest.pop("dropout_rng", None)
            rest.update(dropout=jattn.dropout.Dropout(rate, rng), relative=rel(tables))
            nf = jattn.normalise(q, k, v, visibility=vis, **rest)
            bwd = spec.get("backward_blocks")
            per_kernel = {n: spec.get(n) for n in PER_KERNEL}
            for n in ("dq_blocks", "dkv_blocks"):
                per_kernel[n] = tuple(per_kernel[n]) if per_kernel[n] else None
            tiles = fa.BackwardTiles(**per_kernel) if any(per_kernel.values()) else None
            return fa.flash_attention(
                nf,
                block_q=spec.get("block_q"),
                block_k=spec.get("block_k"),
                backward=spec.get("backward", "split"),
                num_warps=spec.get("warps"),
                backward_blocks=tuple(bwd) if bwd else None,
                backward_warps=spec.get("backward_warps"),
                backward_tiles=tiles,
            )[0]
        return jattn.dot_product_attention(
            q, k, v, is_causal=causal, relative=rel(tables), implementation=impl, **extra
        )

    return fn


def _vjp(fn, causal, **extra):
    import jax
    import jax.numpy as jnp

    def f(q, k, v, tables, ct):
        out, pull = jax.vjp(lambda *a: fn(*a, causal, **extra), q, k, v, tables)
        return out, pull(ct.astype(out.dtype))

    def loss_grad(q, k, v, tables, ct):
        loss = lambda *a: jnp.sum(fn(*a, causal, **extra).astype(jnp.float32) * ct)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, tables)

    return jax.jit(f), jax.jit(loss_grad)


def _timeit(fn, args, min_time: float) -> float:
    """Seconds per call: compile and warm up, then the best of 3 batches."""
    import jax

    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - t0
    n = int(max(1, min(50, min_time / max(once, 1e-6))))
    best = once
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def _probe(spec, rows):
    import jax

    from jattn.attention.pallas import backend as kb

    note = kb.describe_backend()
    row = dict(impl="probe", status="ok", note=note, share={"platform": jax.default_backend()})
    try:
        for shaw in (False, True):
            rep = kb.kernel_report(8192, 8192, 128, shaw=shaw, dtype="bfloat16")
            keys = ("backend", "forward_blocks", "forward_warps", "backward_blocks")
            keys += ("backward_warps", "precision")
            row["note"] += f" | 8k H128{' shaw' if shaw else ''}: " + ", ".join(
                f"{k}={rep[k]}" for k in keys
            )
    except kb.PallasBackendError as e:
        row.update(status=f"FAIL {e}")
    _emit(rows, **row)


def _peak(spec, rows):
    import jax
    import jax.numpy as jnp

    n = spec["n"]
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
    tf = 2.0 * n**3 / _timeit(f, (a, a), 0.3) / 1e12
    _emit(rows, impl="matmul_peak", dtype="bfloat16", tflops=f"{tf:.1f}", share={"peak": tf})


def _smoke(spec, rows):
    import jax
    import jax.numpy as jnp
    import numpy as np

    fn = _attention("pallas", spec)
    for b, t, n, kh, h, causal, shaw in spec["shapes"]:
        t0 = time.perf_counter()
        q, k, v, tables, ct = _inputs(b, t, t, n, kh, h, jnp.dtype(spec["dtype"]), shaw)
        fwd, grad = _vjp(fn, causal)
        out, grads = fwd(q, k, v, tables, ct)
        finite = all(
            bool(np.all(np.isfinite(np.asarray(x, np.float32))))
            for x in jax.tree.leaves((out, grads))
        )
        _emit_shaped(
            rows,
            status="ok" if finite else "FAIL non-finite",
            impl="pallas_shaw" if shaw else "pallas",
            shape=(b, t, n, h, causal, spec["dtype"], spec.get("backward", "split")),
            seconds=f"{time.perf_counter() - t0:.1f}",
        )


def _check(spec, rows):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jattn.attention.pallas.flash_attention import matmul_precision_name

    b, t, s, n, kh, h, dtype, causal, packed, shaw, window, dropout = spec["case"]
    q, k, v, tables, ct = _inputs(b, t, s, n, kh, h, jnp.dtype(dtype), shaw, seed=1)
    extra = {}
    if window is not None:
        extra["local_window_size"] = tuple(window)
    if dropout:
        extra.update(dropout_rate=dropout, dropout_rng=jax.random.key(7))
    if packed:  # four packed sequences, positions restarting in each (T == S)
        seg = np.repeat(np.arange(1, 5), -(-t // 4))[:t]
        pos = np.concatenate([np.arange(c) for c in np.bincount(seg)[1:]])
        seg, pos = (jnp.asarray(np.tile(x, (b, 1)), jnp.int32) for x in (seg, pos))
        extra.update(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
    with _x64(), jax.default_device(_host()):
        ref, _ = _vjp(_attention("xla", spec), causal, **_to_host(extra))
        want = ref(*_to_host((q, k, v, tables, ct), jnp.float64))
        want = [np.asarray(x, np.float64) for x in jax.tree.leaves(want)]
    tol = TOLERANCE[dtype]
    impl = spec.get("impl", "pallas")  # or "cudnn": jax.nn's, for what the rule sends there
    for backward in spec["backwards"] if impl == "pallas" else ["-"]:
        got, _ = _vjp(_attention(impl, dict(spec, backward=backward)), causal, **extra)
        got = [
            np.asarray(jnp.asarray(x, jnp.float32), np.float64)
            for x in jax.tree.leaves(got(q, k, v, tables, ct))
        ]
        err = max(_rel_error(g, w) for g, w in zip(got, want, strict=True))
        ok = all(np.all(np.isfinite(g)) for g in got) and err <= tol
        _emit_shaped(
            rows,
            status="PASS" if ok else "FAIL",
            impl=impl + ("_shaw" if shaw else ""),
            shape=(b, t, n, h, causal, dtype, backward),
            max_rel_err=f"{err:.2e}",
            tol=tol,
            note=f"{spec['name']}; {matmul_precision_name(dtype)}",
        )


def _random_params(params, seed: int):
    """`params` with a random normal (scale 0.05) added to every float leaf, so
    that no gradient is checked at a special point (T5's table starts at 0)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(params)
    if not leaves:
        return params
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [
        x + 0.05 * jax.random.normal(key, jnp.shape(x), jnp.float32)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating)
        else x
        for x, key in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, moved)


def _leaf_scale(want, largest: float) -> float:
    """What a params leaf's error is measured against: its own scale, floored
    at 1% of the largest leaf's; the largest leaf's where it is 0 in exact
    arithmetic (FIRE's per-head constant, which softmax ignores: a sum of
    T * S terms that cancel)."""
    import numpy as np

    size = float(np.max(np.abs(want)))
    return largest if size < 1e-6 * largest else max(size, 0.01 * largest, 1e-6)


def _check_mods(spec, rows):
    """Each score mod of `benchmarks/aot.py` (ALiBi, T5, softcap, FIRE,
    Sandwich) in the kernels, split and fused backward, causal, against the
    "xla" path in float64: the output, dq, dk, dv and the mod's params
    gradient. Every array is measured against its largest reference value;
    a params leaf against the larger of its own and 1% of the largest
    leaf's (a leaf whose exact gradient is small keeps the rounding of the
    large terms it sums; tests/test_pallas_score_mod.py does the same), and
    one whose exact gradient is 0 against the largest leaf's."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from aot import score_mod_of

    import jattn
    from jattn import positions
    from jattn.attention.pallas import flash_attention as fa
    from jattn.attention.pallas.flash_attention import matmul_precision_name

    b, t, n, kh, h, dtype = spec["shape"]
    q, k, v, _, ct = _inputs(b, t, t, n, kh, h, jnp.dtype(dtype), False, seed=2)

    def vjp_of(mod, impl, backward):
        def f(q, k, v, params):
            m = dataclasses.replace(mod, params=params)
            if impl == "pallas":
                nf = jattn.normalise(
                    q, k, v, visibility=jattn.Visibility(is_causal=True), score_mod=m
                )
                return fa.flash_attention(nf, backward=backward)[0]
            return jattn.dot_product_attention(
                q, k, v, is_causal=True, score_mod=m, implementation="xla"
            )

        def g(q, k, v, params, ct):
            out, pull = jax.vjp(f, q, k, v, params)
            return out, pull(ct.astype(out.dtype))

        return jax.jit(g)

    for i, feature in enumerate(spec["mods"]):
        mod = score_mod_of(feature, n)
        if feature == "softcap":
            # At Gemma's cap of 50 the cap's gradient, tanh(s/c) - (s/c) sech^2(s/c)
            # ~ (2/3)(s/c)^3 per logit, is a float32 cancellation: the "xla" path
            # in float32 misses float64 by 1.8% there (T = 40). 2.5, as the tests.
            mod = positions.softcap_score_mod(2.5)
        params = _random_params(mod.params, seed=10 + i)
        with _x64(), jax.default_device(_host()):
            out, (dq, dk, dv, dp) = vjp_of(mod, "xla", None)(
                *_to_host((q, k, v, params, ct), jnp.float64)
            )
            want = [np.asarray(x, np.float64) for x in (out, dq, dk, dv)]
            want_p = [np.asarray(x, np.float64) for x in jax.tree.leaves(dp)]
        largest = max((float(np.max(np.abs(w))) for w in want_p), default=0.0)
        for backward in spec["backwards"]:
            start = time.perf_counter()
            out, (dq, dk, dv, dp) = vjp_of(mod, "pallas", backward)(q, k, v, params, ct)
            got = [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (out, dq, dk, dv)]
            got_p = [np.asarray(x, np.float64) for x in jax.tree.leaves(dp)]
            err = max(_rel_error(g, w) for g, w in zip(got, want, strict=True))
            err_p = max(
                (
                    float(np.max(np.abs(g - w)) / _leaf_scale(w, largest))
                    for g, w in zip(got_p, want_p, strict=True)
                ),
                default=0.0,
            )
            tol = TOLERANCE[dtype]
            finite = all(np.all(np.isfinite(g)) for g in got + got_p)
            ok = finite and err <= tol and err_p <= PARAMS_TOLERANCE[dtype]
            _emit_shaped(
                rows,
                status="PASS" if ok else "FAIL",
                impl=f"pallas_{feature}",
                shape=(b, t, n, h, True, dtype, backward),
                max_rel_err=f"{err:.2e}; params {err_p:.2e}",
                tol=f"{tol}; params {PARAMS_TOLERANCE[dtype]}",
                seconds=round(time.perf_counter() - start, 2),
                note=f"score mod {feature}; {matmul_precision_name(dtype)}",
            )


def _time(spec, rows):
    import jax
    import jax.numpy as jnp

    impl, t, h, causal, dtype = (
        spec["impl"],
        spec["L"],
        spec["head_dim"],
        spec["causal"],
        spec["dtype"],
    )
    b, n = max(1, spec["tokens"] // t), max(1, spec["d_model"] // h)
    shaw = spec.get("shaw", False)
    q, k, v, tables, ct = _inputs(b, t, t, n, n, h, jnp.dtype(dtype), shaw)
    fn = _attention(impl, spec)
    _, grad = _vjp(fn, causal)
    fwd = jax.jit(lambda q, k, v, tables: fn(q, k, v, tables, causal))  # forward alone
    name = impl + ("_shaw" if shaw else "")
    for mode in spec["modes"]:
        flops = (
            4.0 * b * n * t * t * h * (0.5 if causal else 1.0) * (3.5 if mode == "fwd+bwd" else 1.0)
        )
        if mode == "fwd":
            sec = _timeit(fwd, (q, k, v, tables), spec["min_time"])
        else:
            sec = _timeit(grad, (q, k, v, tables, ct), spec["min_time"])
        tf = flops / sec / 1e12
        peak = spec.get("shared", {}).get("peak")
        blocks = f"{spec['block_q']}x{spec['block_k']}" if spec.get("block_q") else ""
        warps = spec.get("warps") or ""
        if spec.get("backward_blocks"):  # the backward's own tiles; the forward's default
            bq, bk = spec["backward_blocks"]
            blocks, warps = f"bwd {bq}x{bk}", f"bwd {spec.get('backward_warps') or ''}"
        if spec.get("dq_blocks") or spec.get("dkv_blocks"):  # each backward kernel's own
            (dq_q, dq_k), (kv_q, kv_k) = spec["dq_blocks"], spec["dkv_blocks"]
            blocks = f"dq {dq_q}x{dq_k} dkv {kv_q}x{kv_k}"
            warps = f"dq {spec.get('dq_warps') or ''} dkv {spec.get('dkv_warps') or ''}"
        _emit_shaped(
            rows,
            impl=name,
            mode=mode,
            shape=(b, t, n, h, causal, dtype, spec.get("backward", "") if impl == "pallas" else ""),
            blocks=blocks,
            warps=warps,
            ms=f"{sec * 1e3:.3f}",
            tflops=f"{tf:.4g}",
            frac_peak=f"{tf / peak:.3f}" if peak else "",
        )


CELL_KINDS = {
    "probe": _probe,
    "peak": _peak,
    "smoke": _smoke,
    "check": _check,
    "check_mods": _check_mods,
    "time": _time,
}


def cell_main(spec: dict, rows: str) -> int:
    """`--cell`: run one cell; `inject` ("abort" / "hang") simulates a
    compiler abort or hang (tests, and a dry run of the isolation)."""
    inject = spec.get("inject")
    if inject == "abort":
        os.abort()
    if inject == "hang":
        time.sleep(3600)
    if spec["kind"] == "noop":
        seen = dict(xla_flags=os.environ.get("XLA_FLAGS"), shared=spec.get("shared"))
        _emit(rows, status="ok", note="noop " + json.dumps(seen))
        return 0
    CELL_KINDS[spec["kind"]](spec, rows)
    return 0
