"""Randomised positions (Ruoss et al. 2023) in greedy and beam decoding.

With `random_positions = M` and `random_positions_eval=True`, decoding draws
its positions up front (`jattn.models.decoding.decoding_positions`): the
encoder–decoder's source row a sorted sample of [0, M) of its length and its
L target slots another, the decoder-only row one sorted sample for prompt,
separator and decoded tokens. The contracts:

- the draw is a sorted sample of distinct positions of [0, M), a function of
  the caller's rng (none: the fixed key 0, what evaluation uses);
- cached greedy equals greedy by full recomputation (a float64 forward pass
  given the same drawn positions), for every registered scheme and both
  architectures, and so do the cached steps' logits;
- beam search equals the exhaustive best under the same positions, and the
  beams of a row decode with that row's positions;
- with `random_positions_eval=False` decoding is bit-identical to plain
  decoding; asking for random positions without M fails in one line.

Tiny models with random parameters drawn on the host.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from model_params import fill_params
from registry_mods import seed_of

from jattn.models import SCHEMES, Transformer, TransformerConfig, decoding, decoding_search
from jattn.models.transformer import shift_right

M = 32  # positions are drawn from [0, M)
B, S, L = 3, 5, 6
TINY = dict(
    vocab_size=13,
    d_model=16,
    num_heads=4,
    num_kv_heads=2,
    num_layers=1,
    d_ff=32,
    dropout_rate=0.1,
    max_len=M,  # the learned table holds every position a draw can give
    position_options={
        "shaw": {"max_distance": 3},  # < L: Shaw's clipping is exercised
        "t5": {"num_buckets": 8, "max_distance": 16},
        "fire": {"hidden": 4},
    },
    attention_impl="xla",
    random_positions=M,
    random_positions_eval=True,
)
ARCHS = ("encoder_decoder", "decoder_only")


def config_of(position: str, architecture: str, **overrides) -> TransformerConfig:
    return TransformerConfig(
        **{**TINY, "position": position, "architecture": architecture, **overrides}
    )


def source(seed: int) -> np.ndarray:
    """`[B, S]` tokens, rows of 5, 3 and 1 real tokens (padded on the right)."""
    x = np.random.default_rng(seed).integers(2, TINY["vocab_size"], (B, S)).astype(np.int32)
    x[1, 3:] = 0
    x[2, 1:] = 0
    return x


def full_logits64(config, params, inputs, targets, positions) -> np.ndarray:
    """The float64 teacher-forced forward pass `[B, T, V]` over `targets`, every
    slot a real token, at the given drawn positions `(inputs [B, S], targets
    [B, >=T])`: the full recomputation that cached decoding must equal."""
    in_pos, tg_pos = (np.asarray(p) for p in positions)
    t = targets.shape[1]
    tg_pos = tg_pos[:, :t]
    # A decoder-only stream offsets target-side positions past the prompt.
    if config.architecture == "decoder_only":
        offset = np.max(np.where(inputs != 0, in_pos + 1, 0), axis=1)
        tg_pos = tg_pos - offset[:, None]
    ref = Transformer(
        config.replace(dtype="float64", param_dtype="float64", random_positions_eval=False)
    )
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
        out = _forward(ref, p64, inputs, targets, in_pos, tg_pos)
        return np.asarray(out, np.float64)


@jax.jit(static_argnums=0)
def _forward(model, params, inputs, targets, inputs_positions, targets_positions):
    return model.apply(
        {"params": params},
        inputs,
        targets,
        inputs_segment_ids=(inputs != 0).astype(jnp.int32),
        targets_segment_ids=jnp.ones(targets.shape, jnp.int32),
        inputs_positions=inputs_positions,
        targets_positions=targets_positions,
    )


def cached_step_logits(model, params, inputs, targets, positions):
    """The cached steps' logits `[B, L, V]` when the decoder is fed `targets`
    shifted right, one token a step, at the drawn `positions`."""
    if model.config.architecture == "decoder_only":  # the positions go into the cache
        cache = decoding.prefill_prompt(model, params, inputs, L, positions=positions)
        given = {}
    else:
        encoded = model.apply(
            {"params": params}, inputs, inputs_positions=positions[0], method="encode"
        )
        cache = decoding.prefill(model, params, encoded, L)
        given = dict(inputs_positions=positions[0], targets_positions=positions[1])

    def step(cache, tok):  # tok [B]
        logits, cache = decoding.decode_step(model, params, cache, inputs, tok[:, None], **given)
        return cache, logits

    prev = shift_right(targets, jnp.ones_like(targets))  # [B, L]
    _, logits = lax.scan(step, cache, prev.T)  # [L, B, V]
    return logits.transpose(1, 0, 2)


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def before_eos(tokens: np.ndarray) -> np.ndarray:
    """bool `[B, L]`: slots up to and including each row's first EOS."""
    eos = tokens == decoding.EOS
    return (np.cumsum(eos, axis=1) - eos) == 0


