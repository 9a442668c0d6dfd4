"""Tests of jattn.models.decoding (public as `jattn.decoding`): the KV cache
against full recomputation for every positional scheme, greedy against a
naive recomputing loop, beam search against exhaustive enumeration, and both
searches on a model trained to copy. The cross-attention cache: its contents
are the projections of the encoder output, cached steps (greedy and beam,
MHA/GQA/MQA) give the full forward pass's logits, and the projection is in no
step's program.
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
from model_params import fill_params

from jattn.models import (
    Transformer,
    TransformerConfig,
    decoding,
    shift_right,
)

TINY = dict(
    vocab_size=11,
    d_model=16,
    num_heads=4,
    num_kv_heads=2,
    num_layers=1,
    d_ff=32,
    dropout_rate=0.1,
    max_len=16,
    position_options={
        "shaw": {"max_distance": 2},  # < L, so Shaw's clipping is exercised while decoding
        "t5": {"num_buckets": 8, "max_distance": 16},
    },
    attention_impl="xla",
)
B, S, L = 3, 5, 6


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
    greedy decode, the final and the prefilled cache, so each scheme compiles
    once. "t5" has
    two layers per stack (one shared bias table, a cache per layer); a few
    schemes also carry a model variant, covered at no extra compile."""

    VARIANTS = {
        "t5": dict(num_layers=2),
        "alibi": dict(pre_norm=True),
        "sinusoidal": dict(share_embeddings=False),
        "rope": dict(num_kv_heads=1),  # MQA
        "shaw": dict(position_options={"shaw": {"terms": "key"}}, attention_bias=True),
        "shaw[key+bias] rel2": dict(
            position="shaw", position_options={"shaw": {"terms": "key+bias"}}, relative_cross=True
        ),
        "rope rel2": dict(position="rope", relative_cross=True),
        "t5 rel2": dict(position="t5", relative_cross=True),
    }

    def __missing__(self, position):
        variant = self.VARIANTS.get(position, {})
        cfg = TransformerConfig(**TINY).replace(**{"position": position, **variant})
        model = Transformer(cfg)

        @jax.jit
        def check(params, inputs, targets):
            full = full_logits(model, params, inputs, targets)  # [B, L, V]
            encoded = model.apply({"params": params}, inputs, method="encode")
            prev = shift_right(targets, jnp.ones_like(targets))  # [B, L]

            def step(cache, tok):  # tok [B]
                logits, cache = decoding.decode_step(model, params, cache, inputs, tok[:, None])
                return cache, logits

            prefilled = decoding.prefill(model, params, encoded, targets.shape[1])
            cache, cached = lax.scan(step, prefilled, prev.T)  # [L, B, V]
            greedy = decoding.greedy(model, params, inputs, max_length=targets.shape[1])
            return full, cached.transpose(1, 0, 2), greedy, cache, prefilled

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


@pytest.mark.parametrize("position", list(Zoo.VARIANTS))
def test_cached_decoding_equals_full_recomputation_in_model_variants(zoo, position):
    """The model variants of `Zoo.VARIANTS` (two layers, pre-norm, separate
    embeddings, MQA, attention biases, rel2); every registered scheme is
    checked in tests/test_schemes.py."""
    model, params, check = zoo[position]
    inputs = _inputs(0)
    targets = np.random.default_rng(1).integers(0, 11, (B, L)).astype(np.int32)
    full, cached, greedy, _, _ = check(params, inputs, targets)
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
    empty = decoding.init_cache(model, B, L, source_length=S)
    assert empty["decoder"]["index"].shape == () and int(empty["decoder"]["index"]) == 0
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(empty))
    targets = np.full((B, L), 5, np.int32)
    _, _, _, cache, prefilled = check(params, _inputs(0), targets)  # after L steps, and before
    dec = cache["decoder"]
    assert int(dec["index"]) == L
    for layer in ("layer_0", "layer_1"):
        attn = dec[layer]["self_attention"]
        assert attn["cached_key"].shape == attn["cached_value"].shape == (B, L, 2, 4)  # [B,L,K,H]
        assert np.all(np.abs(np.asarray(attn["cached_key"])).max(axis=(2, 3)) > 0)  # all written
        cross = dec[layer]["cross_attention"]
        assert cross["cached_key"].shape == cross["cached_value"].shape == (B, S, 2, 4)  # [B,S,K,H]
        # Written once by the prefill; the L steps only read it.
        for name in ("cached_key", "cached_value"):
            want = prefilled["decoder"][layer]["cross_attention"][name]
            np.testing.assert_array_equal(cross[name], want)
    assert not np.allclose(
        dec["layer_0"]["self_attention"]["cached_key"],
        dec["layer_1"]["self_attention"]["cached_key"],
    )


