"""Tests of the decoder-only architecture (`TransformerConfig.architecture =
"decoder_only"`, jattn.models.decoder_only): for every registered positional
scheme (built from `jattn.models.SCHEMES`, so new schemes are covered), with
and without `prefix_lm`, cached greedy and beam decoding equal decoding by
full recomputation, cached teacher forcing equals the full forward pass and
packed rows equal unpacked ones; `prefix_lm` lets an input token see a later
input token and never a target token; the causal future never leaks into a
target's logits; parameter counts against the encoder–decoder's (by hand);
the config's checks; and a `jattn train` / `jattn decode` round trip.
"""

from __future__ import annotations

import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_oracle import beam_by_recomputation
from jax import lax
from model_params import fill_params

from jattn.models import (
    SCHEMES,
    Transformer,
    TransformerConfig,
    architecture_counts,
    architecture_line,
    count_params,
    decoding,
    shift_right,
)
from jattn.models.axes import AXIS_NAMES
from jattn.models.decoder_only import stream_random_positions

TINY = dict(
    vocab_size=11,
    d_model=16,
    num_heads=4,
    num_kv_heads=2,  # GQA
    num_layers=1,  # a 2-layer stack
    d_ff=32,
    dropout_rate=0.1,
    max_len=24,
    position_options={
        "shaw": {"max_distance": 2},  # < the stream, so Shaw's clipping is exercised
        "t5": {"num_buckets": 8, "max_distance": 16},
    },
    attention_impl="xla",
    architecture="decoder_only",
)
B, S, L, W = 3, 5, 6, 3  # batch, input length, decoded length, beams
ALPHA = 0.6


def full_logits(model, params, inputs, targets):
    """Teacher-forced logits `[B, T, V]` of the ordinary forward pass; every
    target slot is a real token (segment 1), so 0 may appear as a token."""
    return model.apply(
        {"params": params},
        inputs,
        targets,
        inputs_segment_ids=(inputs != 0).astype(jnp.int32),
        targets_segment_ids=jnp.ones_like(targets),
    )