# -- the draw -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_drawn_positions_are_sorted_distinct_and_within_range(arch):
    cfg = config_of("sinusoidal", arch)
    inputs = jnp.asarray(source(0))
    real = np.asarray(inputs) != 0
    draws = [decoding.decoding_positions(cfg, jax.random.key(i), inputs, L) for i in range(100)]
    first = {}
    for in_pos, tg_pos in draws:
        in_pos, tg_pos = np.asarray(in_pos), np.asarray(tg_pos)
        assert in_pos.shape == (B, S) and tg_pos.shape == (B, L)
        assert np.all(in_pos[~real] == 0)  # padding
        for b in range(B):
            # Encoder-decoder: two samples (source, target slots); decoder-only:
            # one sample for the prompt, the separator and the decoded tokens.
            samples = (
                [np.concatenate([in_pos[b][real[b]], tg_pos[b]])]
                if cfg.architecture == "decoder_only"
                else [in_pos[b][real[b]], tg_pos[b]]
            )
            for sample in samples:
                assert np.all(np.diff(sample) > 0)  # sorted and distinct
                assert sample.min() >= 0 and sample.max() < M
            first.setdefault(b, set()).add(int(tg_pos[b, 0]))
    assert all(len(v) > 5 for v in first.values())  # a draw, not a fixed layout
    # Deterministic in the rng; evaluation's default is the fixed key 0.
    again = decoding.decoding_positions(cfg, jax.random.key(3), inputs, L)
    jax.tree.map(np.testing.assert_array_equal, again, draws[3])
    assert not np.array_equal(draws[0][1], draws[1][1])


# -- greedy: cached equals full recomputation, every scheme ----------------------------------


@jax.jit(static_argnums=0)
def greedy_and_its_steps(model, params, inputs, rng):
    """One compile a case: the drawn positions, greedy's tokens `[B, L]`, and
    the cached steps' logits `[B, L, V]` when fed those tokens."""
    positions = decoding.decoding_positions(model.config, rng, inputs, L)
    greedy = decoding.greedy(model, params, inputs, max_length=L, rng=rng)
    return positions, greedy, cached_step_logits(model, params, inputs, greedy, positions)


# One scheme a hook (absolute table, rotation, score mod, Shaw tables) runs by
# default; the rest of the registry is marked slow (a few seconds a case).
CORE = {("learned", "encoder_decoder"), ("t5", "encoder_decoder"), ("rope", "decoder_only"),
        ("shaw", "decoder_only")}  # fmt: skip
SWEEP = [
    pytest.param(p, a, marks=() if (p, a) in CORE else pytest.mark.slow)
    for p in sorted(SCHEMES)
    for a in ARCHS
]


@pytest.mark.parametrize("position, arch", SWEEP)
def test_cached_greedy_equals_full_recomputation_at_the_drawn_positions(position, arch):
    if SCHEMES[position].causal_only and arch == "encoder_decoder":
        pytest.skip(f"{position!r} is causal-only: no encoder-decoder of it exists")
    cfg = config_of(position, arch)
    model = Transformer(cfg)
    params = fill_params(cfg, seed=seed_of(position))  # by name: a new scheme moves no other
    inputs = jnp.asarray(source(1))
    positions, greedy, steps = greedy_and_its_steps(model, params, inputs, jax.random.key(7))
    greedy = np.asarray(greedy)
    full = full_logits64(cfg, params, np.asarray(inputs), greedy, positions)  # [B, L, V]

    # Each cached step's logits are those of recomputing the whole prefix.
    np.testing.assert_allclose(np.asarray(steps, np.float64), full, rtol=1e-5, atol=1e-5)
    # Greedy's token at t is the argmax of the recomputed logits at t, up to EOS.
    keep = before_eos(greedy)
    np.testing.assert_array_equal(np.where(keep, full.argmax(-1), 0), greedy)
    # The drawn positions matter (but for NoPE, whose causal order they keep,
    # and schemes of the tokens alone): plain positions give other logits.
    scheme = SCHEMES[position]
    if (scheme.absolute or scheme.relative) and not scheme.data_dependent:
        plain = plain_positions(cfg, np.asarray(inputs))
        other = full_logits64(cfg, params, np.asarray(inputs), greedy, plain)
        assert np.abs(other - full).max() > 1e-3