# -- the cross-attention cache ------------------------------------------------------

HEADS = {  # a positional scheme per variant, for variety
    "mha": dict(num_kv_heads=4, position="shaw", attention_bias=True),
    "gqa": dict(num_kv_heads=2, position="rope"),
    "mqa": dict(num_kv_heads=1, position="t5"),
}
W = 3  # beams


@pytest.fixture(scope="module", params=list(HEADS))
def heads(request):
    """Two-layer MHA, GQA and MQA models (random parameters)."""
    cfg = TransformerConfig(**{**TINY, "num_layers": 2, **HEADS[request.param]})
    return Transformer(cfg), fill_params(cfg, seed=20 + list(HEADS).index(request.param))


def test_prefill_caches_the_projections_of_the_encoder_output(heads):
    model, params = heads
    cfg = model.config
    encoded = model.apply({"params": params}, _inputs(0), method="encode")  # [B, S, D]
    cache = decoding.prefill(model, params, encoded, L)["decoder"]
    enc = np.asarray(encoded, np.float64)
    assert int(cache["index"]) == 0
    for i in range(cfg.num_layers):
        weights = params["decoder"][f"layer_{i}"]["cross_attention"]
        cross = cache[f"layer_{i}"]["cross_attention"]
        for w, name in (("k", "cached_key"), ("v", "cached_value")):
            want = np.einsum("BSD,DKH->BSKH", enc, np.asarray(weights[w], np.float64))
            if cfg.attention_bias:
                want = want + np.asarray(weights[f"{w}_bias"], np.float64)
            assert cross[name].shape == (B, S, cfg.num_kv_heads, cfg.head_dim)
            np.testing.assert_allclose(cross[name], want, rtol=1e-5, atol=1e-5)
            # Self-attention slots are written by the steps, not the prefill.
            assert not np.any(np.asarray(cache[f"layer_{i}"]["self_attention"][name]))


def _beam_shaped_run(model, params, inputs, origins, tokens):
    """Decode like beam search: B*W rows (encoder output tiled over beams),
    after step t the rows reordered by `origins[t]` `[B, W]` (each beam's
    parent) and extended by `tokens[t]` `[B, W]`. Returns each step's cached
    logits `[L, B*W, V]` and the targets each step saw `[L, B*W, L]` (those
    before position t; the rest is 0)."""
    b, w = origins.shape[1:]
    encoded = model.apply({"params": params}, inputs, method="encode")
    cache = decoding.prefill(model, params, jnp.repeat(encoded, w, axis=0), L)
    inputs_w = jnp.repeat(inputs, w, axis=0)  # [B*W, S]

    def step(carry, xs):
        cache, seqs, last = carry  # seqs [B, W, L], last [B, W]
        t, origin, tok = xs
        logits, cache = decoding.decode_step(model, params, cache, inputs_w, last.reshape(-1, 1))
        seen = seqs.reshape(b * w, -1)
        seqs = decoding.gather_beams(seqs, origin).at[:, :, t].set(tok)
        cache = decoding.reorder_cache(cache, origin)
        return (cache, seqs, tok), (logits, seen)

    start = (cache, jnp.zeros((b, w, L), jnp.int32), jnp.zeros((b, w), jnp.int32))
    _, (logits, seen) = lax.scan(step, start, (jnp.arange(L), origins, tokens))
    return logits, seen