def _inputs(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.integers(2, 11, (B, S)).astype(np.int32)
    x[1, 3:] = 0  # a padded prompt: its separator sits at position 3, not S
    x[2, 4:] = 0
    return x


def _pack(inputs: np.ndarray, targets: np.ndarray, rows: tuple[int, int]):
    """Two unpacked examples `rows` of `inputs`/`targets` packed into one row:
    (inputs [1, 2S], targets [1, 2T], segment ids, positions)."""
    packed = {k: ([], [], []) for k in ("inputs", "targets")}
    for seg, r in enumerate(rows, start=1):
        for key, row in (("inputs", inputs[r]), ("targets", targets[r])):
            real = row[row != 0]
            tok, ids, pos = packed[key]
            tok += list(real)
            ids += [seg] * len(real)
            pos += list(range(len(real)))
    out = []
    for key, width in (("inputs", 2 * S), ("targets", 2 * targets.shape[1])):
        tok, ids, pos = packed[key]
        pad = width - len(tok)
        out.append([np.array([v + [0] * pad], np.int32) for v in (tok, ids, pos)])
    (xi, si, pi), (xt, st, pt) = out
    return xi, xt, si, st, pi, pt


class Zoo(dict):
    """Per (scheme, prefix_lm): the model, random parameters and two compiled
    functions: `check(params, inputs, targets)` -> full logits, cached
    teacher-forced logits, greedy and beam decodes, the cache; and
    `full(params, inputs, targets)` over B*W rows, for the recomputing
    decoders. A few schemes carry a model variant at no extra compile."""

    VARIANTS = {
        "sinusoidal": dict(share_embeddings=False),
        "rope": dict(num_kv_heads=1),  # MQA
        "alibi": dict(pre_norm=True),
        "shaw": dict(position_options={"shaw": {"terms": "key+value+bias"}}, attention_bias=True),
        "t5": dict(num_layers=2),  # one bias table for four layers
        "xpos": dict(attention_impl="chunked"),  # the prefix LM's mask through the tiles
    }

    def __missing__(self, key):
        position, prefix_lm = key
        variant = self.VARIANTS.get(position, {})
        cfg = TransformerConfig(**TINY).replace(position=position, prefix_lm=prefix_lm, **variant)
        model = Transformer(cfg)

        @jax.jit
        def check(params, inputs, targets):
            full = full_logits(model, params, inputs, targets)  # [B, L, V]
            prev = shift_right(targets, jnp.ones_like(targets))  # [B, L]

            def step(cache, tok):  # tok [B]
                logits, cache = decoding.decode_step(model, params, cache, inputs, tok[:, None])
                return cache, logits

            prefilled = decoding.prefill_prompt(model, params, inputs, targets.shape[1])
            cache, cached = lax.scan(step, prefilled, prev.T)  # [L, B, V]
            greedy = decoding.greedy(model, params, inputs, max_length=targets.shape[1])
            beam = decoding.beam_search(
                model, params, inputs, max_length=targets.shape[1], beam_size=W, alpha=ALPHA
            )
            return full, cached.transpose(1, 0, 2), greedy, beam, cache

        full = jax.jit(lambda p, x, y: full_logits(model, p, x, y))
        self[key] = (model, fill_params(cfg, seed=len(self)), check, full)
        return self[key]


@pytest.fixture(scope="module")
def zoo() -> Zoo:
    return Zoo()


CASES = [(p, prefix) for p in SCHEMES for prefix in (False, True) if not SCHEMES[p].causal_only]
CASES += [(p, False) for p in SCHEMES if SCHEMES[p].causal_only]
IDS = [f"{p}{'-prefix_lm' if prefix else ''}" for p, prefix in CASES]


def greedy_by_recomputation(full, params, inputs) -> np.ndarray:
    """Greedy decoding that runs the whole model for every token."""
    x = np.repeat(inputs, W, axis=0)  # [B*W, S], the rows `full` is compiled for
    tokens = np.zeros((B * W, L), np.int32)
    done = np.zeros(B * W, bool)
    for t in range(L):
        nxt = np.where(done, 0, np.asarray(full(params, x, tokens))[:, t].argmax(-1))
        tokens[:, t] = nxt
        done |= nxt == decoding.EOS
    return tokens[::W]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cached_greedy_and_beam_equal_full_recomputation(zoo, case):
    model, params, check, full = zoo[case]
    inputs = _inputs(0)
    targets = np.random.default_rng(1).integers(0, 11, (B, L)).astype(np.int32)
    out = check(params, inputs, targets)
    logits, cached, greedy, beam = map(np.asarray, out[:4])
    cache = out[4]
    # Teacher forcing: step t after the prompt's prefill sees what the full pass sees.
    np.testing.assert_allclose(cached, logits, rtol=1e-5, atol=1e-5)
    assert int(cache["decoder"]["index"]) == S + L
    np.testing.assert_array_equal(greedy, greedy_by_recomputation(full, params, inputs))
    want, _ = beam_by_recomputation(full, params, inputs, max_length=L, beam_size=W, alpha=ALPHA)
    np.testing.assert_array_equal(beam, want)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_packed_rows_equal_unpacked_ones(zoo, case):
    model, params, _, full = zoo[case]
    inputs = _inputs(2)
    targets = np.random.default_rng(3).integers(2, 11, (B, L)).astype(np.int32)
    targets[0, 4:] = 0  # a shorter target: padding inside the packed row
    xi, xt, si, st, pi, pt = _pack(inputs, targets, (0, 1))
    packed = model.apply(
        {"params": params},
        xi,
        xt,
        inputs_segment_ids=si,
        targets_segment_ids=st,
        inputs_positions=pi,
        targets_positions=pt,
    )[0]  # [2L, V]
    alone = model.apply({"params": params}, inputs, targets)  # [B, L, V]
    n0 = int((targets[0] != 0).sum())
    np.testing.assert_allclose(packed[:n0], alone[0, :n0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[n0 : n0 + L], alone[1], rtol=1e-5, atol=1e-5)


# -- visibility -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hidden():
    """`states(prefix_lm, inputs, targets)`: every layer's output `[B, S+T, D]`
    of a 2-layer decoder-only model (T5 relative bias), without dropout."""
    fns = {}
    for prefix in (False, True):
        cfg = TransformerConfig(**{**TINY, "position": "t5", "prefix_lm": prefix})
        model = Transformer(cfg)
        params = fill_params(cfg, seed=7)

        def states(x, y, model=model, params=params):
            _, inter = model.apply(
                {"params": params},
                x,
                y,
                capture_intermediates=lambda m, _: (m.name or "").startswith("layer_"),
            )
            inter = inter["intermediates"]["decoder"]
            return jnp.stack([inter[f"layer_{i}"]["__call__"][0] for i in range(2)])

        fns[prefix] = jax.jit(states)
    return fns


def _row():
    inputs = np.array([[4, 5, 6, 7, 1]], np.int32)
    targets = np.array([[7, 6, 5, 4, 1]], np.int32)
    return inputs, targets


def _changed(states, x, y, x2, y2) -> np.ndarray:
    """Per stream position: whether any layer's output changed `[S+T]`."""
    a, b = np.asarray(states(x, y)), np.asarray(states(x2, y2))
    return np.abs(a - b).max(axis=(0, 1, 3)) > 0


def test_prefix_lm_lets_an_input_token_see_a_later_input_token(hidden):
    x, y = _row()
    x2 = x.copy()
    x2[0, 3] = 9  # a later input token
    causal, prefix = _changed(hidden[False], x, y, x2, y), _changed(hidden[True], x, y, x2, y)
    assert not causal[:3].any()  # causal: the earlier input tokens never see it
    assert prefix[:3].all()  # prefix LM: every input token does
    assert causal[3:].all() and prefix[3:].all()  # itself, and everything after it


def test_prefix_lm_never_lets_an_input_token_see_a_target_token(hidden):
    x, y = _row()
    for k in range(y.shape[1] - 1):  # the last target token enters no shifted slot
        y2 = y.copy()
        y2[0, k] = 9
        for prefix in (False, True):
            changed = _changed(hidden[prefix], x, y, x, y2)
            # Stream slot S+k+1 holds target k (slot S is the separator): every
            # slot before it, inputs included, is unchanged.
            assert not changed[: S + k + 1].any(), (prefix, k)
            assert changed[S + k + 1 :].all(), (prefix, k)


@pytest.mark.parametrize("prefix", [False, True])
def test_the_causal_future_never_leaks_into_a_targets_logits(zoo, prefix):
    model, params, _, _ = zoo[("rope", prefix)]
    inputs = _inputs(4)
    targets = np.random.default_rng(5).integers(2, 11, (B, L)).astype(np.int32)
    base = np.asarray(model.apply({"params": params}, inputs, targets))
    # The logits at target position t predict target t: they may depend on
    # targets < t only (a perturbation test: change targets t.. and compare).
    for t in range(L):
        changed = targets.copy()
        changed[:, t:] = (changed[:, t:] + 3) % 9 + 2  # targets t.. differ (still real)
        out = np.asarray(model.apply({"params": params}, inputs, changed))
        np.testing.assert_array_equal(out[:, : t + 1], base[:, : t + 1])
        if t + 1 < L:  # and the logits after them do see them
            assert np.all(np.abs(out[:, t + 1 :] - base[:, t + 1 :]).max(-1) > 0)


def test_random_positions_are_one_sorted_sample_per_example():
    # Two packed examples (inputs 1 | 2, targets 1 | 2) and padding.
    seg = jnp.array([[1, 1, 2, 2, 2, 0, 1, 1, 1, 2, 0, 0]], jnp.int32)
    for seed in range(5):
        pos = np.asarray(stream_random_positions(jax.random.key(seed), seg, 16))[0]
        for s in (1, 2):
            p = pos[np.asarray(seg[0]) == s]  # inputs then targets, stream order
            assert np.all(np.diff(p) > 0) and p.min() >= 0 and p.max() < 16
        assert np.all(pos[np.asarray(seg[0]) == 0] == 0)


# -- parameters, sharding, config ----------------------------------------------------


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_parameter_counts_against_the_encoder_decoders_by_hand(kv_heads):
    cfg = TransformerConfig.base(37_000, num_kv_heads=kv_heads)
    counts = architecture_counts(cfg)
    d, h, n = cfg.d_model, cfg.head_dim, cfg.num_layers
    cross = 2 * d * d + 2 * d * kv_heads * h + 2 * d  # q, o, k, v and the cross norm
    assert counts["encoder_decoder"] - counts["decoder_only"] == n * cross
    layer = 2 * d * d + 2 * d * kv_heads * h + 2 * d * cfg.d_ff + d + cfg.d_ff + 4 * d
    assert counts["decoder_only"] == 2 * n * layer + cfg.vocab_size * d
    print("\n" + architecture_line(cfg.replace(architecture="decoder_only")))
    assert 0.85 < counts["decoder_only"] / counts["encoder_decoder"] < 1.0


def test_decoder_only_parameters_carry_the_encoder_decoders_logical_axes():
    def names(cfg):
        tokens = jnp.ones((1, 4), jnp.int32)
        boxed = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), tokens, tokens))
        flat = jax.tree_util.tree_flatten_with_path(
            boxed["params"], is_leaf=lambda x: isinstance(x, nn.Partitioned)
        )[0]
        return {
            "/".join(k.key for k in path): tuple(leaf.names) for path, leaf in flat
        }  # every leaf is boxed with logical names

    for position in ("t5", "learned", "shaw"):
        cfg = TransformerConfig(**{**TINY, "position": position})
        dec_only = names(cfg)
        enc_dec = names(cfg.replace(architecture="encoder_decoder"))
        assert dec_only and all(set(n) <= AXIS_NAMES for n in dec_only.values())
        shared = set(dec_only) & set(enc_dec)
        assert len(shared) >= len(dec_only) // 2  # decoder/layer_0/..., embed/...
        assert all(dec_only[k] == enc_dec[k] for k in shared)


