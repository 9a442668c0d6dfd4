"""The positional-scheme contracts, built from the registry `jattn.models.SCHEMES`.

Every registered scheme (and a toy one registered by this file, as a user's
would be) must: decode with the KV cache exactly as the full forward pass
(teacher forcing, greedy, and beam search against the recomputing oracle of
tests/decode_oracle.py), give packed rows the outputs of
unpacked ones, be causal in the decoder, see the order of the encoder's
inputs (unless it declares itself order blind), be shift invariant where it
declares it (and not where it does not), and name every parameter's logical
axes. A scheme added later is covered with no edit here.

Then the scheme-specific contracts: ALiBi, T5 and Shaw's bias through score
mods equal the [B, N, T, S] biases they replaced (the pre-registry formula,
with tests/oracle.py's `alibi_bias` / `t5_bias`); ALiBi's offset form sees order where the
symmetric one is mirror blind; Ruoss et al.'s randomised positions; RoPE's
scalings and xPos against float64 references.

Tiny models, random parameters drawn on the host, one compiled function per
scheme and purpose (the `zoo` fixture).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import oracle
import pytest
from decode_oracle import beam_by_recomputation
from jax import lax
from model_params import fill_params as _fill

import jattn
from jattn import positions as pos_lib
from jattn.models import SCHEMES, Transformer, TransformerConfig, decoding
from jattn.models.axes import AXIS_NAMES, param
from jattn.models.inputs import random_positions
from jattn.models.layer_call import LayerCall
from jattn.models.layers import Attention
from jattn.models.schemes import Scheme, SchemeOptions, register
from jattn.models.transformer import shift_right

# -- a scheme registered from outside the package ---------------------------------------


def _toy_mod(w, score, batch, head, q_position, kv_position):
    """A learned per-head weight on the sign of `kv - q`: relative, shift invariant."""
    return score + w[head] * jnp.sign(kv_position - q_position).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class ToyOptions(SchemeOptions):
    """The toy's one option: its weights' initial value."""

    init: float = 1.0

    def check(self):
        if not math.isfinite(self.init):
            raise ValueError(f"init must be finite, got {self.init!r}")


@dataclasses.dataclass(frozen=True)
class Toy(Scheme):
    Options = ToyOptions
    options_key = "toy"

    relative: bool = True
    shift_invariant: bool = True

    def score_mod(self, module, cfg, site, state):
        init = nn.initializers.constant(self.options(cfg).init)
        w = param(module, "toy_w", init, (cfg.num_heads,), ("heads",), jnp.float32)
        return jattn.ScoreMod(_toy_mod, w)


TOY = Toy("toy")
NAMES = sorted(SCHEMES) + [TOY.name]
# Variants of the schemes' options, each checked like a scheme.
VARIANTS = {
    "shaw[bias]": dict(position="shaw", position_options={"shaw": {"terms": "bias"}}),
    "shaw[key+bias]": dict(position="shaw", position_options={"shaw": {"terms": "key+bias"}}),
    "rel2 shaw[key+bias]": dict(
        position="shaw", position_options={"shaw": {"terms": "key+bias"}}, relative_cross=True
    ),
    "rel2 rope": dict(position="rope", relative_cross=True),
    "rel2 alibi": dict(position="alibi", relative_cross=True),
    "rel2 t5": dict(position="t5", relative_cross=True),
    "rel2 fire": dict(position="fire", relative_cross=True),
    "t5 per layer": dict(position="t5", position_options={"t5": {"per_layer": True}}),
    "alibi offset": dict(position="alibi", position_options={"alibi": {"mode": "offset"}}),
}
CASES = NAMES + list(VARIANTS)
TINY = dict(
    vocab_size=13,
    d_model=16,
    num_heads=4,
    num_kv_heads=2,  # GQA everywhere
    num_layers=1,
    d_ff=32,
    dropout_rate=0.1,
    max_len=32,
    position_options={
        "shaw": {"max_distance": 3},  # < L: Shaw's clipping is exercised
        "t5": {"num_buckets": 8, "max_distance": 16},
        "fire": {"hidden": 4},
    },
    attention_impl="xla",
)
L = 8
# The decoding checks' shapes: ROWS rows a recomputed full pass (greedy's
# batch, and the beam oracle's B*W rows in chunks of it: one compile a scheme
# for both), SOURCE source tokens, STEPS decoded ones.
ROWS, SOURCE, STEPS = 3, 5, 6


@pytest.fixture(scope="module", autouse=True)
def toy_registered():
    """The toy scheme is in SCHEMES while this module's tests run, and only then."""
    register(TOY)
    yield
    del SCHEMES[TOY.name]


