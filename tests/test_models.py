"""Tests of jattn.models: config checks, parameter counts, shapes, packing,
shift-right, GQA/MQA, logical axis names, attention capture, attention
dropout, the attention layer's explicit modes. The contracts every positional
scheme must meet (cached = full, packed = unpacked, shift invariance, ...)
are built from the registry in tests/test_schemes.py.

Every scheme uses one tiny config; its params and jitted functions are built
once per module (the `zoo` fixture) so each scheme compiles a forward pass and
an encoder pass only once.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from model_params import fill_params as _fill

from jattn.models import (
    SCHEMES as REGISTRY,
)
from jattn.models import (
    Transformer,
    TransformerConfig,
    abstract_params,
    count_params,
    param_counts,
    positions_from_segments,
    shift_right,
    summary,
)

SCHEMES = list(REGISTRY)
# Ontañón et al.'s variants: Shaw's terms (rel-e, rel-b, rel-eb) and relative
# positions in decoder-to-encoder attention too ("rel2").
VARIANTS = {
    "shaw[key]": dict(position="shaw", position_options={"shaw": {"terms": "key"}}),
    "shaw[bias]": dict(position="shaw", position_options={"shaw": {"terms": "bias"}}),
    "shaw[key+bias]": dict(position="shaw", position_options={"shaw": {"terms": "key+bias"}}),
    "rel2 shaw[key+bias]": dict(
        position="shaw", position_options={"shaw": {"terms": "key+bias"}}, relative_cross=True
    ),
    "rel2 rope": dict(position="rope", relative_cross=True),
    "rel2 alibi": dict(position="alibi", relative_cross=True),
    "rel2 t5": dict(position="t5", relative_cross=True),
}
TINY = dict(
    vocab_size=13,
    d_model=16,
    num_heads=4,
    num_kv_heads=2,  # GQA everywhere in the sweep
    num_layers=1,
    d_ff=32,
    dropout_rate=0.1,
    max_len=32,
    position_options={
        "shaw": {"max_distance": 3},  # < L, so Shaw's clipping is exercised
        "t5": {"num_buckets": 8, "max_distance": 16},
    },
    attention_impl="xla",
)
L = 8
AXIS_NAMES = {"batch", "length", "embed", "heads", "kv", "mlp", "vocab", None}


def tiny(position: str, **overrides) -> TransformerConfig:
    """`TINY` with `position` and `overrides` (position options merged into TINY's)."""
    return TransformerConfig(**TINY).replace(position=position, **overrides)


# Smaller weights than the default (0.3) and the tests' length.
fill_params = functools.partial(_fill, scale=0.3, length=L)


@dataclasses.dataclass
class Built:
    model: Transformer
    params: dict
    run: callable  # (params, inputs, targets, iseg, tseg, ipos, tpos) -> (logits, encoded)

    def fwd(self, params, *batch):
        return self.run(params, *batch)[0]

    def enc(self, params, inputs, iseg, ipos):
        """Encoder outputs through the same compiled function (dummy targets)."""
        ones = np.ones_like(inputs)
        return self.run(params, inputs, ones, iseg, ones, ipos, ipos)[1]


def build(config: TransformerConfig, seed: int = 0) -> Built:
    model = Transformer(config)

    def both(module, inputs, targets, iseg, tseg, ipos, tpos):
        encoded = module.encode(inputs, inputs_segment_ids=iseg, inputs_positions=ipos)
        logits = module.decode(
            encoded,
            inputs,
            targets,
            inputs_segment_ids=iseg,
            inputs_positions=ipos,
            targets_segment_ids=tseg,
            targets_positions=tpos,
        )
        return logits, encoded

    @jax.jit
    def run(params, *batch):
        return nn.apply(both, model)({"params": params}, *batch)

    return Built(model, fill_params(config, seed), run)


class Zoo(dict):
    """One Built per scheme, made on first use."""

    def __missing__(self, position):
        config = (
            TransformerConfig(**{**TINY, **VARIANTS[position]})
            if " " in position or ("[" in position)
            else tiny(position)
        )
        self[position] = build(config)
        return self[position]


@pytest.fixture(scope="module")
def zoo() -> Zoo:
    return Zoo()


def unpacked(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids (tokens != 0) and arange positions of unpacked rows."""
    seg = (tokens != 0).astype(np.int32)
    pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    return seg, pos


# -- config --------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(position="absolute"), "position='absolute' is not a positional scheme"),
        (dict(num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
        (dict(d_model=18), "d_model=18 must be divisible by num_heads=4"),
        (dict(num_heads=0), "num_heads must be a positive int"),
        (dict(dropout_rate=1.0), "dropout_rate must be in"),
        (dict(attention_dropout_rate=-0.1), "attention_dropout_rate must be in"),
        (dict(attention_impl="cuda"), "attention_impl='cuda'"),
        (dict(position_options={"shaw": {"max_distance": 0}}), "shaw: max_distance must be"),
        (dict(position_options={"t5": {"num_buckets": 7}}), "t5: num_buckets must be even"),
        (dict(dtype="int32"), "dtype must be floating"),
        (dict(param_dtype="float99"), "param_dtype='float99' is not a dtype"),
        (dict(vocab_size=1), "vocab_size must be >= 2"),
        (dict(num_layers=2.0), "num_layers must be a positive int"),
        (dict(position_options={"fire": {"hidden": 0}}), "fire: hidden must be a positive int"),
        (dict(position_options={"alibi": {"mode": "left"}}), "alibi: mode='left'; choose"),
        (dict(position_options={"rope": {"scaling": "linear"}}), "rope: scaling='linear'"),
        (dict(position_options={"rope": {"scaling_factor": 0.5}}), "scaling_factor must be >="),
        (dict(position_options={"rope": {"yarn": {"convention": "meta"}}}), "rope.yarn: "),
        (dict(position_options={"rope": {"base": 1}}), r"rope: unknown options \['base'\]"),
        (dict(position_options={"nope": {}}), r"unknown keys \['nope'\]"),
        (dict(random_positions=-1), "random_positions must be an int >= 0"),
        (dict(position="rope", d_model=4), "rope needs head_dim >= 2"),
    ],
)
def test_bad_config_values_fail_clearly(overrides, match):
    if "\\" not in match:
        match = match.replace("(", r"\(").replace("[", r"\[")
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{**TINY, **overrides})


def test_config_defaults_and_dict_round_trip():
    cfg = tiny("rope", num_kv_heads=None)
    assert cfg.num_kv_heads == cfg.num_heads == 4  # None means MHA
    cd = ml_collections.ConfigDict(cfg.to_dict())
    assert TransformerConfig.from_dict(cd) == cfg
    assert TransformerConfig(**cd.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown keys \['heads'\]"):
        TransformerConfig.from_dict({**TINY, "heads": 3})
    hash(cfg)  # usable as a static jit argument


def test_base_and_big_are_the_papers_models():
    base = TransformerConfig.base(37_000)
    assert (base.d_model, base.num_heads, base.num_layers, base.d_ff) == (512, 8, 6, 2048)
    assert base.dropout_rate == 0.1 and base.share_embeddings and base.scale_embeddings
    assert not base.pre_norm and base.position == "sinusoidal"
    big = TransformerConfig.big(37_000)
    assert (big.d_model, big.num_heads, big.num_layers, big.d_ff, big.dropout_rate) == (
        1024,
        16,
        6,
        4096,
        0.3,
    )


def test_base_parameter_count_about_63m():
    params = abstract_params(TransformerConfig.base(37_000))  # jax.eval_shape: nothing allocated
    n = count_params(params)
    print(f"\nbase Transformer, shared 37k vocabulary: {n:,} parameters (paper: 65M)")
    print(summary(params, max_depth=1))
    # Hand count: embeddings 37000*512; encoder layer 4*512^2 (attention, no
    # biases) + 2*512*2048 + 2048 + 512 (MLP) + 2*1024 (norms); decoder layer
    # adds cross-attention and a third norm.
    enc_layer = 4 * 512**2 + 2 * 512 * 2048 + 2048 + 512 + 2 * 1024
    dec_layer = 8 * 512**2 + 2 * 512 * 2048 + 2048 + 512 + 3 * 1024
    assert n == 37_000 * 512 + 6 * enc_layer + 6 * dec_layer == 63_045_632
    counts = param_counts(params, max_depth=2)
    assert counts["total"] == n
    assert counts["embed"] == 37_000 * 512
    assert counts["encoder/layer_0"] == enc_layer and counts["decoder/layer_5"] == dec_layer
    big = count_params(abstract_params(TransformerConfig.big(37_000)))
    print(f"big Transformer: {big:,} parameters (paper: 213M)")
    assert 205e6 < big < 220e6


def test_summary_table_lists_modules_and_total():
    text = summary(tiny("t5"), max_depth=2)
    lines = text.splitlines()
    assert lines[-1].split()[:2] == ["total", f"{count_params(abstract_params(tiny('t5'))):,}"]
    for name in ("encoder", "decoder", "embed", "t5_bias", "layer_0"):
        assert any(line.strip().startswith(name) for line in lines), name


# -- parameters and shapes -----------------------------------------------------


@pytest.mark.parametrize("position", SCHEMES)
def test_shapes_and_scheme_parameters(zoo, position):
    b = zoo[position]
    rng = np.random.default_rng(0)
    inputs = rng.integers(2, 13, (3, L)).astype(np.int32)
    inputs[0, 5:] = 0
    targets = rng.integers(2, 13, (3, L)).astype(np.int32)
    targets[1, 3:] = 0
    iseg, ipos = unpacked(inputs)
    tseg, tpos = unpacked(targets)
    logits = b.fwd(b.params, inputs, targets, iseg, tseg, ipos, tpos)
    assert logits.shape == (3, L, 13) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    assert b.enc(b.params, inputs, iseg, ipos).shape == (3, L, 16)

    flat = {"/".join(map(str, k)): v for k, v in _flatten(b.params)}
    enc_attn = "encoder/layer_0/self_attention"
    cross = "decoder/layer_0/cross_attention"
    assert flat[f"{enc_attn}/q"].shape == (16, 4, 4)
    assert flat[f"{enc_attn}/k"].shape == (16, 2, 4)  # [D, K, H], GQA
    has_shaw = "shaw" in position
    assert (f"{enc_attn}/rel_key" in flat) == has_shaw
    assert (f"decoder/layer_0/self_attention/rel_value" in flat) == has_shaw  # noqa: F541
    assert not any(k.startswith(cross + "/rel") for k in flat)  # cross-attention: none
    if has_shaw:
        assert flat[f"{enc_attn}/rel_key"].shape == (7, 4)  # [2k+1, H], shared by heads
    assert ("encoder/positions/table" in flat) == (position == "learned")
    assert ("encoder/t5_bias/table" in flat) == (position == "t5")
    if position == "t5":
        assert flat["decoder/t5_bias/table"].shape == (8, 4)  # one per stack


def _flatten(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def test_real_init_matches_structure():
    """`model.init` (compiled once here) gives the abstract tree, finite values,
    the documented initial statistics, and boxes with logical names."""
    cfg = tiny("learned")
    x = jnp.ones((1, L), jnp.int32)
    # An rbg key: threefry's per-parameter hashing alone takes ~10 s to compile here.
    key = jax.random.key(0, impl="rbg")
    boxed = jax.jit(Transformer(cfg).init)(key, x, x)["params"]
    params = nn.unbox(boxed)
    abstract = abstract_params(cfg, length=L)
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(abstract), strict=True):
        assert p.shape == a.shape and p.dtype == a.dtype and np.isfinite(np.asarray(p)).all()
    emb = np.asarray(params["embed"]["embedding"])
    assert abs(emb.std() - 16**-0.5) < 0.05  # scaled by sqrt(D) on the way in: unit variance
    norm = params["decoder"]["layer_0"]["mlp_norm"]
    np.testing.assert_array_equal(norm["scale"], 1.0)
    np.testing.assert_array_equal(norm["bias"], 0.0)
    assert isinstance(boxed["encoder"]["positions"]["table"], nn.LogicallyPartitioned)


def test_call_with_defaults_derives_segments_and_positions(zoo):
    """`__call__` without segment ids: padding comes from tokens != 0 and is never read."""
    b = zoo["t5"]
    inputs = np.array([[5, 6, 7, 0, 0, 0, 0, 0]] * 3, np.int32)  # 3 rows, like every call
    targets = np.array([[8, 9, 1, 0, 0, 0, 0, 0]] * 3, np.int32)
    iseg, ipos = unpacked(inputs)
    tseg, tpos = unpacked(targets)

    @jax.jit
    def call(params, inputs, targets):
        v = {"params": params}
        explicit = b.model.apply(
            v,
            inputs,
            targets,
            inputs_segment_ids=iseg,
            targets_segment_ids=tseg,
            inputs_positions=ipos,
            targets_positions=tpos,
        )
        return b.model.apply(v, inputs, targets), explicit

    default, explicit = call(b.params, inputs, targets)
    np.testing.assert_allclose(default, explicit, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        explicit, b.fwd(b.params, inputs, targets, iseg, tseg, ipos, tpos), rtol=1e-6, atol=1e-6
    )
    # Padding (segment 0) tokens, whatever their ids, never reach real tokens.
    noisy_inputs = np.where(iseg == 0, 11, inputs).astype(np.int32)
    noisy_targets = np.where(tseg == 0, 12, targets).astype(np.int32)
    noisy = b.fwd(b.params, noisy_inputs, noisy_targets, iseg, tseg, ipos, tpos)
    np.testing.assert_allclose(noisy[:, :3], explicit[:, :3], rtol=1e-6, atol=1e-6)
    assert not np.allclose(noisy[:, 3:], explicit[:, 3:])  # the padded rows did change


def test_mismatched_inputs_fail_clearly(zoo):
    b = zoo["none"]
    x = jnp.ones((2, L), jnp.int32)

    def shape_of(*args, **kwargs):
        return jax.eval_shape(lambda: b.model.apply({"params": b.params}, *args, **kwargs))

    with pytest.raises(ValueError, match="both inputs_segment_ids and targets_segment_ids"):
        shape_of(x, x, inputs_segment_ids=x)
    with pytest.raises(ValueError, match=r"targets_positions must have shape \[2, 8\]"):
        shape_of(x, x, targets_positions=jnp.ones((2, 7), jnp.int32))
    with pytest.raises(ValueError, match="inputs must be integer token ids"):
        shape_of(x.astype(jnp.float32), x)
    with pytest.raises(TypeError, match="config must be a TransformerConfig"):
        jax.eval_shape(lambda: Transformer(dict(TINY)).init(jax.random.key(0), x, x))
    long = jnp.ones((1, 33), jnp.int32)
    with pytest.raises(ValueError, match="exceeds max_len=32"):
        jax.eval_shape(lambda: Transformer(tiny("learned")).init(jax.random.key(0), long, long))


# -- packing and shift-right ---------------------------------------------------


def test_shift_right_restarts_at_each_segment():
    targets = jnp.array([[5, 6, 1, 7, 8, 9, 1, 0]])
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    np.testing.assert_array_equal(shift_right(targets, seg), [[0, 5, 6, 0, 7, 8, 9, 0]])
    # Unpacked: an ordinary shift, padding stays padding.
    np.testing.assert_array_equal(
        shift_right(targets[:, :3], (targets[:, :3] != 0).astype(jnp.int32)), [[0, 5, 6]]
    )
    np.testing.assert_array_equal(positions_from_segments(seg), [[0, 1, 2, 0, 1, 2, 3, 0]])


def _packed_batch():
    """Row 0 packs (A, A') and (B, B'); row 1 holds A alone, row 2 B alone."""
    a, a_t = [3, 4, 5], [6, 7, 8, 1]
    bb, b_t = [9, 10, 11, 12], [2, 5, 1]
    inputs = np.zeros((3, L), np.int32)
    targets = np.zeros((3, L), np.int32)
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


def test_packed_neighbour_cannot_influence(zoo):
    """Changing sequence A (source and target) changes nothing in packed neighbour B."""
    b = zoo["sinusoidal+shaw"]
    inputs, targets, iseg, tseg, ipos, tpos = _packed_batch()
    base = np.asarray(b.fwd(b.params, inputs, targets, iseg, tseg, ipos, tpos))
    inputs2, targets2 = inputs.copy(), targets.copy()
    inputs2[0, :3] = [12, 12, 12]
    targets2[0, 3] = 9  # A's last target token: B's first decoder input must stay 0
    other = np.asarray(b.fwd(b.params, inputs2, targets2, iseg, tseg, ipos, tpos))
    np.testing.assert_allclose(other[0, 4:7], base[0, 4:7], rtol=1e-6, atol=1e-6)
    assert not np.allclose(other[0, :4], base[0, :4])


# -- positional schemes (their registry-wide contracts: tests/test_schemes.py) ------


@pytest.mark.parametrize("position", ["shaw", "shaw[bias]"])
def test_relative_scheme_sees_order(zoo, position):
    """Shift invariance is not blindness: swapping two tokens changes a relative model."""
    b = zoo[position]
    inputs = np.array([[3, 4, 5, 6, 7, 8, 9, 10]] * 3, np.int32)
    seg, pos = unpacked(inputs)
    out = np.asarray(b.enc(b.params, inputs, seg, pos))
    swapped = inputs[:, [1, 0, 2, 3, 4, 5, 6, 7]]
    out_sw = np.asarray(b.enc(b.params, swapped, seg, pos))
    assert np.abs(out_sw[:, [1, 0]] - out[:, [0, 1]]).max() > 1e-3


# -- GQA / MQA -----------------------------------------------------------------


def _repeat_kv(params, groups: int):
    """MHA params equivalent to GQA ones: each kv head repeated for its query group."""

    def fix(path, x):
        name = path[-1].key
        return jnp.repeat(x, groups, axis=1) if name in ("k", "v") else x

    return jax.tree_util.tree_map_with_path(fix, params)


def test_gqa_and_mqa_equal_mha_with_repeated_kv_heads(zoo):
    gqa = zoo["rope"]  # num_kv_heads=2 of 4
    mha = build(tiny("rope", num_kv_heads=4))
    mqa = build(tiny("rope", num_kv_heads=1), seed=3)
    batch = _packed_batch()
    for small, groups in ((gqa, 2), (mqa, 4)):
        k = small.params["decoder"]["layer_0"]["self_attention"]["k"]
        assert k.shape == (16, 4 // groups, 4)
        want = small.fwd(small.params, *batch)
        got = mha.fwd(_repeat_kv(small.params, groups), *batch)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# -- variants, axis names, dropout, attention capture ------------------------------


def test_pre_norm_and_separate_embeddings_structure():
    pre = abstract_params(tiny("alibi", pre_norm=True))
    assert "final_norm" in pre["encoder"] and "final_norm" in pre["decoder"]
    post = abstract_params(tiny("alibi"))
    assert "final_norm" not in post["encoder"]
    sep = abstract_params(tiny("alibi", share_embeddings=False))
    assert {"source_embed", "target_embed"} <= set(sep) and "embed" not in sep
    assert sep["decoder"]["logits"]["kernel"].shape == (16, 13)
    per_layer = abstract_params(tiny("t5", position_options={"t5": {"per_layer": True}}))
    assert "t5_bias" not in per_layer["encoder"]
    assert per_layer["encoder"]["layer_0"]["self_attention"]["t5_bias"]["table"].shape == (8, 4)


def test_bfloat16_compute_keeps_float32_params_and_logits():
    cfg = tiny("rope", dtype="bfloat16")
    model = Transformer(cfg)
    x = jnp.ones((2, L), jnp.int32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), x, x))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nn.unbox(variables)))
    out = jax.eval_shape(lambda v: model.apply(v, x, x), variables)
    assert out.dtype == jnp.float32 and out.shape == (2, L, 13)


@pytest.mark.parametrize("position", ["learned", "shaw", "t5"])
def test_every_parameter_has_logical_axis_names(position):
    cfg = tiny(position, attention_bias=True, share_embeddings=False)
    x = jnp.ones((1, L), jnp.int32)
    boxed = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), x, x))["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned))
    assert leaves and all(isinstance(v, nn.LogicallyPartitioned) for v in leaves)
    for v in leaves:
        assert len(v.names) == len(v.value.shape) and set(v.names) <= AXIS_NAMES, v.names
    specs = nn.get_partition_spec(boxed)
    enc = specs["encoder"]["layer_0"]
    assert tuple(enc["self_attention"]["q"]) == ("embed", "heads", "kv")
    assert tuple(enc["mlp"]["wi"]) == ("embed", "mlp")
    assert tuple(specs["source_embed"]["embedding"]) == ("vocab", "embed")
    # Rules map names to mesh axes, as a training loop would.
    rules = (("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"))
    mesh_spec = nn.logical_to_mesh(specs, rules)
    assert tuple(mesh_spec["encoder"]["layer_0"]["self_attention"]["o"]) == (
        "tensor",
        None,
        "fsdp",
    )


def test_logical_names_become_sharding_constraints(zoo):
    """Under a mesh and rules, activations are constrained to the mapped mesh axes."""
    b = zoo["shaw"]
    mesh = jax.sharding.Mesh(
        np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor")
    )
    rules = (("batch", "data"), ("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"),
             ("vocab", "tensor"), ("length", None), ("kv", None))  # fmt: skip
    batch = _packed_batch()
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        text = b.run.lower(b.params, *batch).as_text()
    constraints = [line for line in text.splitlines() if "sharding_constraint" in line]
    shapes = {line.rsplit("tensor<", 1)[-1] for line in constraints}
    assert {"3x8x16xf32>", "3x8x4x4xf32>", "3x8x32xf32>", "3x8x13xf32>"} <= shapes, shapes
    for line in constraints:
        assert '"data"' in line  # the batch axis, everywhere
    plain = b.run.lower(b.params, *batch).as_text()
    assert "sharding_constraint" not in plain  # no mesh: constraints are no-ops


def test_dropout_only_in_training(zoo):
    b = zoo["learned"]
    x = np.array([[3, 4, 5, 6, 0, 0, 0, 0]] * 3, np.int32)
    apply = jax.jit(
        lambda p, r: b.model.apply({"params": p}, x, x, train=True, rngs={"dropout": r})
    )
    key = lambda i: jax.random.key(i, impl="rbg")  # cheap to compile on the CPU
    one, two = apply(b.params, key(1)), apply(b.params, key(2))
    assert np.abs(np.asarray(one) - np.asarray(two)).max() > 1e-3
    seg, pos = unpacked(x)
    evaluation = np.asarray(b.fwd(b.params, x, x, seg, seg, pos, pos))
    assert np.abs(np.asarray(one) - evaluation).max() > 1e-3
    assert np.isfinite(np.asarray(one)).all()


def test_capture_attention_sows_weights_only_when_asked(zoo):
    b = zoo["alibi"]
    x = np.array([[3, 4, 5, 6, 7, 0, 0, 0]] * 3, np.int32)
    y = np.array([[8, 9, 1, 0, 0, 0, 0, 0]] * 3, np.int32)
    probe = Transformer(tiny("alibi", capture_attention=True))

    @jax.jit
    def run(params):
        v = {"params": params}
        _, plain = b.model.apply(v, x, y, mutable=["intermediates"])
        return plain, probe.apply(v, x, y, mutable=["intermediates"])

    plain, (logits, state) = run(b.params)
    assert not jax.tree.leaves(plain)  # nothing sown without the flag
    xs, xp = unpacked(x)
    ys, yp = unpacked(y)
    np.testing.assert_allclose(logits, b.fwd(b.params, x, y, xs, ys, xp, yp), atol=1e-5)
    inter = state["intermediates"]
    (enc_w,) = inter["encoder"]["layer_0"]["self_attention"]["attention_weights"]
    (dec_w,) = inter["decoder"]["layer_0"]["self_attention"]["attention_weights"]
    (cross_w,) = inter["decoder"]["layer_0"]["cross_attention"]["attention_weights"]
    assert enc_w.shape == dec_w.shape == cross_w.shape == (3, 4, L, L)
    assert np.all(np.asarray(enc_w)[:, :, :5, 5:] == 0)  # real tokens never read padding
    assert np.all(np.triu(np.asarray(dec_w)[0, :, :3, :3], k=1) == 0)  # causal
    np.testing.assert_allclose(np.asarray(cross_w)[0, :, :3, :5].sum(-1), 1.0, rtol=1e-5)


def test_attention_dropout_only_in_training(zoo):
    """`attention_dropout_rate` drops attention weights in training only, and
    adds no parameter."""
    b = zoo["shaw"]
    base = b.model.config
    cfg = dataclasses.replace(base, dropout_rate=0.0, attention_dropout_rate=0.3)
    assert jax.tree.map(jnp.shape, abstract_params(cfg, length=L)) == jax.tree.map(
        jnp.shape, b.params
    )
    x = np.array([[3, 4, 5, 6, 7, 0, 0, 0]] * 2, np.int32)
    y = np.array([[8, 9, 10, 1, 0, 0, 0, 0]] * 2, np.int32)

    @jax.jit
    def run(params, r1, r2):
        v, dropped, plain = (
            {"params": params},
            Transformer(cfg),
            Transformer(cfg.replace(attention_dropout_rate=0.0)),
        )
        train = lambda m, r: m.apply(v, x, y, train=True, rngs={"dropout": r})  # noqa: E731
        return (
            train(dropped, r1),
            train(dropped, r2),
            train(plain, r1),
            dropped.apply(v, x, y),
            plain.apply(v, x, y),
        )

    key = lambda i: jax.random.key(i, impl="rbg")  # noqa: E731
    one, two, no_attention_dropout, evaluation, reference = map(
        np.asarray, run(b.params, key(1), key(2))
    )
    assert np.abs(one - two).max() > 1e-3  # the rng decides which weights drop
    assert np.abs(one - evaluation).max() > 1e-3
    np.testing.assert_array_equal(evaluation, reference)  # eval: the rate plays no part
    np.testing.assert_array_equal(no_attention_dropout, reference)  # rate 0: nothing drops
    assert np.isfinite(one).all()


def test_attention_modes_fail_clearly():
    """Attention's modes are explicit; a mode the layer does not have fails."""
    from jattn.models.layer_call import LayerCall
    from jattn.models.layers import Attention

    cfg = tiny("none")
    x = jnp.ones((1, 3, 16))

    def call(layer, *args, **kwargs):
        how = LayerCall(**kwargs)
        return jax.eval_shape(lambda: layer.init(jax.random.key(0), *args, call=how))

    with pytest.raises(ValueError, match="mode must be one of"):
        call(Attention(cfg), x, x, mode="cached")
    with pytest.raises(ValueError, match="mode='step' needs decode=True"):
        call(Attention(cfg, causal=True), x, x, mode="step", cache_index=0)
    with pytest.raises(ValueError, match="mode='prefill' is for cross-attention"):
        call(Attention(cfg, causal=True, decode=True), None, x, mode="prefill")
    with pytest.raises(ValueError, match="decode=True is for causal self- or cross-attention"):
        call(Attention(cfg, decode=True), x, x)
    with pytest.raises(ValueError, match="kv must be None"):
        call(Attention(cfg, cross=True, decode=True), x, x, mode="step")
    with pytest.raises(ValueError, match="no cache to read"):
        call(Attention(cfg, cross=True, decode=True), x, None, mode="step")
    with pytest.raises(ValueError, match="cache_index is required"):
        call(Attention(cfg, causal=True, decode=True), x, x, mode="step")


def test_parameter_names_are_the_checkpoint_layout():
    """The attention parameters keep their names (old checkpoints load), and a
    decode-mode model has the same parameters as the training model."""
    cfg = tiny("shaw", attention_bias=True, num_layers=1)
    params = abstract_params(cfg, length=L)
    names = {"q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias"}
    assert set(params["encoder"]["layer_0"]["self_attention"]) == names | {"rel_key", "rel_value"}
    assert set(params["decoder"]["layer_0"]["self_attention"]) == names | {"rel_key", "rel_value"}
    assert set(params["decoder"]["layer_0"]["cross_attention"]) == names
    x = jnp.ones((1, L), jnp.int32)
    cached = jax.eval_shape(lambda: Transformer(cfg, use_cache=True).init(jax.random.key(0), x, x))
    assert jax.tree.map(jnp.shape, nn.unbox(cached["params"])) == jax.tree.map(jnp.shape, params)


# -- Shaw's terms and relative cross-attention (Ontañón et al.) -------------------------


@pytest.mark.parametrize(
    "terms, cross", [("key", False), ("bias", False), ("key+bias", True), ("key+value", True)]
)
def test_shaw_terms_and_relative_cross_own_their_tables(terms, cross):
    cfg = tiny("shaw", position_options={"shaw": {"terms": terms}}, relative_cross=cross)
    flat = {"/".join(map(str, k)): v for k, v in _flatten(abstract_params(cfg))}
    layers = ["encoder/layer_0/self_attention", "decoder/layer_0/self_attention"]
    cross_layer = "decoder/layer_0/cross_attention"
    for layer in layers + [cross_layer]:
        has = layer != cross_layer or cross
        for term, shape in (("key", (7, 4)), ("value", (7, 4)), ("bias", (4, 7))):
            name = f"{layer}/rel_{term}"
            assert (name in flat) == (has and term in terms.split("+")), name
            if name in flat:
                assert flat[name].shape == shape  # [2k+1, H] shared by heads; bias [N, 2k+1]


def test_relative_cross_t5_has_a_bidirectional_table_per_cross_layer():
    flat = {"/".join(map(str, k)): v for k, v in _flatten(abstract_params(tiny("t5")))}
    assert not any("cross_attention/t5_bias" in k for k in flat)
    flat = {
        "/".join(map(str, k)): v
        for k, v in _flatten(abstract_params(tiny("t5", relative_cross=True)))
    }
    assert flat["decoder/layer_0/cross_attention/t5_bias/table"].shape == (8, 4)


def test_relative_cross_makes_decoder_see_source_positions(zoo):
    """With rel2, moving the decoder's positions against the encoder's changes
    the output (cross-attention sees t - s); without it, the decoder's
    relative self-attention is blind to that move."""
    inputs, targets, iseg, tseg, ipos, tpos = _packed_batch()
    for name, sees in (("shaw[key+bias]", False), ("rel2 shaw[key+bias]", True)):
        b = zoo[name]
        full = np.asarray(b.fwd(b.params, inputs, targets, iseg, tseg, ipos, tpos))
        moved = np.asarray(b.fwd(b.params, inputs, targets, iseg, tseg, ipos, tpos + 3))
        if sees:
            assert np.abs(moved - full).max() > 1e-3, name
        else:
            np.testing.assert_allclose(moved, full, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(position_options={"shaw": {"terms": "key+key"}}), "shaw: terms="),
        (dict(position_options={"shaw": {"terms": "keys"}}), "shaw: terms="),
        (dict(position_options={"shaw": {"terms": ""}}), "shaw: terms="),
        (dict(position="sinusoidal", relative_cross=True), "relative_cross"),
    ],
)
def test_shaw_terms_and_relative_cross_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny(bad.pop("position", "shaw"), **bad)


