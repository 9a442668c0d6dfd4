"""The Forgetting Transformer's forget gate (`position="forgetting"`,
`jattn.positions.forgetting`), beyond the registry's contracts that
tests/test_schemes.py runs on it (cached decoding, beam search, packing,
causality, shift invariance, logical axes).

- The gate through attention's row and column terms, with its gradients to
  the gate's `w` and `b` (and to q, k, v, x), against a float64 materialised
  formula written here: `bias[i, j] = Σ_{l=j+1..i} log σ(x_l·w + b)` summed
  from a dense `[T, T, T]` indicator, softmax and all; causal and packed
  (a segment's sums, `segment_cumsum`, in rows whose examples are one run
  each and in a decoder-only stream's interleaved runs).
- The same through the Pallas kernels (Triton, interpret mode) in float32,
  and a model layer with `attention_impl="pallas"` equal to the chunked
  one (CoPE and stick-breaking, which have no kernel, still refuse it).
- A newcomer's input shifted right, by padding or by another segment in
  front, gives the same outputs shifted, at the attention layer where the
  gate acts: nothing there reads positions.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import normal_form

from jattn import positions as pos_lib
from jattn.attention.chunked import attention_chunked
from jattn.attention.pallas.flash_attention import flash_attention
from jattn.attention.xla import attention_xla
from jattn.models import TransformerConfig
from jattn.models.layers import Attention
from jattn.visibility import Visibility

B, T, N, H, D = 2, 13, 2, 4, 6

IMPLS = {
    "xla": attention_xla,
    "chunked": lambda nf: attention_chunked(nf, block_q=4, block_k=3),
    # float32 kernels (interpret mode); 13 tokens in tiles of 8 query and 16 keys
    "pallas": lambda nf: flash_attention(nf, block_q=8, block_k=16, backend="interpret"),
}


LAYOUTS = {
    # two examples one after the other, then padding; one example a row
    "packed": [[1] * 5 + [2] * 6 + [0] * 2, [1] * 13],
    # a decoder-only stream: every example's inputs, padding, then every
    # example's targets, so each example is two runs with the other between
    "interleaved": [
        [1, 1, 1, 2, 2, 0, 1, 1, 2, 2, 2, 0, 0],
        [1, 1, 2, 2, 2, 2, 1, 1, 1, 2, 0, 1, 1],
    ],
}


def _packed(layout: str = "packed"):
    """Segment ids `[B, T]` and positions counting each segment's tokens in
    stream order (padding at 0)."""
    ids = np.array(LAYOUTS[layout], np.int32)
    pos = np.zeros_like(ids)
    for r in range(B):
        for s in set(ids[r].tolist()) - {0}:
            at = np.flatnonzero(ids[r] == s)
            pos[r, at] = np.arange(len(at))
    return ids, pos


def _problem(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, D))
    q, k, v = (rng.normal(size=(B, T, N, H)) for _ in range(3))
    w = 0.8 * rng.normal(size=(D, N))
    b = rng.normal(size=(N,))  # gates from ~0.1 to ~0.95: strong, varied forgetting
    ct = rng.normal(size=(B, T, N, H))
    return x, q, k, v, w, b, ct


def _jattn(impl, segments):
    ids, pos = _packed(segments) if segments else (None, None)
    kw = dict(is_causal=True)
    if segments:
        kw.update(q_segment_ids=ids, kv_segment_ids=ids, q_positions=pos, kv_positions=pos)

    def f(x, q, k, v, w, b):
        logf = pos_lib.log_forget_gates({"w": w, "b": b}, x)  # [B, T, N]
        c = pos_lib.segment_cumsum(logf, None if ids is None else jnp.asarray(ids))
        nf = normal_form(q, k, v, row_col_bias=pos_lib.forget_row_col(c, c), **kw)
        return IMPLS[impl](nf)[0]

    return f


def _materialised(segments):
    """The paper's formula, dense: `Σ log f_l` over the tokens l of query i's
    example between key j and i (`pos_j < pos_l ≤ pos_i`), no cumsum."""
    if segments:
        ids, pos = _packed(segments)
    else:
        ids, pos = np.ones((B, T), np.int32), np.tile(np.arange(T), (B, 1))
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] != 0)  # [B, i, l]
    p_i, p_j, p_l = pos[:, :, None, None], pos[:, None, :, None], pos[:, None, None, :]
    between = same[:, :, None, :] & (p_j < p_l) & (p_l <= p_i)  # [B, i, j, l]
    between = jnp.asarray(between.astype(np.float64))
    visible = (pos[:, :, None] >= pos[:, None, :]) & (ids[:, :, None] == ids[:, None, :])
    visible &= (ids[:, :, None] != 0)[..., :]  # padding sees nothing
    visible = jnp.asarray(visible[:, None])  # [B, 1, T, T]

    def f(x, q, k, v, w, b):
        logf = jax.nn.log_sigmoid(jnp.einsum("BTD,DN->BTN", x, w) + b[None, None])  # [B, T, N]
        bias = jnp.einsum("Bijl,BlN->BNij", between, logf)
        s = jnp.einsum("BiNH,BjNH->BNij", q, k) / np.sqrt(H) + bias
        s = jnp.where(visible, s, -jnp.inf)
        m = jnp.max(jnp.where(visible, s, -1e300), axis=-1, keepdims=True)
        p = jnp.where(visible, jnp.exp(s - m), 0.0)
        den = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(den == 0, 1.0, den)
        return jnp.einsum("BNij,BjNH->BiNH", p, v)

    return f


# Tolerance against the float64 formula, relative to max(1, |reference|):
# xla and chunked run in float64 but form q·k with a float32 accumulator
# (`scores.tile_logits`), ~1e-7 per logit with or without the gate, which
# d w and d b sum over every logit; the Pallas kernels run in float32.
TOLERANCE = {"xla": 1e-5, "chunked": 1e-5, "pallas": 1e-4}


@pytest.mark.parametrize("segments", [None, "packed", "interleaved"], ids=str)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_gate_and_its_gradients_match_the_materialised_formula_in_float64(impl, segments):
    x, q, k, v, w, b, ct = _problem(0)
    names = ("x", "q", "k", "v", "w", "b")
    dtype = jnp.float32 if impl == "pallas" else jnp.float64
    # The reference sees the inputs the implementation sees.
    problem = [np.asarray(a, dtype).astype(np.float64) for a in (x, q, k, v, w, b, ct)]
    with jax.enable_x64(True), jax.debug_nans(False), jax.debug_infs(False):
        args = [jnp.asarray(a, jnp.float64) for a in problem[:-1]]
        ref, ref_vjp = jax.vjp(_materialised(segments), *args)
        ref_grads = ref_vjp(jnp.asarray(problem[-1]))
    with jax.enable_x64(dtype == jnp.float64):
        out, vjp = jax.vjp(_jattn(impl, segments), *(jnp.asarray(a, dtype) for a in problem[:-1]))
        grads = vjp(jnp.asarray(problem[-1], dtype))
    tol = TOLERANCE[impl]
    for name, g, r in zip(("out",) + names, (out, *grads), (ref, *ref_grads), strict=True):
        r = np.asarray(r)
        atol = tol * max(1.0, float(np.max(np.abs(r))))
        g = np.asarray(g, np.float64)
        np.testing.assert_allclose(g, r, rtol=tol, atol=atol, err_msg=f"d{name}")
    assert float(np.max(np.abs(np.asarray(ref_grads[4])))) > 1e-3  # the gate has a gradient


def test_the_gates_forget():
    """Not a no-op: the gate's term changes the output (gates far from 1)."""
    x, q, k, v, w, b, _ = _problem(1)
    f = _jattn("xla", False)
    gated = np.asarray(f(*(jnp.asarray(a, jnp.float32) for a in (x, q, k, v, w, b))))
    open_ = np.asarray(f(*(jnp.asarray(a, jnp.float32) for a in (x, q, k, v, w, b + 50.0))))
    assert np.max(np.abs(gated - open_)) > 1e-2


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_segment_cumsum_sums_each_segments_own_tokens(layout):
    """`c_i` is the sum over the tokens of i's segment up to i, wherever the
    segment's runs sit in the row; padding adds nothing."""
    ids, _ = _packed(layout)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, N)), jnp.float32)
    got = np.asarray(pos_lib.segment_cumsum(x, jnp.asarray(ids)))
    want = np.zeros((B, T, N), np.float32)
    for r in range(B):
        for i in range(T):
            own = (ids[r, : i + 1] == ids[r, i]) & (ids[r, : i + 1] != 0)
            want[r, i] = np.asarray(x[r, : i + 1])[own].sum(0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _layer(gate_shift: float = -5.0, impl: str = "chunked"):
    cfg = TransformerConfig(
        vocab_size=11, d_model=D * 2, num_heads=N, num_kv_heads=N, num_layers=1, d_ff=8,
        max_len=64, position="forgetting", attention_impl=impl,
    )  # fmt: skip
    layer = Attention(cfg, causal=True)
    x = jnp.zeros((1, 4, D * 2), jnp.float32)
    params = nn.unbox(layer.init(jax.random.key(0), x, x)["params"])
    # Gates far from 1 (the init starts them at σ(5) ≈ 0.993, almost open).
    gate = params["forget_gate"]
    params = {**params, "forget_gate": {**gate, "b": gate["b"] + gate_shift}}

    def run(x, seg, pos):
        vis = Visibility.of_sequence(seg, pos)
        return layer.apply({"params": params}, x, x, visibility=vis)

    return cfg, run


@pytest.mark.parametrize("front", ["padding", "newcomer"])
def test_a_shifted_input_gives_shifted_outputs(front):
    """Row 0: the input alone. Row 1: `p` tokens in front (padding, segment
    0, or another sequence, segment 1), then the same input, its positions
    shifted by `p` too. The outputs of row 1 from `p` on are row 0's."""
    cfg, run = _layer()
    rng = np.random.default_rng(3)
    t, p = 9, 4
    x = rng.normal(size=(t, cfg.d_model)).astype(np.float32)
    other = rng.normal(size=(p, cfg.d_model)).astype(np.float32)
    rows = np.zeros((2, t + p, cfg.d_model), np.float32)
    rows[0, :t], rows[1, :p], rows[1, p:] = x, other, x
    seg = np.zeros((2, t + p), np.int32)
    seg[0, :t] = 1
    seg[1, :p], seg[1, p:] = (0 if front == "padding" else 1), 2
    pos = np.tile(np.arange(t + p, dtype=np.int32), (2, 1))
    out = np.asarray(run(jnp.asarray(rows), jnp.asarray(seg), jnp.asarray(pos)))
    np.testing.assert_allclose(out[1, p:], out[0, :t], rtol=1e-5, atol=1e-5)
    # The gate acts: the same layer with the gates wide open differs.
    _, run_open = _layer(gate_shift=50.0)
    open_ = np.asarray(run_open(jnp.asarray(rows), jnp.asarray(seg), jnp.asarray(pos)))
    assert np.abs(open_[0, :t] - out[0, :t]).max() > 1e-3


def test_a_pallas_layer_equals_the_chunked_layer():
    """`attention_impl="pallas"` takes the gate (the kernels read its row and
    column terms): a packed, padded batch gives the chunked layer's outputs.
    CoPE and stick-breaking have no kernel and still refuse it."""
    _, run = _layer(impl="chunked")
    _, run_pallas = _layer(impl="pallas")
    ids, pos = (jnp.asarray(a) for a in _packed("interleaved"))
    x = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, D * 2)), jnp.float32)
    np.testing.assert_allclose(run_pallas(x, ids, pos), run(x, ids, pos), rtol=1e-5, atol=1e-5)
    for position in ("cope", "stick_breaking"):
        with pytest.raises(ValueError, match="no reverse scan: attention_impl='pallas'"):
            TransformerConfig(
                vocab_size=11, d_model=8, num_heads=2, num_layers=1, d_ff=8,
                position=position, attention_impl="pallas",
            )  # fmt: skip