def config_of(case: str, **overrides) -> TransformerConfig:
    kw = VARIANTS.get(case, dict(position=case))
    return TransformerConfig(**TINY).replace(**kw).replace(**overrides)


# Smaller weights than the default (0.3) and the tests' length.
fill_params = functools.partial(_fill, scale=0.3, length=L)


@dataclasses.dataclass
class Built:
    model: Transformer
    params: dict
    run: callable  # (params, inputs, targets, iseg, tseg, ipos, tpos) -> (logits, encoded)
    decode: callable  # (params, inputs, targets) -> (full, cached, greedy)

    def fwd(self, *batch):
        return np.asarray(self.run(self.params, *batch)[0])

    def enc(self, inputs, iseg, ipos):
        ones = np.ones_like(inputs)
        return np.asarray(self.run(self.params, inputs, ones, iseg, ones, ipos, ipos)[1])


def build(config: TransformerConfig, seed: int = 0) -> Built:
    model = Transformer(config)

    def both(module, inputs, targets, iseg, tseg, ipos, tpos):
        encoded = module.encode(inputs, inputs_segment_ids=iseg, inputs_positions=ipos)
        logits = module.decode(
            encoded, inputs, targets, inputs_segment_ids=iseg, inputs_positions=ipos,
            targets_segment_ids=tseg, targets_positions=tpos,
        )  # fmt: skip
        return logits, encoded

    @jax.jit
    def run(params, *batch):
        return nn.apply(both, model)({"params": params}, *batch)

    @jax.jit
    def decode(params, inputs, targets):
        seg = dict(inputs_segment_ids=(inputs != 0).astype(jnp.int32))
        full = model.apply(
            {"params": params}, inputs, targets, **seg, targets_segment_ids=jnp.ones_like(targets)
        )  # every target slot a real token
        encoded = model.apply({"params": params}, inputs, method="encode")
        prev = shift_right(targets, jnp.ones_like(targets))  # [B, T]

        def step(cache, tok):  # tok [B]
            logits, cache = decoding.decode_step(model, params, cache, inputs, tok[:, None])
            return cache, logits

        cache = decoding.prefill(model, params, encoded, targets.shape[1])
        _, cached = lax.scan(step, cache, prev.T)  # [T, B, V]
        greedy = decoding.greedy(model, params, inputs, max_length=targets.shape[1])
        return full, cached.transpose(1, 0, 2), greedy

    return Built(model, fill_params(config, seed), run, decode)


class Zoo(dict):
    def __missing__(self, case):
        self[case] = build(config_of(case), seed=len(self))
        return self[case]


@pytest.fixture(scope="module")
def zoo() -> Zoo:
    return Zoo()


def unpacked(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    seg = (tokens != 0).astype(np.int32)
    return seg, np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)


def packed_batch():
    """Row 0 packs (A, A') and (B, B'); row 1 holds A alone, row 2 B alone."""
    a, a_t = [3, 4, 5], [6, 7, 8, 1]
    bb, b_t = [9, 10, 11, 12], [2, 5, 1]
    inputs, targets = np.zeros((3, L), np.int32), np.zeros((3, L), np.int32)
    iseg, tseg = np.zeros_like(inputs), np.zeros_like(targets)
    ipos, tpos = np.zeros_like(inputs), np.zeros_like(targets)
    inputs[0, :7], targets[0, :7] = a + bb, a_t + b_t
    iseg[0, :7], tseg[0, :7] = [1] * 3 + [2] * 4, [1] * 4 + [2] * 3
    ipos[0, :7], tpos[0, :7] = [0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 0, 1, 2]
    for row, (x, y) in ((1, (a, a_t)), (2, (bb, b_t))):
        inputs[row, : len(x)], targets[row, : len(y)] = x, y
        iseg[row, : len(x)], tseg[row, : len(y)] = 1, 1
        ipos[row], tpos[row] = np.arange(L), np.arange(L)
    return inputs, targets, iseg, tseg, ipos, tpos