def test_config_checks_name_the_choices():
    with pytest.raises(ValueError, match=r"architecture='decoder'.*'encoder_decoder'"):
        TransformerConfig(vocab_size=8, architecture="decoder")
    with pytest.raises(ValueError, match=r"prefix_lm=True needs architecture in \['decoder_only"):
        TransformerConfig(vocab_size=8, prefix_lm=True)
    with pytest.raises(ValueError, match="no cross-attention"):
        TransformerConfig(
            vocab_size=8, architecture="decoder_only", position="rope", relative_cross=True
        )
    cfg = TransformerConfig(**{**TINY, "position": "learned", "max_len": 8})
    model = Transformer(cfg)
    with pytest.raises(ValueError, match="exceeds max_len=8"):  # 5 input + 6 target tokens
        model.init(jax.random.key(0), jnp.ones((1, 5), jnp.int32), jnp.ones((1, 6), jnp.int32))
    with pytest.raises(ValueError, match=r"max_length=6 \+ 5 input tokens exceeds"):
        decoding.greedy(model, {}, jnp.ones((1, 5), jnp.int32), max_length=6)
    with pytest.raises(ValueError, match="has no encoder"):
        model.apply({"params": {}}, jnp.ones((1, 3), jnp.int32), method="encode")


# -- jattn train / jattn decode --------------------------------------------------------