def plain_positions(cfg, inputs, length: int = L):
    """Today's decoding positions as `decoding_positions` lays them out: the
    source at `arange(S)`; the target slots at `arange(L)`, a decoder-only
    row's from its separator, one past its prompt."""
    b, s = inputs.shape
    prompt = np.sum(inputs != 0, axis=1)  # [B]
    start = prompt if cfg.architecture == "decoder_only" else np.zeros(b, np.int64)  # [B]
    return np.broadcast_to(np.arange(s), (b, s)), start[:, None] + np.arange(length)[None, :]


# -- beam search ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "position, arch",
    [("learned", "encoder_decoder"), ("t5", "encoder_decoder"), ("rope", "decoder_only")],
)
def test_wide_beam_finds_the_exhaustive_best_at_the_drawn_positions(position, arch):
    """27 beams hold every live prefix of a 4-token vocabulary over 3 steps,
    so the search is exact: it must return the best hypothesis as scored by
    the float64 forward pass at the row's drawn positions."""
    cfg = config_of(position, arch, vocab_size=4)
    model = Transformer(cfg)
    params = fill_params(cfg, seed=9)
    emb = params["embed"]["embedding"]
    params["embed"]["embedding"] = emb.at[decoding.EOS].multiply(0.2)  # EOS not always first
    n, alpha = 3, 0.6
    inputs = np.array([[2, 3, 3, 2, 0], [3, 2, 0, 0, 0]], np.int32)
    rng = jax.random.key(11)
    positions = [np.asarray(p) for p in decoding.decoding_positions(cfg, rng, inputs, n)]
    hyps = [
        list(prefix) + [decoding.EOS]
        for k in range(n)
        for prefix in itertools.product([0, 2, 3], repeat=k)
    ]
    targets = np.array([h + [0] * (n - len(h)) for h in hyps], np.int32)  # [13, n]
    plain = plain_positions(cfg, inputs, n)
    best = []
    for row, x in enumerate(inputs):
        x_rows = np.repeat(x[None], len(hyps), 0)  # [13, S]
        drawn = [np.repeat(p[row : row + 1], len(hyps), 0) for p in positions]
        logp = log_softmax64(full_logits64(cfg, params, x_rows, targets, drawn))  # [13, n, V]
        scores = [
            sum(logp[i, t, tok] for t, tok in enumerate(h)) / ((5 + len(h)) / 6) ** alpha
            for i, h in enumerate(hyps)
        ]
        best.append(targets[int(np.argmax(scores))])
        # The positions decide the scores (so the equality below is informative).
        at_plain = [np.repeat(p[row : row + 1], len(hyps), 0) for p in plain]
        plain_logp = log_softmax64(full_logits64(cfg, params, x_rows, targets, at_plain))
        assert np.abs(plain_logp - logp).max() > 1e-3
    got = decoding.beam_search(
        model, params, inputs, max_length=n, beam_size=27, alpha=alpha, rng=rng
    )
    np.testing.assert_array_equal(got, np.stack(best))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_beams_of_a_row_decode_at_its_drawn_positions(arch, monkeypatch):
    """Every step of beam search is given (encoder-decoder) or holds in its
    cache (decoder-only) the row's draw, the same for each of its W beams."""
    w = 3
    cfg = config_of("alibi", arch, vocab_size=12)  # a model no other test compiles
    model, params = Transformer(cfg), fill_params(cfg, seed=5)
    inputs = jnp.asarray(source(2))
    rng = jax.random.key(4)
    want = [np.asarray(p) for p in decoding.decoding_positions(cfg, rng, inputs, L)]
    seen = []
    real_step = decoding.decode_step

    def recording_step(model, params, cache, inputs, tokens, **given):
        if model.config.architecture == "decoder_only":
            slots = cache["decoder"]["slot_positions"]  # [B*W, S + L]
            pair = (slots[:, :S], slots[:, S:])
        else:
            pair = (given["inputs_positions"], given["targets_positions"])
        jax.debug.callback(lambda a, b: seen.append((np.asarray(a), np.asarray(b))), *pair)
        return real_step(model, params, cache, inputs, tokens, **given)

    monkeypatch.setattr(decoding_search, "decode_step", recording_step)  # what the loop calls
    decoding.beam_search(model, params, inputs, max_length=L, beam_size=w, rng=rng)
    assert seen  # one record a step
    real = np.repeat(np.asarray(inputs) != 0, w, axis=0)
    for in_pos, tg_pos in seen:
        np.testing.assert_array_equal(np.where(real, in_pos, 0).reshape(B, w, S),
                                      np.repeat(want[0][:, None], w, axis=1))  # fmt: skip
        np.testing.assert_array_equal(tg_pos.reshape(B, w, L), np.repeat(want[1][:, None], w, 1))


