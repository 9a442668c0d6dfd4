"""The visibility value (`jattn.visibility.Visibility`): built and checked once,
combined with `&` into the rule written out by hand, a pytree through jit, vmap
and shard_map, normalised once, and the same attention as the keywords it
stands for."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import make_problem
from hypothesis import given

import jattn
from jattn.masks import PAD_KV, PAD_Q
from jattn.visibility import Visibility


def test_visibility_combines_causal_segments_and_window_into_the_hand_built_mask():
    """Three values, one rule each, combined with `&`: the mask of the
    combination is the one written out by hand (causal, packed segments with
    a padding token, a window of one key to the left)."""
    seg = [1, 1, 1, 2, 2, 0]
    both = (
        Visibility(is_causal=True)
        & Visibility(q_segment_ids=[seg], kv_segment_ids=[seg])
        & Visibility(local_window_size=(1, 4))
    )
    by_hand = np.array(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 0],  # padding sees nothing
        ],
        bool,
    )
    np.testing.assert_array_equal(np.asarray(both.mask(1, 6, 6))[0], by_hand)
    assert both.is_causal and both.local_window_size == (1, 4)


def _by_hand(t, s, *, causal, window, q_seg, kv_seg, q_pos, kv_pos, q_len, kv_len):
    """The visibility rule written out per (query, key) pair, one batch row."""
    out = np.zeros((t, s), bool)
    for i in range(t):
        for j in range(s):
            ok = i < q_len and j < kv_len
            ok &= not causal or kv_pos[j] <= q_pos[i]
            if window is not None:
                ok &= q_pos[i] - window[0] <= kv_pos[j] <= q_pos[i] + window[1]
            if q_seg is not None:
                ok &= q_seg[i] == kv_seg[j] != 0
            out[i, j] = ok
    return out


windows = st.one_of(st.none(), st.tuples(st.integers(0, 4), st.integers(0, 4)))


@given(
    data=st.data(),
    t=st.integers(1, 6),
    s=st.integers(1, 6),
    causal=st.booleans(),
    w1=windows,
    w2=windows,
)
def test_visibility_and_holds_both_values_rules(data, t, s, causal, w1, w2):
    """`a & b` holds both values' rules, evaluated on the positions and ids
    of whichever value gives them: windows intersect, the shorter length
    counts."""
    q_seg = data.draw(st.lists(st.integers(0, 2), min_size=t, max_size=t))
    kv_seg = data.draw(st.lists(st.integers(0, 2), min_size=s, max_size=s))
    q_pos = data.draw(st.lists(st.integers(0, 8), min_size=t, max_size=t))
    kv_pos = data.draw(st.lists(st.integers(0, 8), min_size=s, max_size=s))
    lens = [data.draw(st.integers(0, n)) for n in (t, s, t, s)]
    a = Visibility(
        is_causal=causal,
        local_window_size=w1,
        q_positions=q_pos,
        kv_positions=kv_pos,
        query_seq_lengths=[lens[0]],
        key_value_seq_lengths=[lens[1]],
    )
    b = Visibility(
        local_window_size=w2,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        query_seq_lengths=[lens[2]],
    )
    got = np.asarray((a & b).mask(1, t, s))[0]
    np.testing.assert_array_equal(got, np.asarray((b & a).mask(1, t, s))[0])
    window = None if w1 is None else w1
    if w2 is not None:
        window = w2 if window is None else (min(window[0], w2[0]), min(window[1], w2[1]))
    want = _by_hand(
        t, s, causal=causal, window=window, q_seg=q_seg, kv_seg=kv_seg, q_pos=q_pos,
        kv_pos=kv_pos, q_len=min(lens[0], lens[2]), kv_len=lens[1],
    )  # fmt: skip
    np.testing.assert_array_equal(got, want)


def test_two_values_with_segment_ids_or_positions_do_not_combine():
    seg = Visibility(q_segment_ids=[1, 1], kv_segment_ids=[1, 1])
    with pytest.raises(ValueError, match="both values give segment ids"):
        seg & Visibility(q_segment_ids=[1, 2], kv_segment_ids=[1, 2])
    pos = Visibility(q_positions=[0, 1])
    with pytest.raises(ValueError, match="both values give q_positions"):
        pos & Visibility(q_positions=[3, 4])
    same = np.array([0, 1])
    both = Visibility(q_positions=same) & Visibility(q_positions=same, is_causal=True)
    assert both.q_positions is same and both.is_causal


@pytest.mark.parametrize(
    "fields, error, match",
    [
        ({"q_positions": jnp.zeros(3)}, TypeError, r"q_positions must be an integer array"),
        ({"kv_positions": jnp.zeros((1, 2, 3), int)}, ValueError, r"kv_positions must be \[B, T"),
        ({"query_seq_lengths": jnp.zeros((2, 2), int)}, ValueError, r"query_seq_lengths must be"),
        ({"q_segment_ids": [1, 2]}, ValueError, r"kv_segment_ids is missing"),
        ({"local_window_size": -1}, ValueError, r"local_window_size must be non-negative"),
        ({"q_positions": np.array([2**31])}, ValueError, r"q_positions holds values .* int32"),
    ],
)
def test_visibility_constructor_errors_are_one_line_naming_the_field(fields, error, match):
    with pytest.raises(error, match=match) as info:
        Visibility(**fields)
    assert "\n" not in str(info.value)


def test_visibility_is_a_pytree_with_static_rules():
    """Arrays are leaves, the rules static: the value goes through jit, vmap
    and shard_map whole, and a changed rule is a new trace (not a traced flag)."""
    v = Visibility(is_causal=True, q_positions=jnp.arange(4), kv_positions=jnp.arange(4))
    assert len(jax.tree.leaves(v)) == 2
    traces = []

    def f(v):
        traces.append(v.is_causal)
        return v.mask(1, 4, 4)

    f_jit = jax.jit(f)
    np.testing.assert_array_equal(f_jit(v), v.mask(1, 4, 4))
    f_jit(v.replace(q_positions=jnp.arange(4) + 1))  # new leaves: no new trace
    f_jit(v.replace(is_causal=False))  # a new rule: a new trace
    assert traces == [True, False]
    rows = jax.vmap(lambda p: Visibility(is_causal=True, q_positions=p).mask(1, 4, 4))(
        jnp.stack([jnp.arange(4), jnp.arange(4) + 2])
    )
    assert rows.shape == (2, 1, 4, 4) and not np.array_equal(rows[0], rows[1])
    mesh = jax.make_mesh((1,), ("data",))
    spec = jax.sharding.PartitionSpec()
    sharded = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,), out_specs=spec))
    np.testing.assert_array_equal(sharded(v), v.mask(1, 4, 4))


def test_normalised_folds_lengths_marks_padding_and_is_idempotent():
    v = Visibility(
        is_causal=True,
        q_segment_ids=jnp.array([[1, 1, 0]]),
        kv_segment_ids=jnp.array([[1, 1, 1, 0]]),
        key_value_seq_lengths=jnp.array([2]),
    )
    n = v.normalised(1, 3, 4)
    assert n.query_seq_lengths is None and n.key_value_seq_lengths is None
    np.testing.assert_array_equal(n.q_segment_ids, [[1, 1, PAD_Q]])
    np.testing.assert_array_equal(n.kv_segment_ids, [[1, 1, PAD_KV, PAD_KV]])
    np.testing.assert_array_equal(n.kv_positions, [[0, 1, 2, 3]])
    assert n.default_positions
    again = n.normalised(1, 3, 4)
    for name in ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions"):
        np.testing.assert_array_equal(getattr(again, name), getattr(n, name))
    assert again.default_positions
    np.testing.assert_array_equal(v.mask(1, 3, 4), n.mask(1, 3, 4))
    moved = n.replace(q_positions=n.q_positions + 1)
    assert not moved.default_positions


def test_the_value_and_the_keywords_give_the_same_attention():
    """`visibility=` is the keywords as one value: alone, or combined with
    keywords (here causal from a keyword, packing from the value), the
    output is the keyword call's, to the bit."""
    q, k, v = make_problem(1, 2, 6, 6, 2, 2, 4)
    seg = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 2, 2]])
    pos = jnp.array([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    keywords = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
    packed = Visibility(**keywords)
    for impl in ("xla", "chunked"):
        want = jattn.dot_product_attention(q, k, v, is_causal=True, implementation=impl, **keywords)
        value = jattn.dot_product_attention(
            q, k, v, visibility=packed & Visibility(is_causal=True), implementation=impl
        )
        both = jattn.dot_product_attention(
            q, k, v, is_causal=True, visibility=packed, implementation=impl
        )
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(both), np.asarray(want))
    other = seg.at[:, -1].set(3)  # another packing: two sets of ids do not combine
    with pytest.raises(ValueError, match="both values give segment ids"):
        jattn.dot_product_attention(
            q, k, v, visibility=packed, q_segment_ids=other, kv_segment_ids=other
        )