def test_train_and_decode_round_trip_on_the_smoke_config(tmp_path, capsys):
    from pathlib import Path

    from jattn import cli
    from jattn.train import apply_overrides, load_config, load_run, train_and_evaluate
    from jattn.train.evaluation import ids_to_text

    smoke = str(Path(__file__).resolve().parents[1] / "configs" / "smoke.py")
    overrides = [
        ("model.architecture", "decoder_only"),
        ("model.position", "rope"),
        ("num_train_steps", "4"),
        ("eval_every_steps", "4"),
        ("eval_max_batches", "1"),
        ("eval_decode_examples", "4"),
    ]
    config = apply_overrides(load_config(smoke), overrides)
    capsys.readouterr()
    final = train_and_evaluate(config, str(tmp_path))
    printed = capsys.readouterr()  # the start-up summary goes to stderr
    run = load_run(str(tmp_path))
    assert run.model.config.architecture == "decoder_only"
    n = count_params(run.params)
    assert f"parameters: {n:,}" in printed.out + printed.err
    counts = architecture_counts(run.model.config)
    assert n == counts["decoder_only"]
    # Printed at start beside the encoder-decoder's count at the same width.
    said = printed.out + printed.err  # one line: this model, then every other architecture
    assert f"parameters: {n:,} (decoder_only, 2 layers; at the same width: " in said
    assert f"encoder_decoder {counts['encoder_decoder']:,}, 1+1 layers" in said
    assert f"encoder_only {counts['encoder_only']:,}, 1 layer" in said
    assert math.isfinite(final["train/loss"])
    assert any("eval/validation/exact_match" in k for k in final)
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in r for r in lines)

    texts = ("abc", "hello")
    ids = [run.tokenizer.encode(t) for t in texts]
    inputs = np.zeros((2, max(map(len, ids))), np.int32)
    for i, row in enumerate(ids):
        inputs[i, : len(row)] = row
    length = run.config.eval_max_len
    capsys.readouterr()
    for method in ("greedy", "beam"):
        if method == "beam":
            want = decoding.beam_search(
                run.model,
                run.params,
                inputs,
                max_length=length,
                beam_size=run.config.beam_size,
                alpha=run.config.beam_alpha,
            )
        else:
            want = decoding.greedy(run.model, run.params, inputs, max_length=length)
        assert cli.main(["decode", "--workdir", str(tmp_path), "--decode", method, *texts]) == 0
        got = capsys.readouterr().out.split("\n")[:-1]
        assert got == [ids_to_text(run.tokenizer, r) for r in np.asarray(want)]