# -- the contracts of every registered scheme ------------------------------------------


def test_registry_is_the_one_list_of_names():
    assert {"none", "sinusoidal", "learned", "shaw", "sinusoidal+shaw", "rope", "alibi", "t5",
            "fire", "kerple", "xpos", "toy"} <= set(SCHEMES)  # fmt: skip
    assert all(SCHEMES[name].name == name for name in SCHEMES)
    with pytest.raises(ValueError, match=r"position='fir' is not a positional scheme; choose one"):
        TransformerConfig(**{**TINY, "position": "fir"})
    with pytest.raises(ValueError, match="already registered"):
        register(Toy("toy"))
    register(Toy("toy_causal", causal_only=True))
    try:
        with pytest.raises(ValueError, match="'toy_causal' is causal-only"):
            TransformerConfig(**{**TINY, "position": "toy_causal"})
    finally:
        del SCHEMES["toy_causal"]


@pytest.mark.parametrize("case", CASES)
def test_cached_decoding_equals_full_recomputation(zoo, case):
    b = zoo[case]
    rng = np.random.default_rng(1)
    inputs = rng.integers(2, 13, (ROWS, SOURCE)).astype(np.int32)
    inputs[1, 3:] = 0  # a padded source row
    targets = rng.integers(0, 13, (ROWS, STEPS)).astype(np.int32)
    full, cached, greedy = map(np.asarray, b.decode(b.params, inputs, targets))
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=1e-5)  # teacher forcing
    # Greedy with the cache equals greedy that recomputes the full pass each step.
    tokens, done = np.zeros((ROWS, STEPS), np.int32), np.zeros(ROWS, bool)
    iseg, ipos = unpacked(inputs)
    tseg, tpos = np.ones_like(tokens), unpacked(tokens)[1]
    for t in range(STEPS):
        logits = b.fwd(inputs, tokens, iseg, tseg, ipos, tpos)  # the full pass, recomputed
        nxt = np.where(done, 0, logits[:, t].argmax(-1))
        tokens[:, t] = nxt
        done |= nxt == decoding.EOS
    np.testing.assert_array_equal(greedy, tokens)


