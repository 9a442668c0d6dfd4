"""The contracts of docs/design.md every attention implementation must meet, written
once as a test base and run once per implementation (tokamax's pattern).

`AttentionContract` holds one test method per contract; a subclass in
tests/test_attention_contract.py only says how to call its implementation
(`attend`, a module-level function of a `jattn.NormalForm` returning
`(out, lse)`), its tolerance and, with the reason, the contracts it does not
support. Every contract runs over the shared case set `CASES` against the
float64 oracle of tests/oracle.py, forward and every gradient (query, key,
value, bias, Shaw key and value tables).

Compilation dominates on the CPU, so every case has one shape and one static
configuration and the contracts that are not oracle comparisons (causality,
packing, dead rows, padding, extreme magnitudes, shift invariance) rerun a
case's own compiled vjp on changed inputs instead of compiling their own.
Lengths 24 x 20 cross two 16-row kernel tiles and several chunked tiles, with
a ragged last tile on both sides.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from attention_cases import normal_form, packed_ids, packed_positions

import jattn

GRAD_NAMES = ("query", "key", "value", "bias", "rel_key", "rel_value")
F32_TOL = 2e-5
BF16_TOL = 3e-2
B, T, S, H, HV = 2, 24, 20, 8, 6  # T != S for cross attention; Hv != H


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem: arrays (None = absent) and static arguments."""

    arrays: dict  # query, key, value and any of bias, mask, rel_key, rel_value, ids, positions
    is_causal: bool = False
    scale: float | None = None
    max_distance: int | None = None  # Shaw clip distance when a table is present
    assume_finite: bool = False

    @property
    def static(self) -> tuple:
        return (
            ("is_causal", self.is_causal),
            ("max_distance", self.max_distance),
            ("scale", self.scale),
            ("assume_finite", self.assume_finite),
        )

    def replace(self, **arrays) -> Case:
        return dataclasses.replace(self, arrays={**self.arrays, **arrays})


def _qkv(rng, t, s, n, kh, hv=H):
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return dict(query=normal(B, t, n, H), key=normal(B, s, kh, H), value=normal(B, s, kh, hv))


def _packed(lengths_per_row, t):
    seg = np.stack([packed_ids(lengths, t) for lengths in lengths_per_row])
    return dict(
        q_segment_ids=seg,
        kv_segment_ids=seg,
        q_positions=np.stack([packed_positions(r) for r in seg]),
        kv_positions=np.stack([packed_positions(r) for r in seg]),
    )


def _shaw(rng, n, k, *, key=True, value=True, per_head=False):
    lead = (n,) if per_head else ()
    r = 2 * k + 1
    out = {}
    if key:
        out["rel_key"] = rng.standard_normal((*lead, r, H)).astype(np.float32)
    if value:
        out["rel_value"] = rng.standard_normal((*lead, r, HV)).astype(np.float32)
    return out


DEAD_ROWS = [2, 16, 17, 18, 19, 20, 21, 22, 23]  # one row, and a whole second 16-row tile
PACKED_LENGTHS = ([7, 9, 5], [24])  # row 0: three sequences and 3 padding tokens
SECOND = slice(7, 16)  # row 0's second packed sequence