def test_cached_steps_equal_the_full_forward_pass_greedy_and_beam(heads):
    model, params = heads
    inputs = jnp.asarray(_inputs(3))
    greedy, _ = decoding.greedy_search(model, params, inputs, L)  # [B, L]
    greedy = np.asarray(greedy)

    # Beam-shaped steps: random parents (beams duplicated and dropped) and
    # tokens, except that beam 0 of every row stays beam 0 and follows greedy.
    rng = np.random.default_rng(4)
    origins = rng.integers(0, W, (L, B, W)).astype(np.int32)
    toks = rng.integers(0, TINY["vocab_size"], (L, B, W)).astype(np.int32)
    origins[:, :, 0], toks[:, :, 0] = 0, greedy.T
    logits, seen = jax.jit(_beam_shaped_run, static_argnums=0)(
        model, params, inputs, origins, toks
    )  # [L, B*W, V], [L, B*W, L]
    x = np.repeat(np.repeat(_inputs(3), W, axis=0)[None], L, axis=0).reshape(-1, S)
    full = jax.jit(full_logits, static_argnums=0)(model, params, x, np.asarray(seen).reshape(-1, L))
    full = np.asarray(full).reshape(L, B * W, L, -1)
    step = np.arange(L)
    np.testing.assert_allclose(logits, full[step, :, step], rtol=1e-5, atol=1e-5)

    # Greedy's tokens are the argmax of those logits up to each row's EOS.
    greedy_logits = np.asarray(logits)[:, ::W].transpose(1, 0, 2)  # beam 0: [B, L, V]
    eos_before = np.cumsum(greedy == decoding.EOS, axis=1) - (greedy == decoding.EOS)
    np.testing.assert_array_equal(np.where(eos_before == 0, greedy_logits.argmax(-1), 0), greedy)

    # beam_search itself: the same result as projecting at every step.
    args = (model, params, inputs, jnp.float32(0.6), L, W)
    seqs, scores, _ = decoding.beam_search_with_scores(*args)
    seqs_r, scores_r, _ = decoding.beam_search_with_scores(*args, cross_cache=False)
    np.testing.assert_array_equal(seqs, seqs_r)
    np.testing.assert_allclose(scores, scores_r, rtol=1e-6)


def _encoder_projections(closed, s: int, d: int) -> tuple[int, int]:
    """dot_generals with an operand shaped `[..., S, D]` (projections of the
    encoder output), counted outside and inside `while` loops of a jaxpr."""
    counts = [0, 0]

    def walk(jaxpr, in_loop):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                if any(tuple(v.aval.shape[-2:]) == (s, d) for v in eqn.invars):
                    counts[in_loop] += 1
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                    if hasattr(sub, "eqns"):
                        walk(sub, in_loop or eqn.primitive.name == "while")

    walk(closed.jaxpr, False)
    return counts[0], counts[1]