@pytest.mark.parametrize("case", CASES)
def test_beam_search_equals_beam_search_by_recomputation(zoo, case):
    """The KV-cache beam search returns the hypotheses (exactly) and scores
    (to float32 rounding) of the same search with the full forward pass
    recomputed at every step (tests/decode_oracle.py); source row 1 is padded."""
    b = zoo[case]
    rng = np.random.default_rng(2)
    inputs = rng.integers(2, 13, (2, SOURCE)).astype(np.int32)
    inputs[1, 3:] = 0
    beams, alpha = 3, 0.6
    seqs = decoding.beam_search(
        b.model, b.params, inputs, max_length=STEPS, beam_size=beams, alpha=alpha
    )  # the public entry point; the call below reuses its compiled search
    _, scores, _ = decoding.beam_search_with_scores(
        b.model, b.params, jnp.asarray(inputs), jnp.float32(alpha), STEPS, beams
    )

    def full(params, x, y):
        """The uncached pass over the B*W rows, every target slot real, ROWS
        rows a call: the shape the greedy check above compiled."""
        out = []
        for r in range(0, x.shape[0], ROWS):
            xr, yr = x[r : r + ROWS], y[r : r + ROWS]
            (seg, pos), tpos = unpacked(xr), unpacked(yr)[1]
            out.append(np.asarray(b.run(params, xr, yr, seg, np.ones_like(yr), pos, tpos)[0]))
        return np.concatenate(out)

    want, want_scores = beam_by_recomputation(
        full, b.params, inputs, max_length=STEPS, beam_size=beams, alpha=alpha
    )
    np.testing.assert_array_equal(np.asarray(seqs), want)
    np.testing.assert_allclose(np.asarray(scores), want_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_packed_equals_unpacked(zoo, case):
    b = zoo[case]
    logits = b.fwd(*packed_batch())
    np.testing.assert_allclose(logits[0, :4], logits[1, :4], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[0, 4:7], logits[2, :3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", NAMES)
def test_decoder_is_causal(zoo, case):
    """Changing later targets leaves the logits of earlier positions unchanged."""
    b = zoo[case]
    inputs, targets, iseg, tseg, ipos, tpos = packed_batch()
    base = b.fwd(inputs, targets, iseg, tseg, ipos, tpos)
    later = targets.copy()
    later[1, 2:4] = [11, 12]
    other = b.fwd(inputs, later, iseg, tseg, ipos, tpos)
    np.testing.assert_allclose(other[1, :3], base[1, :3], rtol=1e-6, atol=1e-6)
    assert np.abs(other[1, 3:4] - base[1, 3:4]).max() > 1e-4


@pytest.mark.parametrize("case", NAMES)
def test_encoder_sees_order_unless_declared_blind(zoo, case):
    b = zoo[case]
    rng = np.random.default_rng(1)
    inputs = rng.integers(2, 13, (3, L)).astype(np.int32)  # no padding
    seg, pos = unpacked(inputs)
    perm = rng.permutation(L)
    out, out_perm = b.enc(inputs, seg, pos), b.enc(inputs[:, perm], seg, pos)
    if SCHEMES[case].order_blind:
        np.testing.assert_allclose(out_perm, out[:, perm], rtol=1e-5, atol=1e-5)
    else:
        assert np.abs(out_perm - out[:, perm]).max() > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_shift_invariance_exactly_where_declared(zoo, case):
    b = zoo[case]
    inputs, targets, iseg, tseg, ipos, tpos = packed_batch()
    c = 5
    enc, enc_shift = b.enc(inputs, iseg, ipos), b.enc(inputs, iseg, ipos + c)
    full = b.fwd(inputs, targets, iseg, tseg, ipos, tpos)
    full_shift = b.fwd(inputs, targets, iseg, tseg, ipos + c, tpos + c)
    if b.model.config.scheme.shift_invariant:
        np.testing.assert_allclose(enc_shift, enc, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(full_shift, full, rtol=1e-5, atol=1e-5)
    else:  # a scheme that does not declare it must not have it by accident
        assert np.abs(enc_shift - enc).max() > 1e-3
        assert np.abs(full_shift - full).max() > 1e-3


@pytest.mark.parametrize("case", NAMES)
def test_every_parameter_names_its_logical_axes(case):
    cfg = config_of(case, attention_bias=True, share_embeddings=False, relative_cross=False)
    x = jnp.ones((1, L), jnp.int32)
    boxed = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), x, x))["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned))
    assert leaves and all(isinstance(v, nn.LogicallyPartitioned) for v in leaves)
    for v in leaves:
        assert len(v.names) == len(v.value.shape) and set(v.names) <= AXIS_NAMES, v.names
    cached = jax.eval_shape(lambda: Transformer(cfg, use_cache=True).init(jax.random.key(0), x, x))
    assert jax.tree.map(jnp.shape, nn.unbox(cached["params"])) == jax.tree.map(
        jnp.shape, nn.unbox(boxed)
    )  # a decoding model restores the training model's parameters


def test_toy_scheme_trains_and_its_parameter_learns():
    """A scheme registered from a test file trains like a built-in one."""
    cfg = config_of("toy", dropout_rate=0.0)
    model = Transformer(cfg)
    params = fill_params(cfg, seed=7)
    inputs, targets, iseg, tseg, ipos, tpos = packed_batch()
    batch = dict(inputs_segment_ids=iseg, targets_segment_ids=tseg,
                 inputs_positions=ipos, targets_positions=tpos)  # fmt: skip
    opt = optax.adam(3e-2)

    def loss_fn(p):
        logits = model.apply({"params": p}, inputs, targets, train=True,
                             rngs={"dropout": jax.random.key(0)}, **batch)  # fmt: skip
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(ce * (tseg > 0)) / jnp.sum(tseg > 0)

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    state, losses, start = opt.init(params), [], params
    for _ in range(15):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses
    w = "encoder/layer_0/self_attention/toy_w".split("/")
    moved = np.asarray(params[w[0]][w[1]][w[2]][w[3]]) - np.asarray(start[w[0]][w[1]][w[2]][w[3]])
    assert np.abs(moved).max() > 1e-3  # gradients reach the score mod's parameter


def test_a_scheme_registered_outside_carries_its_options_into_configs():
    """The toy's options, written in its component only, are a group of
    `position_options`, checked there, spelled in a run's config and read."""
    from jattn.train.config import apply_overrides, build_model_config, load_config  # noqa: PLC0415

    cfg = config_of("toy", position_options={"toy": {"init": 0.25}})
    params = Transformer(cfg).init(jax.random.key(0), *packed_batch()[:2])["params"]
    w = nn.unbox(params["encoder"]["layer_0"]["self_attention"]["toy_w"])
    np.testing.assert_array_equal(w, np.full(4, 0.25, np.float32))
    with pytest.raises(ValueError, match=r"position_options.toy: init must be finite, got nan"):
        config_of("toy", position_options={"toy": {"init": float("nan")}})
    config = load_config(str(pathlib.Path(__file__).parent.parent / "configs" / "smoke.py"))
    config.model.position = "toy"
    apply_overrides(config, [("model.position_options.toy.init", "0.5")])
    assert build_model_config(config).position_options["toy"] == ToyOptions(init=0.5)

    @dataclasses.dataclass(frozen=True)
    class OtherOptions(SchemeOptions):
        pass

    @dataclasses.dataclass(frozen=True)
    class Clash(Toy):
        Options = OtherOptions

    with pytest.raises(ValueError, match="options_key 'toy' holds ToyOptions, not OtherOptions"):
        register(Clash("clash"))


# -- ALiBi, T5 and Shaw's bias: the score mods equal the biases they replaced -----------


def _layer_reference(cfg, p, x, pos, causal, state):
    """The pre-registry Attention layer: projections, the materialised
    `[B, N, T, S]` bias of `alibi_bias` / `t5_bias` / a gathered rel_bias
    table, and `jattn.dot_product_attention` with it."""
    q = jnp.einsum("BTD,DNH->BTNH", x, p["q"])
    k = jnp.einsum("BTD,DKH->BTKH", x, p["k"])
    v = jnp.einsum("BTD,DKH->BTKH", x, p["v"])
    if cfg.position == "alibi":
        bias = oracle.alibi_bias(pos_lib.alibi_slopes(cfg.num_heads), pos, pos)
    elif cfg.position == "t5":
        t5 = cfg.position_options["t5"]
        buckets = oracle.t5_buckets(pos, pos, t5.num_buckets, t5.max_distance, not causal)
        bias = oracle.t5_bias(state, buckets)
    else:
        ids = pos_lib.relative_ids(pos, pos, cfg.position_options["shaw"].max_distance)
        bias = jnp.transpose(jnp.take(p["rel_bias"], ids, axis=1), (1, 0, 2, 3))
    relative = None
    if "rel_key" in p:
        k_max = cfg.position_options["shaw"].max_distance
        relative = jattn.ShawRelative(key=p["rel_key"], max_distance=k_max)
    out = jattn.dot_product_attention(q, k, v, bias, is_causal=causal, relative=relative,
                                      q_positions=pos, kv_positions=pos)  # fmt: skip
    return jnp.einsum("BTNH,NHD->BTD", out, p["o"])


@pytest.mark.parametrize("case", ["alibi", "t5", "shaw[key+bias]"])
@pytest.mark.parametrize("causal", [False, True])
def test_bias_schemes_equal_the_materialised_biases_they_replaced(case, causal):
    cfg = config_of(case)
    layer = Attention(cfg, causal=causal)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 7, 16)), jnp.float32)
    pos = jnp.asarray([[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8, 9]], jnp.int32)
    state = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32) if case == "t5" else None
    vis = jattn.Visibility.of_sequence(positions=pos)
    call = LayerCall(scheme_state=state)
    shapes = jax.eval_shape(lambda: layer.init(jax.random.key(0), x, x, visibility=vis,
                                               call=call))  # fmt: skip
    p = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), jnp.float32),
                     nn.unbox(shapes["params"]))  # fmt: skip
    got = layer.apply({"params": p}, x, x, visibility=vis, call=call)
    want = _layer_reference(cfg, p, x, pos, causal, state)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_alibi_offset_sees_order_the_symmetric_form_is_mirror_blind():
    """A symmetric ALiBi encoder (no other positional term) maps the reversed
    input to the reversed output; the offset form does not (Ruoss et al.)."""
    inputs = np.array([[3, 4, 5, 6, 7, 8, 9, 10]] * 3, np.int32)
    seg, pos = unpacked(inputs)
    for mode, blind in (("symmetric", True), ("offset", False)):
        b = build(config_of("alibi", position_options={"alibi": {"mode": mode}}))
        out, rev = b.enc(inputs, seg, pos), b.enc(inputs[:, ::-1].copy(), seg, pos)
        if blind:
            np.testing.assert_allclose(rev, out[:, ::-1], rtol=1e-5, atol=1e-5)
        else:
            assert np.abs(rev - out[:, ::-1]).max() > 1e-3