def _cases() -> dict[str, Case]:
    rng = np.random.default_rng(0)
    cases = {}
    # GQA and MQA cross attention (T != S, Hv != H); GQA with a mask and a bias
    # broadcast over batch and queries (its gradient is summed over both),
    # -1e30 on every fifth key (a bias that hides keys is still finite).
    mask = rng.random((B, 1, T, S)) > 0.4
    bias = rng.standard_normal((4, 1, S)).astype(np.float32)
    bias[..., ::5] = -1e30
    cases["gqa_mask_bias"] = Case(dict(_qkv(rng, T, S, 4, 2, HV), mask=mask, bias=bias))
    # Causal MHA self attention with a full per-head bias and a given scale.
    bias = rng.standard_normal((B, 4, T, T)).astype(np.float32)
    cases["causal"] = Case(dict(_qkv(rng, T, T, 4, 4), bias=bias), is_causal=True, scale=0.3)
    # Rows with no visible key: a random mask elsewhere, a full bias, a Shaw value table.
    mask = rng.random((B, 1, T, S)) > 0.3
    mask[:, :, DEAD_ROWS] = False
    arrays = dict(_qkv(rng, T, S, 4, 2, HV), mask=mask, bias=rng.standard_normal((B, 4, T, S)))
    arrays["bias"] = arrays["bias"].astype(np.float32)
    cases["dead_rows"] = Case(dict(arrays, **_shaw(rng, 4, 1, key=False)), max_distance=1)
    # Rows with no visible key by bias alone: all -inf (no mask, no causal
    # rule, so nothing but the bias says so; jax.nn's xla path gives NaN),
    # and scattered -inf keys elsewhere.
    bias = rng.standard_normal((B, 4, T, S)).astype(np.float32)
    bias[:, :, DEAD_ROWS] = -np.inf
    bias[:, 1, :, ::7] = -np.inf
    cases["bias_dead_rows"] = Case(dict(_qkv(rng, T, S, 4, 2, HV), bias=bias))
    # MQA cross attention with padding (segment 0) on both sides and a query
    # segment (3) that has no key at all: its rows are 0.
    qseg = np.tile(np.int32([1] * 8 + [2] * 8 + [3] * 4 + [0] * 4), (B, 1))
    kvseg = np.tile(np.int32([1] * 9 + [2] * 7 + [0] * 4), (B, 1))
    cases["padding_mqa"] = Case(
        dict(_qkv(rng, T, S, 4, 1, HV), q_segment_ids=qseg, kv_segment_ids=kvseg)
    )
    positions = dict(
        q_positions=np.tile(np.arange(T), (B, 1)), kv_positions=np.tile(np.arange(S), (B, 1))
    )
    for name, kw in {
        "shaw_per_head": dict(per_head=True),
        "shaw_key_only": dict(value=False),
        "shaw_value_only": dict(key=False),
    }.items():
        arrays = dict(_qkv(rng, T, S, 4, 2, HV), **_shaw(rng, 4, 3, **kw), **positions)
        cases[name] = Case(arrays, max_distance=3)
    # Everything at once, the way a packed decoder layer calls it (MQA).
    arrays = dict(_qkv(rng, T, T, 4, 1, HV), **_packed(PACKED_LENGTHS, T))
    arrays["bias"] = rng.standard_normal((1, 4, T, T)).astype(np.float32)
    arrays.update(_shaw(rng, 4, 2, per_head=True))
    cases["shaw_packed_causal_bias"] = Case(arrays, is_causal=True, max_distance=2)
    return cases


CASES = _cases()


@functools.cache
def vjp_fn(attend: Callable, static: tuple):
    """Jitted `(out, grads)` of `attend` on a case's arrays and a cotangent;
    cached per implementation and static arguments, so every contract that
    reruns a case (same shapes) reuses its compilation."""
    kw = dict(static)
    dist = kw.pop("max_distance")

    def f(arrays, ct):
        diff = {name: arrays.get(name) for name in GRAD_NAMES}
        rest = {name: x for name, x in arrays.items() if name not in GRAD_NAMES}

        def g(diff):
            rel = None
            if dist is not None:
                rel = jattn.ShawRelative(diff["rel_key"], diff["rel_value"], dist)
            nf = normal_form(
                diff["query"],
                diff["key"],
                diff["value"],
                bias=diff["bias"],
                relative=rel,
                **rest,
                **kw,
            )
            return attend(nf)[0]

        out, pull = jax.vjp(g, diff)
        return out, pull(ct.astype(out.dtype))[0]

    return jax.jit(f)


@functools.cache
def scale_vjp_fn(attend: Callable):
    """Jitted `(out, grads, d scale)` of `attend` on a causal call whose
    scale is a traced argument."""

    def f(arrays, scale, ct):
        def g(arrays, scale):
            nf = normal_form(
                arrays["query"],
                arrays["key"],
                arrays["value"],
                arrays["bias"],
                scale=scale,
                is_causal=True,
            )
            return attend(nf)[0]

        out, pull = jax.vjp(g, arrays, scale)
        grads, d_scale = pull(ct.astype(out.dtype))
        return out, grads, d_scale

    return jax.jit(f)