def test_legacy_shaw_values_key_is_read():
    base = tiny("shaw").to_dict()
    del base["position_options"]
    for saved, terms in ((False, "key"), (True, "key+value")):
        with pytest.warns(DeprecationWarning, match="shaw_values as position_options.shaw.terms"):
            cfg = TransformerConfig.from_dict({**base, "shaw_values": saved})
        assert cfg.position_options["shaw"].terms == terms


def test_a_model_config_saved_with_the_flat_scheme_fields_is_read_in_the_new_spelling():
    # model_config.json of a run saved before the schemes carried their options:
    # every old flat field is read where it now lives (RoPE's base also xPos's).
    from jattn.models.config import RENAMED  # noqa: PLC0415

    values = {
        "max_relative_distance": 5, "shaw_terms": "key+bias", "rope_max_timescale": 500.0,
        "rope_scaling": "yarn", "rope_scaling_factor": 2.0, "rope_original_length": 24,
        "rope_yarn_convention": "hf", "rope_yarn_beta_fast": 16.0, "rope_yarn_beta_slow": 2.0,
        "rope_yarn_mscale": 1.0, "rope_yarn_mscale_all_dim": 0.5, "t5_num_buckets": 12,
        "t5_max_distance": 40, "t5_per_layer": True, "xpos_scale_base": 256.0,
        "alibi_mode": "offset", "fire_hidden": 6, "xl_max_distance": 9,
    }  # fmt: skip
    assert set(values) == set(RENAMED)  # every renamed field is exercised
    base = tiny("rope").to_dict()
    del base["position_options"]
    with pytest.warns(DeprecationWarning, match="rope_scaling as position_options.rope.scaling"):
        cfg = TransformerConfig.from_dict({**base, **values})
    want = {
        "shaw": {"max_distance": 5, "terms": "key+bias"},
        "rope": {"max_timescale": 500.0, "scaling": "yarn", "scaling_factor": 2.0,
                 "original_length": 24, "yarn": {"convention": "hf", "beta_fast": 16.0,
                 "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5}},
        "t5": {"num_buckets": 12, "max_distance": 40, "per_layer": True},
        "xpos": {"max_timescale": 500.0, "scale_base": 256.0},
        "alibi": {"mode": "offset"},
        "fire": {"hidden": 6},
        "transformer_xl": {"max_distance": 9},
    }  # fmt: skip
    # Schemes registered after the rename (no flat fields) keep their defaults.
    defaults = tiny("rope").position_options.to_dict()
    assert cfg.position_options.to_dict() == {**defaults, **want}
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg  # today's spelling round-trips


def test_position_options_merge_on_replace_and_keep_the_config_hashable():
    cfg = tiny("rope", position_options={"rope": {"scaling": "yarn"}})
    again = cfg.replace(position_options={"rope": {"yarn": {"convention": "hf"}}})
    assert again.position_options["rope"].scaling == "yarn"  # kept
    assert again.position_options["rope"].yarn.convention == "hf"
    assert again.position_options["t5"].num_buckets == 8  # TINY's, untouched
    assert hash(cfg) != hash(again) and cfg != again
    assert hash(cfg.replace()) == hash(cfg) and cfg.replace() == cfg