# -- randomised positions (Ruoss et al. 2023) ---------------------------------------------


def test_random_positions_are_a_sorted_sample_per_segment():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    m = 12
    draws = np.stack([np.asarray(random_positions(jax.random.key(i), seg, m)) for i in range(200)])
    for row, segments in ((0, [(0, 3), (3, 7)]), (1, [(0, 8)])):
        for a, z in segments:
            run = draws[:, row, a:z]  # [draws, n]
            assert (np.diff(run, axis=1) > 0).all()  # sorted and distinct
            assert run.min() >= 0 and run.max() < m
            # uniform n-subsets: the p-th smallest of n from [0, M) has mean (p+1)(M+1)/(n+1) - 1
            n = z - a
            want = (np.arange(1, n + 1)) * (m + 1) / (n + 1) - 1
            np.testing.assert_allclose(run.mean(axis=0), want, atol=0.5)
    assert (draws[:, 0, 7] == 0).all()  # padding
    assert not (draws[:, 0, :3] == draws[:, 0, 3:6]).all()  # segments drawn independently


def test_random_positions_draw_every_subset_equally_often():
    """Exactly uniform n-subsets, not only the right order-statistic means: the
    10 subsets of 2 of [0, 5) over 4,000 draws pass a chi-square test (9 degrees
    of freedom, 0.1% level 27.9), a segment as long as M takes all of [0, M), and
    a long M still gives each of n tokens a distinct position."""
    seg = jnp.asarray([[1, 1, 0, 2, 2, 2, 2, 2]], jnp.int32)
    draws = np.asarray(
        jax.vmap(lambda k: random_positions(k, seg, 5))(jax.random.split(jax.random.key(0), 4000))
    )[:, 0]  # [draws, T]
    pairs = draws[:, 0] * 5 + draws[:, 1]
    counts = np.array([(pairs == a * 5 + b).sum() for a in range(5) for b in range(a + 1, 5)])
    assert counts.sum() == 4000  # every draw a sorted pair of distinct values
    chi2 = ((counts - 400.0) ** 2 / 400.0).sum()
    assert chi2 < 27.9, counts
    assert (draws[:, 3:] == np.arange(5)).all()  # n = M: the whole range, in order
    # M = 2^18: each value's chance (64 / M) is still 2^11 times float32's uniform step.
    long = np.asarray(random_positions(jax.random.key(1), jnp.ones((2, 64), jnp.int32), 1 << 18))
    assert (np.diff(long, axis=1) > 0).all() and long.max() < 1 << 18