def test_cross_projection_runs_once_per_decode_call_not_per_step(heads):
    model, params = heads
    cfg = model.config
    per_call = 2 * cfg.num_layers  # K and V of every cross-attention layer
    inputs = jnp.asarray(_inputs(0))
    encoded = model.apply({"params": params}, inputs, method="encode")
    cache = decoding.prefill(model, params, encoded, L)
    tok = jnp.zeros((B, 1), jnp.int32)
    assert S != L and (S, cfg.d_model) != (1, cfg.d_model)  # the operand shape is unambiguous

    def count(fn, *args):
        return _encoder_projections(jax.make_jaxpr(fn)(*args), S, cfg.d_model)

    # One step: no projection of the encoder output (with the encoder output
    # given, the uncached step has them all: the count sees them).
    assert count(lambda c: decoding.decode_step(model, params, c, inputs, tok), cache) == (0, 0)
    uncached = lambda c, e: decoding.decode_step(model, params, c, inputs, tok, encoded=e)  # noqa: E731
    assert count(uncached, cache, encoded) == (per_call, 0)
    assert count(lambda e: decoding.prefill(model, params, e, L), encoded) == (per_call, 0)

    # Whole decode calls: none inside the step loop, once before it.
    for search in (
        lambda p, x, c: decoding.greedy_search(model, p, x, L, cross_cache=c),
        lambda p, x, c: decoding.beam_search_with_scores(
            model, p, x, jnp.float32(0.6), L, W, cross_cache=c
        ),
    ):
        outside, inside = count(lambda p, x, search=search: search(p, x, True), params, inputs)
        outside_r, inside_r = count(lambda p, x, search=search: search(p, x, False), params, inputs)
        assert (inside, inside_r) == (0, per_call)
        assert outside - outside_r == per_call  # the prefill

    # The step never reads the cross-attention key/value weights: without
    # them it computes the same logits and cache.
    stripped = jax.tree.map(lambda x: x, params)
    for i in range(cfg.num_layers):
        cross = stripped["decoder"][f"layer_{i}"]["cross_attention"]
        for name in ("k", "v", "k_bias", "v_bias"):
            cross.pop(name, None)
    step = jax.jit(decoding.decode_step, static_argnums=0)
    want = step(model, params, cache, inputs, tok)
    got = step(model, stripped, cache, inputs, tok)
    jax.tree.map(np.testing.assert_array_equal, got, want)


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
    tokens, steps = decoding.greedy_search(model, params, jnp.asarray(x), max_length)
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
    seqs, scores, beam_steps = decoding.beam_search_with_scores(
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
    # Cached steps: only in decode mode, with a cache, and only for its source.
    y = np.ones((B, 1), np.int32)
    with pytest.raises(ValueError, match="Transformer.step needs use_cache=True"):
        model.apply({"params": params}, x, y, method="step")
    with pytest.raises(ValueError, match="mode='step' needs decode=True and an initialised cache"):
        model.clone(use_cache=True).apply(
            {"params": params}, x, y, method="step", mutable=["cache"]
        )
    encoded = model.apply({"params": params}, x, method="encode")  # [B, S, D]
    cache = decoding.prefill(model, params, encoded, 4)
    with pytest.raises(ValueError, match="cached keys cover 5 source positions, the source has 4"):
        decoding.decode_step(model, params, cache, x[:, :4], y)
    with pytest.raises(ValueError, match=r"keys \[3, 4, 2, 4\] do not fit the cache \[3, 5,"):
        model.clone(use_cache=True).apply(
            {"params": params, "cache": cache}, encoded[:, :4], method="prefill", mutable=["cache"]
        )


def test_bench_decode_script_runs(capsys):
    """benchmarks/decode.py on a tiny problem: both paths, one table."""
    import pathlib
    import runpy

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "decode.py"
    bench = runpy.run_path(str(path))
    args = ["--sizes", "numbers", "--batch", "2", "--source", "5", "--steps", "3"]
    assert bench["main"]([*args, "--beam", "2", "--repeats", "1"]) == 0
    table = capsys.readouterr().out
    assert "| numbers (d64, 4/4 heads, 2+2L) | beam 2 | cached |" in table
    assert table.count("| recompute |") == table.count("| cached |") == 2


def test_jattn_decoding_is_the_models_module():
    """`jattn.decoding` (docs/design.md's public name) resolves to jattn.models.decoding."""
    import jattn
    from jattn import decoding as public

    assert public is jattn.decoding is decoding
    assert jattn.decoding.greedy is decoding.greedy