# -- plain decoding unchanged; errors --------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_without_random_eval_is_bit_identical_to_plain(arch):
    """`random_positions_eval=False` (the default; an rng passed then is
    unused), `random_positions=False` at the call, and eval without M (the
    plain arm of a grid that sets eval for all) decode exactly as a model
    without random positions: tokens, and the beams' scores."""
    plain = config_of("rope", arch, random_positions=0, random_positions_eval=False)
    params = fill_params(plain, seed=3)
    inputs = jnp.asarray(source(3))
    key = jax.random.key(1)

    def greedy(cfg, **kw):
        return np.asarray(decoding.greedy(Transformer(cfg), params, inputs, max_length=L, **kw))

    want = greedy(plain)
    np.testing.assert_array_equal(greedy(plain.replace(random_positions=M), rng=key), want)
    evaluated = plain.replace(random_positions=M, random_positions_eval=True)
    np.testing.assert_array_equal(greedy(evaluated, random_positions=False), want)
    np.testing.assert_array_equal(greedy(plain.replace(random_positions_eval=True)), want)
    # Beam search: the search with no positions is the one that ran before them.
    args = (Transformer(plain.replace(random_positions=M)), params, inputs, jnp.float32(0.6), L, 3)
    seqs, scores, steps = decoding.beam_search_with_scores(*args)
    got = decoding.beam_search(*args[:3], max_length=L, beam_size=3, alpha=0.6, rng=key)
    np.testing.assert_array_equal(got, seqs)
    plain_args = (Transformer(plain), *args[1:])
    before = decoding.beam_search_with_scores(*plain_args)
    for x, y in zip(before, (seqs, scores, steps), strict=True):
        np.testing.assert_array_equal(x, y)
    # The random path is another decode; its default key is evaluation's key 0.
    default = greedy(evaluated)
    np.testing.assert_array_equal(default, greedy(evaluated, rng=jax.random.key(0)))


def test_random_positions_at_decoding_without_m_fail_in_one_line():
    cfg = config_of("sinusoidal", "encoder_decoder", random_positions=0)
    model, params = Transformer(cfg), fill_params(cfg, seed=0)
    inputs = source(0)
    with pytest.raises(ValueError, match=r"random_positions=M > 0") as e:
        decoding.greedy(model, params, inputs, max_length=L, random_positions=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"random_positions=M > 0"):
        decoding.beam_search(model, params, inputs, max_length=L, random_positions=True)
    # A draw that cannot fit in [0, M) is refused too (decoder-only: S + L slots).
    small = config_of("sinusoidal", "decoder_only", random_positions=8, max_len=32)
    with pytest.raises(ValueError, match=r"draw 11 positions a row .* \[0, random_positions=8\)"):
        decoding.decoding_positions(small, jax.random.key(0), jnp.asarray(inputs), L)
    # A decoder-only step takes no positions: they are in its cache.
    dec = config_of("sinusoidal", "decoder_only")
    dec_model, dec_params = Transformer(dec), fill_params(dec, seed=0)
    cache = decoding.prefill_prompt(dec_model, dec_params, jnp.asarray(inputs), L)
    with pytest.raises(ValueError, match="positions in its cache"):
        decoding.decode_step(
            dec_model, dec_params, cache, inputs, jnp.zeros((B, 1), jnp.int32),
            targets_positions=jnp.zeros((B, L), jnp.int32),
        )  # fmt: skip