def test_random_positions_in_training_plain_in_evaluation():
    plain_cfg = config_of("sinusoidal", dropout_rate=0.0)
    cfg = plain_cfg.replace(random_positions=32)
    params = fill_params(cfg, seed=2)
    inputs, targets = packed_batch()[:2]

    def run(c, train, seed=0):
        return np.asarray(Transformer(c).apply({"params": params}, inputs, targets, train=train,
                                               rngs={"dropout": jax.random.key(seed)}))  # fmt: skip

    np.testing.assert_array_equal(run(cfg, False), run(plain_cfg, False))  # evaluation: plain
    assert np.abs(run(cfg, True, 0) - run(cfg, True, 1)).max() > 1e-3  # training: drawn
    assert np.abs(run(cfg, True, 0) - run(plain_cfg, True, 0)).max() > 1e-3
    evaluated = cfg.replace(random_positions_eval=True)
    assert np.abs(run(evaluated, False) - run(plain_cfg, False)).max() > 1e-3
    with pytest.raises(ValueError, match="random_positions=40 exceeds the 32 positions"):
        config_of("learned", random_positions=40)


# -- RoPE's scalings and xPos -------------------------------------------------------------


def _rope64(x, pos, inv_freq, magnitude=1.0):
    """Rotate-half RoPE in float64 numpy: x [B, T, N, H], pos [B, T], inv_freq [H/2]."""
    half = x.shape[-1] // 2
    ang = pos[..., None, None] * inv_freq  # [B, T, 1, H/2]
    x1, x2 = x[..., :half], x[..., half:]
    m = np.broadcast_to(magnitude, ang.shape)
    return np.concatenate([(x1 * np.cos(ang) - x2 * np.sin(ang)) * m,
                           (x2 * np.cos(ang) + x1 * np.sin(ang)) * m], axis=-1)  # fmt: skip