def _padding_as_lengths(case: Case) -> Case:
    """`padding_mqa` with its padding (id 0) given as sequence lengths over
    ids that would otherwise be real (1: a segment with keys)."""
    qseg, kvseg = case.arrays["q_segment_ids"].copy(), case.arrays["kv_segment_ids"].copy()
    q_len, kv_len = int(np.argmin(qseg[0] != 0)), int(np.argmin(kvseg[0] != 0))
    qseg[:, q_len:], kvseg[:, kv_len:] = 1, 1
    return case.replace(
        q_segment_ids=qseg,
        kv_segment_ids=kvseg,
        query_seq_lengths=np.full(B, q_len, np.int32),
        key_value_seq_lengths=np.full(B, kv_len, np.int32),
    )


def _non_finite_at(case: Case, keys: list[int], rows=slice(None)) -> dict:
    """Key and value arrays of `case` with NaN, +Inf and -Inf written into
    the given keys (of the given batch rows)."""
    k, v = case.arrays["key"].copy(), case.arrays["value"].copy()
    for i, s in enumerate(keys):
        v[rows, s, :, i % v.shape[-1]] = np.nan
        k[rows, s, :, 0] = np.inf if i % 2 else -np.inf
        v[rows, s, :, -1] = np.inf
    return dict(key=k, value=v)


def _hidden_keys(rule: str) -> tuple[Case, list[int]]:
    """A case with keys no query may see, and those keys: the padded keys of
    `padding_mqa` (segment 0, or the same padding as lengths), or two mask
    columns of `gqa_mask_bias` (inside tiles with visible keys)."""
    if rule == "mask":
        c, hidden = CASES["gqa_mask_bias"], [4, 8]
        mask = c.arrays["mask"].copy()
        mask[..., hidden] = False
        return c.replace(mask=mask), hidden
    c = CASES["padding_mqa"]
    return (_padding_as_lengths(c) if rule == "lengths" else c), [16, 17, 18, 19]


def cotangent(case: Case, seed: int = 3) -> np.ndarray:
    q, v = case.arrays["query"], case.arrays["value"]
    return (
        np.random.default_rng(seed).standard_normal((*q.shape[:3], v.shape[-1])).astype(np.float32)
    )


def want(case: Case, ct=None):
    """The float64 oracle's output and gradients of `case`."""
    a = {name: x for name, x in case.arrays.items()}
    tables = {name: a.pop(name, None) for name in ("rel_key", "rel_value")}
    rel = None
    if case.max_distance is not None:
        rel = jattn.ShawRelative(tables["rel_key"], tables["rel_value"], case.max_distance)
    q, k, v = (np.asarray(jnp.asarray(a.pop(n), jnp.float32)) for n in ("query", "key", "value"))
    return oracle.attention_and_grads(
        q, k, v, relative=rel, is_causal=case.is_causal, scale=case.scale, cotangent=ct, **a
    )


