"""Tests of jattn.decoding: the KV cache against full recomputation for every
positional scheme, greedy against a naive recomputing loop, beam search
against exhaustive enumeration, and both searches on a model trained to copy.
"""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from jattn import decoding
from jattn.models import POSITIONS, Transformer, TransformerConfig, abstract_params, shift_right

SCHEMES = list(POSITIONS)
TINY = dict(
    vocab_size=11,
    d_model=16,
    num_heads=4,
    num_kv_heads=2,
    num_layers=1,
    d_ff=32,
    dropout_rate=0.1,
    max_len=16,
    max_relative_distance=2,  # < L, so Shaw's clipping is exercised while decoding
    t5_num_buckets=8,
    t5_max_distance=16,
    attention_impl="xla",
)
B, S, L = 3, 5, 6


def fill_params(config: TransformerConfig, seed: int) -> dict:
    """Generic random parameters drawn on the host (compiling `init` per scheme
    costs seconds; tests/test_models.py checks the real initialiser)."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        x = rng.normal(size=leaf.shape)
        if path[-1].key == "scale":
            return jnp.asarray(1.0 + 0.1 * x, leaf.dtype)
        return jnp.asarray(0.5 * x, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(config))


def full_logits(model, params, inputs, targets):
    """Teacher-forced logits of the ordinary forward pass; every target slot is
    a real token (segment 1), so 0 may appear as a token."""
    return model.apply(
        {"params": params},
        inputs,
        targets,
        inputs_segment_ids=(inputs != 0).astype(jnp.int32),
        targets_segment_ids=jnp.ones_like(targets),
    )


class Zoo(dict):
    """Per scheme: (model, params, check), where one compiled `check(params,
    inputs, targets)` returns full logits, cached teacher-forced logits, the
    final cache and the greedy decode, so each scheme compiles once. "t5" has
    two layers per stack (one shared bias table, a cache per layer); a few
    schemes also carry a model variant, covered at no extra compile."""

    VARIANTS = {
        "t5": dict(num_layers=2),
        "alibi": dict(pre_norm=True),
        "sinusoidal": dict(share_embeddings=False),
        "rope": dict(num_kv_heads=1),  # MQA
        "shaw": dict(shaw_values=False, attention_bias=True),
    }

    def __missing__(self, position):
        cfg = TransformerConfig(**{**TINY, "position": position, **self.VARIANTS.get(position, {})})
        model = Transformer(cfg)

        @jax.jit
        def check(params, inputs, targets):
            full = full_logits(model, params, inputs, targets)  # [B, L, V]
            encoded = model.apply({"params": params}, inputs, method="encode")
            prev = shift_right(targets, jnp.ones_like(targets))  # [B, L]

            def step(cache, tok):  # tok [B]
                logits, cache = decoding.decode_step(
                    model, params, cache, encoded, inputs, tok[:, None]
                )
                return cache, logits

            cache = decoding.init_cache(model, inputs.shape[0], targets.shape[1])
            cache, cached = lax.scan(step, cache, prev.T)  # [L, B, V]
            greedy = decoding.greedy(model, params, inputs, max_length=targets.shape[1])
            return full, cached.transpose(1, 0, 2), greedy, cache

        self[position] = (model, fill_params(model.config, seed=len(self)), check)
        return self[position]


@pytest.fixture(scope="module")
def zoo() -> Zoo:
    return Zoo()


def _inputs(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.integers(2, 11, (B, S)).astype(np.int32)
    x[1, 3:] = 0  # a padded source row
    return x


@pytest.mark.parametrize("position", SCHEMES)
def test_cached_decoding_equals_full_recomputation(zoo, position):
    model, params, check = zoo[position]
    inputs = _inputs(0)
    targets = np.random.default_rng(1).integers(0, 11, (B, L)).astype(np.int32)
    full, cached, greedy, _ = check(params, inputs, targets)
    full, cached, greedy = np.asarray(full), np.asarray(cached), np.asarray(greedy)
    # Teacher forcing: the cached step t sees the same positions as the full pass.
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=1e-5)

    # Greedy with the cache equals greedy that recomputes everything each step.
    tokens = np.zeros((B, L), np.int32)
    done = np.zeros(B, bool)
    for t in range(L):
        step_logits = np.asarray(check(params, inputs, tokens)[0])[:, t]  # [B, V]
        nxt = np.where(done, 0, step_logits.argmax(-1))
        tokens[:, t] = nxt
        done |= nxt == decoding.EOS
    np.testing.assert_array_equal(greedy, tokens)


def test_cache_holds_every_layer_and_the_index(zoo):
    model, params, check = zoo["t5"]
    empty = decoding.init_cache(model, B, L)
    assert empty["decoder"]["index"].shape == () and int(empty["decoder"]["index"]) == 0
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(empty))
    targets = np.full((B, L), 5, np.int32)
    cache = check(params, _inputs(0), targets)[3]  # after L teacher-forced steps
    dec = cache["decoder"]
    assert int(dec["index"]) == L
    for layer in ("layer_0", "layer_1"):
        attn = dec[layer]["self_attention"]
        assert attn["cached_key"].shape == attn["cached_value"].shape == (B, L, 2, 4)  # [B,L,K,H]
        assert np.all(np.abs(np.asarray(attn["cached_key"])).max(axis=(2, 3)) > 0)  # all written
        assert "cross_attention" not in dec[layer]  # cross-attention keeps no cache
    assert not np.allclose(
        dec["layer_0"]["self_attention"]["cached_key"],
        dec["layer_1"]["self_attention"]["cached_key"],
    )


# -- beam search against exhaustive enumeration ---------------------------------


@pytest.fixture(scope="module")
def micro():
    """A random 4-token model: small enough to enumerate every hypothesis. Its
    EOS embedding is shrunk so EOS is not always the best first token; with
    these weights alpha 0, 0.6 and 3 each pick a different hypothesis."""
    cfg = TransformerConfig(**{**TINY, "vocab_size": 4, "position": "shaw"})
    model = Transformer(cfg)
    params = fill_params(cfg, seed=9)
    emb = params["embed"]["embedding"]
    params["embed"]["embedding"] = emb.at[decoding.EOS].multiply(0.2)
    return model, params, jax.jit(lambda p, x, y: full_logits(model, p, x, y))


def test_wide_beam_finds_the_exhaustive_best(micro):
    model, params, fwd = micro
    n = 3  # max_length
    inputs = np.array([[2, 3, 3, 2, 0], [3, 2, 0, 0, 0]], np.int32)
    # Every finished hypothesis: up to n-1 non-EOS tokens then EOS.
    hyps = [
        list(prefix) + [decoding.EOS]
        for k in range(n)
        for prefix in itertools.product([0, 2, 3], repeat=k)
    ]
    targets = np.array([h + [0] * (n - len(h)) for h in hyps], np.int32)  # [13, n]
    logp = [
        np.asarray(jax.nn.log_softmax(fwd(params, np.repeat(row[None], len(hyps), 0), targets)))
        for row in inputs
    ]  # per row [13, n, V]
    picked = set()
    for alpha in (0.0, 0.6, 3.0):
        best = []
        for lp in logp:
            scores = [
                sum(lp[i, t, tok] for t, tok in enumerate(h)) / ((5 + len(h)) / 6) ** alpha
                for i, h in enumerate(hyps)
            ]
            best.append(targets[int(np.argmax(scores))])
        # 27 beams hold every live prefix, so the search is exact.
        got = decoding.beam_search(model, params, inputs, max_length=n, beam_size=27, alpha=alpha)
        np.testing.assert_array_equal(got, np.stack(best), err_msg=f"alpha={alpha}")
        picked.add(np.asarray(got).tobytes())
    assert len(picked) == 3  # the length penalty decides between hypotheses


# -- a model trained to copy ------------------------------------------------------

V, SRC = 12, 6


def _copy_batch(rng, n):
    x = np.zeros((n, SRC), np.int32)
    y = np.zeros((n, SRC + 1), np.int32)
    for i, length in enumerate(rng.integers(1, SRC + 1, n)):
        toks = rng.integers(2, V, length)
        x[i, :length], y[i, :length], y[i, length] = toks, toks, decoding.EOS
    return x, y


@pytest.fixture(scope="module")
def copier():
    """Trains a tiny model to copy its input then emit EOS (~300 Adam steps)."""
    cfg = TransformerConfig(
        vocab_size=V,
        d_model=32,
        num_heads=4,
        num_kv_heads=2,
        num_layers=1,
        d_ff=64,
        dropout_rate=0.0,
        max_len=16,
        position="sinusoidal",
        attention_impl="xla",
    )
    model = Transformer(cfg)
    x0, y0 = jnp.ones((1, SRC), jnp.int32), jnp.ones((1, SRC + 1), jnp.int32)
    boxed = jax.jit(model.init)(jax.random.key(0, impl="rbg"), x0, y0)["params"]
    params = nn.unbox(boxed)  # rbg: threefry takes ~10 s to compile here
    opt = optax.adam(3e-3)

    @jax.jit
    def train_step(params, state, x, y):
        def loss(p):
            ce = optax.softmax_cross_entropy_with_integer_labels(
                model.apply({"params": p}, x, y), y
            )
            w = y != 0
            return (ce * w).sum() / w.sum()

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    rng, state = np.random.default_rng(0), opt.init(params)
    for _ in range(300):
        params, state, value = train_step(params, state, *_copy_batch(rng, 64))
    assert float(value) < 0.1, f"copy task did not train (loss {float(value):.3f})"
    boxed = jax.tree.map(
        lambda box, p: box.replace_boxed(p),
        boxed,
        params,
        is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned),
    )  # the trained values in their logical-axis boxes
    return model, params, boxed


@pytest.mark.slow
def test_greedy_and_beam_decode_a_trained_copier(copier):
    model, params, boxed = copier
    x, y = _copy_batch(np.random.default_rng(1), 8)
    max_length = SRC + 4  # room to run past EOS
    want = np.pad(y, ((0, 0), (0, max_length - y.shape[1])))
    tokens, steps = decoding._greedy(model, params, jnp.asarray(x), max_length)
    tokens = np.asarray(tokens)
    assert (tokens == want).all(1).mean() >= 0.75, tokens
    # EOS once per row, zeros after it, and the loop stopped at the last EOS.
    eos_at = (tokens == decoding.EOS).argmax(1)
    assert ((tokens == decoding.EOS).sum(1) == 1).all()
    assert all((tokens[i, eos_at[i] + 1 :] == 0).all() for i in range(len(x)))
    assert int(steps) == eos_at.max() + 1 < max_length
    # The public entry point accepts boxed params in a variables dict.
    np.testing.assert_array_equal(
        decoding.greedy(model, {"params": boxed}, x, max_length=max_length), tokens
    )

    beam1 = decoding.beam_search(model, params, x, max_length=max_length, beam_size=1, alpha=0.0)
    np.testing.assert_array_equal(beam1, tokens)
    seqs, scores, beam_steps = decoding._beam_search(
        model, params, jnp.asarray(x), jnp.float32(0.6), max_length, 4
    )
    assert (np.asarray(seqs) == want).all(1).mean() >= 0.75
    assert np.all(np.asarray(scores) <= 0) and int(beam_steps) < max_length
    np.testing.assert_array_equal(
        decoding.beam_search(model, params, x, max_length=max_length), seqs
    )


# -- argument checks ------------------------------------------------------------------


def test_bad_arguments_fail_clearly(zoo):
    model, params, _ = zoo["learned"]
    x = _inputs(0)
    with pytest.raises(ValueError, match=r"inputs must be integer token ids \[B, S\]"):
        decoding.greedy(model, params, x.astype(np.float32), max_length=4)
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        decoding.greedy(model, params, x, max_length=0)
    with pytest.raises(ValueError, match="max_length=17 exceeds max_len=16"):
        decoding.greedy(model, params, x, max_length=17)
    with pytest.raises(ValueError, match="beam_size must be a positive int"):
        decoding.beam_search(model, params, x, max_length=4, beam_size=0)
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        decoding.beam_search(model, params, x, max_length=4, alpha=-1.0)
    with pytest.raises(TypeError, match="model must be a jattn.models.Transformer"):
        decoding.greedy(object(), params, x, max_length=4)