@pytest.mark.parametrize("scaling", ["none", "pi", "ntk", "yarn"])
def test_rope_scalings_against_float64(scaling):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 8))
    pos = np.array([[0, 1, 2, 3, 40], [7, 9, 100, 300, 1000]])
    s, base, length = 4.0, 10_000.0, 64
    i = np.arange(4) * 2.0 / 8
    inv, mag = base**-i, 1.0
    if scaling == "pi":
        inv = inv / s
    elif scaling == "ntk":
        inv = (base * s ** (8 / 6)) ** -i
    elif scaling == "yarn":
        ratio = length * inv / (2 * np.pi)
        keep = np.clip((ratio - 1) / 31, 0, 1)
        inv, mag = (1 - keep) * inv / s + keep * inv, 0.1 * np.log(s) + 1
    got = pos_lib.rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), scaling=scaling,
                       scaling_factor=s, original_length=length)  # fmt: skip
    np.testing.assert_allclose(got, _rope64(x, pos, inv, mag), rtol=2e-4, atol=2e-4)
    if scaling == "yarn":  # wavelengths far below the training length kept, far above / s
        kept, _ = pos_lib.rope_frequencies(8, scaling="yarn", factor=s, original_length=10_000)
        squeezed, _ = pos_lib.rope_frequencies(8, scaling="yarn", factor=s, original_length=100)
        assert kept[0] == 1.0 and squeezed[-1] == base ** -i[-1] / s


def test_rope_scaling_acts_at_evaluation_only():
    cfg = config_of("rope", dropout_rate=0.0)
    params = fill_params(cfg, seed=4)
    inputs, targets = packed_batch()[:2]
    key = {"dropout": jax.random.key(0)}
    out = {}
    yarn = {"rope": {"scaling": "yarn", "scaling_factor": 4.0}}
    for name, c in (("none", cfg), ("yarn", cfg.replace(position_options=yarn))):
        model = Transformer(c)
        out[name] = [np.asarray(model.apply({"params": params}, inputs, targets, train=t,
                                            rngs=key)) for t in (False, True)]  # fmt: skip
    np.testing.assert_array_equal(out["yarn"][1], out["none"][1])  # training ignores it
    assert np.abs(out["yarn"][0] - out["none"][0]).max() > 1e-3
    with pytest.raises(ValueError, match="position_options.rope: scaling='long'"):
        config_of("rope", position_options={"rope": {"scaling": "long"}})