def close(name: str, got, ref, tol: float):
    """Max error relative to the largest reference value, and finite."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    scale = max(float(np.max(np.abs(ref))), 1e-6)
    err = float(np.max(np.abs(got - ref))) / scale
    assert err <= tol, f"{name}: max error {err:.2e} (scale {scale:.2e}) > {tol:.0e}"


@functools.cache
def reference(case: str):
    """`want` of an unchanged shared case with its default cotangent, computed
    once for every implementation that runs it."""
    c = CASES[case]
    return want(c, cotangent(c))


class AttentionContract:
    """docs/design.md's attention contracts; subclass with `attend` (and `name`
    where the public entry point reaches the implementation by name)."""

    attend: Callable  # NormalForm -> (out, lse); a module-level function (cache key)
    name: str | None = None  # `implementation=` of jattn.dot_product_attention, if any
    tol: float = F32_TOL
    unsupported: dict[str, str] = {}  # contract (method name) -> why it cannot hold

    def run(self, case: Case, ct=None, dtype=jnp.float32):
        """Output and gradients (numpy, None where absent) of this implementation."""
        ct = cotangent(case) if ct is None else ct
        arrays = {
            name: jnp.asarray(x, dtype) if name in GRAD_NAMES and x is not None else x
            for name, x in case.arrays.items()
        }
        out, grads = vjp_fn(type(self).attend, case.static)(arrays, jnp.asarray(ct))
        grads = {
            name: None if g is None else np.asarray(jnp.asarray(g, jnp.float32))
            for name, g in grads.items()
        }
        return np.asarray(jnp.asarray(out, jnp.float32)), grads, out.dtype

    @pytest.fixture(autouse=True)
    def _skip_unsupported(self, request):
        reason = self.unsupported.get(request.function.__name__)
        if reason:
            pytest.skip(f"{type(self).__name__} does not support this: {reason}")

    # -- every case against the float64 oracle, forward and backward -------------------

    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_the_float64_oracle(self, case):
        c = CASES[case]
        out, grads, _ = self.run(c)
        ref, ref_grads = reference(case)
        close("out", out, ref, self.tol)
        for name in GRAD_NAMES:
            if c.arrays.get(name) is None:
                continue
            assert grads[name].shape == np.shape(c.arrays[name]), name
            close(f"d{name}", grads[name], ref_grads[name], self.tol)

    def test_the_worked_example(self):
        """query [1,0]; keys [1,0],[0,1],[-1,0]; values 10,20,40 -> about 17.04."""
        q = np.array([1.0, 0.0], np.float32).reshape(1, 1, 1, 2)
        k = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], np.float32).reshape(1, 3, 1, 2)
        v = np.array([10.0, 20.0, 40.0], np.float32).reshape(1, 3, 1, 1)
        if self.name is None:
            out = type(self).attend(normal_form(q, k, v))[0]
        else:
            out = jattn.dot_product_attention(q, k, v, implementation=self.name)
        w = np.exp(np.array([1, 0, -1]) / np.sqrt(2))  # scores .707, 0, -.707
        np.testing.assert_allclose(w / w.sum(), [0.576, 0.284, 0.140], atol=1e-3)
        assert round(float(out.squeeze()), 2) == 17.04
        np.testing.assert_allclose(
            float(out.squeeze()), float(w @ [10, 20, 40] / w.sum()), rtol=1e-6
        )

    # -- visibility: causal, packing, dead rows, padding --------------------------------

    def test_causal_future_does_not_change_the_past(self):
        c = CASES["causal"]
        out, grads, _ = self.run(c)
        k, v = c.arrays["key"].copy(), c.arrays["value"].copy()
        k[:, 11:] = 100.0 * np.random.default_rng(1).standard_normal(k[:, 11:].shape)
        v[:, 11:] = -50.0
        out2, _, _ = self.run(c.replace(key=k, value=v))
        np.testing.assert_array_equal(out2[:, :11], out[:, :11])
        assert not np.allclose(out2[:, 11:], out[:, 11:])

    def test_packed_sequences_cannot_influence_each_other(self):
        """Changing one packed sequence leaves every other token's output and
        gradients bit-identical; a loss on one sequence sends no gradient to
        its neighbours or the padding."""
        c = CASES["shaw_packed_causal_bias"]
        out, grads, _ = self.run(c)
        changed = {}
        for name in ("query", "key", "value"):
            x = c.arrays[name].copy()
            x[0, SECOND] = 37.0 * np.sign(x[0, SECOND]) + 3.0
            changed[name] = x
        out2, grads2, _ = self.run(c.replace(**changed))
        others = np.r_[0 : SECOND.start, SECOND.stop : T]
        np.testing.assert_array_equal(out2[0, others], out[0, others])
        np.testing.assert_array_equal(out2[1], out[1])
        for name in ("query", "key", "value"):
            np.testing.assert_array_equal(
                grads2[name][0, others], grads[name][0, others], err_msg=name
            )
        assert not np.allclose(out2[0, SECOND], out[0, SECOND])
        ct = cotangent(c)
        ct[0, 7:] = 0.0  # the loss reads only row 0's first sequence
        _, grads, _ = self.run(c, ct)
        for name in ("query", "key", "value"):
            assert np.all(grads[name][0, 7:] == 0.0), name

    def test_fully_masked_rows_are_zero_with_no_gradient(self):
        out, grads, _ = self.run(CASES["dead_rows"])
        assert np.all(out[:, DEAD_ROWS] == 0.0)
        assert np.all(np.abs(np.delete(out, DEAD_ROWS, axis=1)).sum(-1) > 0)
        assert np.all(grads["query"][:, DEAD_ROWS] == 0.0)
        assert np.all(grads["bias"][:, :, DEAD_ROWS] == 0.0)

    def test_padding_is_segment_0_as_with_lengths(self):
        """docs/design.md: a padding token (id 0) is no segment: it sees no key and
        no key sees it, as with sequence lengths. Padded queries return
        exactly 0 with no gradient, padded keys take none, in cross attention
        and in a packed self-attention row (whose three padding tokens would
        otherwise attend each other), and the same padding given as lengths
        (over ids that would otherwise be real) is bit-identical."""
        c = CASES["padding_mqa"]
        out, grads, _ = self.run(c)
        assert np.all(out[:, 20:] == 0.0) and np.all(grads["query"][:, 20:] == 0.0)
        assert np.all(grads["key"][:, 16:] == 0.0) and np.all(grads["value"][:, 16:] == 0.0)
        out2, grads2, _ = self.run(_padding_as_lengths(c))
        np.testing.assert_array_equal(out2, out)
        for name in ("query", "key", "value"):
            np.testing.assert_array_equal(grads2[name], grads[name], err_msg=name)
        out, grads, _ = self.run(CASES["shaw_packed_causal_bias"])
        pad = slice(sum(PACKED_LENGTHS[0]), T)  # row 0's padding tokens
        assert np.all(out[0, pad] == 0.0)
        for name in ("query", "key", "value"):
            assert np.all(grads[name][0, pad] == 0.0), name

    def test_a_row_of_minus_inf_bias_is_zero_with_no_gradient(self):
        """A row whose bias is -inf everywhere has no visible key: exactly 0,
        no gradient to the query or the bias (never NaN, in every
        implementation; jax.nn's xla path gives NaN). The other rows, with
        some -inf keys, match the float64 oracle (test_matches_...)."""
        out, grads, _ = self.run(CASES["bias_dead_rows"])
        assert np.all(out[:, DEAD_ROWS] == 0.0)
        assert np.all(np.abs(np.delete(out, DEAD_ROWS, axis=1)).sum(-1) > 0)
        assert np.all(grads["query"][:, DEAD_ROWS] == 0.0)
        assert np.all(grads["bias"][:, :, DEAD_ROWS] == 0.0)

    @pytest.mark.parametrize("rule", ["segment_0", "lengths", "mask"])
    def test_non_finite_hidden_keys_never_reach_the_output(self, rule):
        """NaN and Inf in the keys and values of keys no query may see
        (padding as segment 0 or lengths, a mask column) leave every output
        and gradient bit-identical: hidden keys are selected away, never
        multiplied by a 0 weight (0 · NaN = NaN, as in jax.nn)."""
        c, hidden = _hidden_keys(rule)
        out, grads, _ = self.run(c)
        bad = _non_finite_at(c, hidden)
        out2, grads2, _ = self.run(c.replace(**bad))
        np.testing.assert_array_equal(out2, out)
        for name in ("query", "key", "value", "bias"):
            if grads[name] is not None:
                np.testing.assert_array_equal(grads2[name], grads[name], err_msg=name)
        assert np.all(grads2["key"][:, hidden] == 0.0) and np.all(grads2["value"][:, hidden] == 0)

    @pytest.mark.parametrize("case", ["causal", "shaw_packed_causal_bias"])
    def test_non_finite_keys_reach_only_the_queries_that_see_them(self, case):
        """A NaN or Inf key seen by some queries (causal: the later ones;
        packing: its own sequence's) makes exactly those rows NaN, as jax.nn
        would, and no other: the other rows and their query gradients are
        bit-identical, a masked NaN stays out."""
        c = CASES[case]
        if case == "causal":
            hidden_from, sees = np.s_[:, :11], np.s_[:, 11:]
            bad = _non_finite_at(c, [11, 13])
        else:  # row 0's second sequence (7..15), keys 9 and 12 (causal within it)
            hidden_from, sees = np.r_[0:9, 16:T], np.s_[0, 9:16]
            bad = _non_finite_at(c, [9, 12], rows=[0])
        ct = cotangent(c)
        ct[sees] = 0.0  # the loss reads only rows that see no bad key
        out, grads, _ = self.run(c, ct)
        with jax.debug_nans(False), jax.debug_infs(False):
            out2, grads2, _ = self.run(c.replace(**bad), ct)
        assert np.all(np.isnan(out2[sees]))
        if case == "causal":
            np.testing.assert_array_equal(out2[hidden_from], out[hidden_from])
            np.testing.assert_array_equal(grads2["query"][hidden_from], grads["query"][hidden_from])
        else:
            np.testing.assert_array_equal(out2[0, hidden_from], out[0, hidden_from])
            np.testing.assert_array_equal(out2[1], out[1])
            q0, q1 = grads2["query"][0], grads["query"][0]
            np.testing.assert_array_equal(q0[hidden_from], q1[hidden_from])
            np.testing.assert_array_equal(grads2["query"][1], grads["query"][1])

    @pytest.mark.parametrize("case", ["shaw_packed_causal_bias", "gqa_mask_bias"])
    def test_assume_finite_skips_the_guard_and_keeps_finite_results(self, case):
        """`assume_finite=True` (the caller vouches its keys and values are
        finite) skips the guard of the two tests above; for finite inputs the
        output and every gradient match the guarded call's to float32
        rounding (2^-20 of the largest value: the ops XLA fuses differ) and
        the float64 oracle as closely."""
        c = CASES[case]
        out, grads, _ = self.run(c)
        out2, grads2, _ = self.run(dataclasses.replace(c, assume_finite=True))
        ref, ref_grads = reference(case)
        close("out", out2, out.astype(np.float64), 2.0**-20)
        close("out", out2, ref, self.tol)
        for name in GRAD_NAMES:
            if grads[name] is not None:
                close(f"d{name}", grads2[name], grads[name].astype(np.float64), 2.0**-20)
                close(f"d{name}", grads2[name], ref_grads[name], self.tol)

    def test_a_traced_scale(self):
        """`scale` may be traced (jax.jit over it, as jax.nn allows): output
        and gradients, the scale's own included, match the float64 oracle
        (the scale's gradient by a central difference of the oracle)."""
        c = CASES["causal"]
        ct = cotangent(c)
        arrays = {n: jnp.asarray(c.arrays[n]) for n in ("query", "key", "value", "bias")}
        out, grads, d_scale = scale_vjp_fn(type(self).attend)(arrays, c.scale, jnp.asarray(ct))
        ref, ref_grads = reference("causal")
        close("out", out, ref, self.tol)
        for name in ("query", "key", "value", "bias"):
            close(f"d{name}", grads[name], ref_grads[name], self.tol)
        h = 1e-4
        plus, minus = (want(dataclasses.replace(c, scale=c.scale + d))[0] for d in (h, -h))
        fd = np.sum(ct * (plus - minus)) / (2 * h)
        close("dscale", np.asarray(d_scale)[None], np.asarray([fd]), 10 * self.tol)

    def test_a_segment_without_keys(self):
        """A query segment with no key returns exactly 0 and takes no
        gradient (padding, segment 0, is no segment at all: see
        test_padding_is_segment_0_as_with_lengths)."""
        out, grads, _ = self.run(CASES["padding_mqa"])
        assert np.all(np.isfinite(out))
        assert np.all(out[:, 16:20] == 0.0)
        assert np.all(grads["query"][:, 16:20] == 0.0)

    # -- numerics --------------------------------------------------------------------------

    @pytest.mark.parametrize("magnitude", [1e2, 1e4])
    def test_extreme_logits_are_finite_and_exact(self, magnitude):
        """Logits of order 1e5 and 1e9: subtracting the max keeps the softmax
        finite and the distribution unchanged (it only saturates)."""
        c = CASES["causal"]
        c = c.replace(query=c.arrays["query"] * magnitude, key=c.arrays["key"] * magnitude)
        out, grads, _ = self.run(c)
        ref, _ = want(c)
        close("out", out, ref, 1e-4)
        assert all(np.all(np.isfinite(g)) for g in grads.values() if g is not None)

    @pytest.mark.parametrize("rule", ["segment_0", "mask"])
    def test_float32_max_behind_masks_is_never_seen(self, rule):
        """Keys and values at ±3.40e38 (float32's largest finite values) in
        keys no query may see (padding as segment 0, whole tiles of it; mask
        columns inside visible tiles) leave every output and gradient
        bit-identical. A key with weight 0 contributes exactly nothing: no
        float32 operand split for the tensor cores may round it to ±Inf,
        and no `0 · (dO·v - D)` may meet an overflowed dO·v (tokamax's suite
        found the first in the kernels' TF32 split)."""
        c, hidden = _hidden_keys(rule)
        out, grads, _ = self.run(c)
        big = np.finfo(np.float32).max
        k, v = c.arrays["key"].copy(), c.arrays["value"].copy()
        for s in hidden:
            k[:, s, :, ::2], k[:, s, :, 1::2] = big, -big
            v[:, s, :, ::2], v[:, s, :, 1::2] = -big, big
        # dO·v overflows at the hidden keys (an intermediate thrown away), so
        # the debug checks, which stop at any Inf, are off for this run.
        with jax.debug_nans(False), jax.debug_infs(False):
            out2, grads2, _ = self.run(c.replace(key=k, value=v))
        np.testing.assert_array_equal(out2, out)
        for name in ("query", "key", "value", "bias"):
            if grads[name] is not None:
                np.testing.assert_array_equal(grads2[name], grads[name], err_msg=name)

    def test_float32_max_in_visible_keys_and_values(self):
        """±3.40e38 in keys and values a query sees: the output is the float64
        oracle's to float32 rounding of the largest value, and every gradient
        is finite. Queries are small so that the logits stay finite (1e-3 x
        3.4e38 is a logit no float32 softmax misreads); the cotangent is small
        so that dO·V does. The oracle's query gradient in rows the big key
        dominates is a cancellation (P = 1 times dP - D) that float32 cannot
        reproduce, so gradients are held finite, not equal."""
        c = CASES["causal"]
        big = np.finfo(np.float32).max
        k, v = c.arrays["key"].copy(), c.arrays["value"].copy()
        k[:, 5, :, 0], k[:, 9, :, 1] = big, -big
        v[:, 3, :, 0], v[:, 11, :, 2] = big, -big
        c = c.replace(key=k, value=v, query=c.arrays["query"] * 1e-3)
        ct = cotangent(c) * 1e-3
        out, grads, _ = self.run(c, ct)
        ref, _ = want(c, ct)
        close("out", out, ref, 1e-4)
        assert np.max(np.abs(out)) > 1e37  # the big values reach the output
        assert all(np.all(np.isfinite(g)) for g in grads.values() if g is not None)

    def test_bfloat16(self):
        """bf16 inputs give bf16 outputs within bf16 rounding of the oracle on
        the rounded inputs, forward and backward; dead rows stay exactly 0."""
        c = CASES["dead_rows"]
        rounded = {
            n: np.asarray(jnp.asarray(c.arrays[n], jnp.bfloat16).astype(jnp.float32))
            for n in ("query", "key", "value", "bias", "rel_value")
        }
        c = c.replace(**rounded)
        ct = np.asarray(jnp.asarray(cotangent(c), jnp.bfloat16).astype(jnp.float32))
        out, grads, dtype = self.run(c, ct, dtype=jnp.bfloat16)
        assert dtype == jnp.bfloat16
        ref, ref_grads = want(c, ct)
        close("out", out, ref, BF16_TOL)
        for name in ("query", "key", "value", "bias", "rel_value"):
            close(f"d{name}", grads[name], ref_grads[name], BF16_TOL)
        assert np.all(out[:, DEAD_ROWS] == 0.0)
        assert np.all(grads["query"][:, DEAD_ROWS] == 0.0)

    # -- relative schemes ------------------------------------------------------------------

    def test_shaw_is_shift_invariant_and_order_sensitive(self):
        c = CASES["shaw_per_head"]
        out, _, _ = self.run(c)
        shifted = c.replace(
            q_positions=c.arrays["q_positions"] + 1000, kv_positions=c.arrays["kv_positions"] + 1000
        )
        np.testing.assert_allclose(self.run(shifted)[0], out, rtol=0, atol=1e-5)
        # Swap keys 2 and 5 with their values: without positions the output
        # would not change (a sum over keys); with relative positions it does.
        perm = np.array([0, 1, 5, 3, 4, 2, *range(6, S)])
        swapped = c.replace(key=c.arrays["key"][:, perm], value=c.arrays["value"][:, perm])
        assert not np.allclose(self.run(swapped)[0], out, atol=1e-4)