def test_options_and_their_checks():
    cfg = TransformerConfig(
        vocab_size=11, d_model=8, num_heads=2, num_layers=1, d_ff=8, position="forgetting",
        position_options={"forgetting": {"bias_init": 3.0}},
    )  # fmt: skip
    assert cfg.position_options["forgetting"].bias_init == 3.0
    with pytest.raises(ValueError, match="position_options.forgetting: bias_init must be finite"):
        TransformerConfig(
            vocab_size=11, d_model=8, num_heads=2, num_layers=1, d_ff=8,
            position_options={"forgetting": {"bias_init": float("inf")}},
        )  # fmt: skip


def test_captured_weights_include_the_gate():
    """`capture_attention` sows the weights the layer mixed values with: the
    gate's terms are in them (values mixed by the sown weights and projected
    out give the layer's output)."""
    cfg, _ = _layer()
    cfg = cfg.replace(capture_attention=True)
    layer = Attention(cfg, causal=True)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 7, cfg.d_model)), jnp.float32)
    params = nn.unbox(layer.init(jax.random.key(0), x, x)["params"])
    gate = params["forget_gate"]
    params = {**params, "forget_gate": {**gate, "b": gate["b"] - 5.0}}
    out, sown = layer.apply({"params": params}, x, x, mutable=["intermediates"])
    (weights,) = sown["intermediates"]["attention_weights"]  # [B, N, T, S]
    v = jnp.einsum("BSD,DKH->BSKH", x, params["v"])
    mixed = jnp.einsum("BNTS,BSNH->BTNH", weights, v)
    np.testing.assert_allclose(
        jnp.einsum("BTNH,NHD->BTD", mixed, params["o"]), out, rtol=1e-4, atol=1e-5
    )