def test_xpos_against_float64_decay_and_shift_invariance():
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(1, 6, 2, 8)), rng.normal(size=(1, 6, 2, 8))
    pos = np.arange(6)[None] * 7
    inv = 10_000.0 ** -(np.arange(4) * 2.0 / 8)
    zeta = (np.arange(4) * 2.0 / 8 + 0.4) / 1.4
    want_q = _rope64(q, pos, inv, zeta ** (pos[..., None, None] / 512.0))
    want_k = _rope64(k, pos, inv, zeta ** (-pos[..., None, None] / 512.0))
    xp = lambda a, p, key: np.asarray(pos_lib.xpos(jnp.asarray(a, jnp.float32), jnp.asarray(p),  # noqa: E731
                                                   key=key), np.float64)  # fmt: skip
    np.testing.assert_allclose(xp(q, pos, False), want_q, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(xp(k, pos, True), want_k, rtol=1e-4, atol=1e-4)
    logits = np.einsum("BTNH,BSNH->BNTS", xp(q, pos, False), xp(k, pos, True))
    shifted = np.einsum("BTNH,BSNH->BNTS", xp(q, pos + 50, False), xp(k, pos + 50, True))
    np.testing.assert_allclose(shifted, logits, rtol=1e-3, atol=1e-3)


def test_every_scheme_is_a_config_variant_that_checks():
    """`jattn train --config configs/reverse_digits.py:NAME` for every registered name."""
    from jattn.train.config import ConfigError, check_config, load_config  # noqa: PLC0415

    spec = str(pathlib.Path(__file__).parents[1] / "configs" / "reverse_digits.py")
    for name in SCHEMES:
        config = load_config(f"{spec}:{name},beam")
        assert config.model.position == name and config.decode == "beam"
        check_config(config)
    config = load_config(f"{spec}:rope")
    config.model.random_positions = 32  # below the 64-token rows
    with pytest.raises(ConfigError, match="random_positions=32 must be >= max_len=64"):
        check_config(config)
    # A decoder-only example is one segment of inputs and targets, and with
    # random_positions_eval evaluation and decoding draw too.
    config.model.random_positions = 100
    check_config(config)
    config.model.architecture = "decoder_only"
    too_short = "random_positions=100 must be >= max_input_len \\+ max_len=128"
    with pytest.raises(ConfigError, match=too_short):
        check_config(config)
    config.model.random_positions = 128
    check_config(config)
    config.eval_max_len = 100
    config.model.random_positions_eval = True
    with pytest.raises(ConfigError, match="eval_max_input_len \\+ eval_max_len=132"):
        check_config(config)


@pytest.mark.parametrize("name, side", [("stick_breaking", 128), ("cope", 32)])
def test_a_form_runs_materialised_up_to_its_size_and_the_scan_above(name, side):
    """The default (`attention_impl=None`) runs the materialised form up to T·S =
    the scheme's `materialised_up_to` (where it is the faster on a CPU:
    docs/benchmarks.md, "CoPE's lookup"), the reverse scan above; "xla" and
    "chunked" run theirs at any size."""
    scheme = SCHEMES[name]
    assert scheme.materialised_up_to == side * side
    ran = []
    forms = [lambda *a, **k: ran.append("scan"), lambda *a, **k: ran.append("materialised")]
    for impl, want in [(None, ["materialised", "scan"]), ("xla", ["materialised"] * 2),
                       ("chunked", ["scan"] * 2)]:  # fmt: skip
        cfg = TransformerConfig(
            vocab_size=11, d_model=8, num_heads=2, num_layers=1, d_ff=8,
            position=name, attention_impl=impl,
        )  # fmt: skip
        attend, ran[:] = scheme.form(cfg, *forms), []
        for keys in (side, side + 1):
            attend(jnp.zeros((1, side, 2, 4)), jnp.zeros((1, keys, 2, 4)), None)
        assert ran == want, (impl, ran)
