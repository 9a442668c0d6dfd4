"""`benchmarks/train.py --peak`: the step against the matmul rate, and the profile's classifier."""

import os
import re
import runpy
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _profile  # noqa: E402


def _rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows of `text`: first cell -> the other cells."""
    out = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            out[cells[0]] = cells[1:]
    return out


def test_peak_prints_ratio_flops_and_a_breakdown_within_the_step(capsys):
    """The smoke config with one tiny round: the measures table has a positive
    flop count and ratio, every category has a row, the shares add up to at
    most 100% (they cover the traced window), and the largest cost that is not
    arithmetic is named from the categories that are not."""
    main = runpy.run_path(str(REPO / "benchmarks" / "train.py"))["main"]
    spec = str(REPO / "configs" / "smoke.py")
    argv = ["--peak", "--config", spec, "--steps", "2", "--rounds", "1"]
    assert main([*argv, "--matmul-size", "64", "--profile-steps", "2"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert float(rows["step flops (XLA cost analysis)"][0].split()[0]) > 0
    ratio = float(rows["ratio (step flop rate / matmul rate)"][0])
    assert ratio > 0
    assert "fp32 matmul 64x64 @ 64x64 (fastest of 1)" in rows
    shares = {c: float(rows[c][1].rstrip("%")) for c in _profile.CATEGORIES}
    assert all(v >= 0 for v in shares.values())
    assert 50 < sum(shares.values()) <= 100.0 + 0.05 * len(shares)  # rounding of each row
    # The smoke model has dense and attention matmuls and dropout: each shows up.
    for cat in (_profile.DENSE, _profile.ATTN_DOT, _profile.DROPOUT):
        assert float(rows[cat][0]) > 0, cat
    named = re.search(r"largest cost that is not arithmetic: (.*) \(", out).group(1)
    assert named in _profile.CATEGORIES and named not in _profile.ARITHMETIC
    assert "load average (1 min):" in out


def test_peak_needs_a_config(capsys):
    main = runpy.run_path(str(REPO / "benchmarks" / "train.py"))["main"]
    with pytest.raises(SystemExit) as e:
        main(["--peak"])
    assert e.value.code == 2
    assert "--peak needs --config" in capsys.readouterr().err
    spec = str(REPO / "configs" / "smoke.py")
    with pytest.raises(SystemExit) as e:
        main(["--peak", "--config", spec, "--config.model.nope=1"])
    assert e.value.code == 2
    assert "unknown config key 'nope'" in capsys.readouterr().err


def test_classifier_reads_dots_random_bits_and_layout_from_compiled_hlo():
    """A compiled function with a matmul, a dropout-style draw and a transpose:
    the parsed module's dot is a dense matmul, the fusions drawing the bits are
    dropout bits, and a fused op's category shares add up to one."""

    def f(x, w, key):
        y = jnp.einsum("bd,de->be", x, w)  # [B, E]
        keep = jax.random.bernoulli(key, 0.9, y.shape)
        return jnp.where(keep, y, 0.0).T + 1.0

    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
    text = jax.jit(f).lower(x, w, jax.random.key(0)).compile().as_text()
    instructions, computations = _profile.parse_hlo(text)
    dots = [i for i in instructions.values() if i.opcode == "dot"]
    assert dots and all(_profile.leaf_category(d) == _profile.DENSE for d in dots)
    entry = computations[next(c for c in computations if c.startswith("main"))]
    cats = set()
    for name in entry:
        shares = _profile.op_shares(instructions[name], instructions, computations)
        assert sum(shares.values()) == pytest.approx(1.0)
        cats |= set(shares)
    assert _profile.DROPOUT in cats


def test_exclusive_time_subtracts_nested_events_and_union_merges_overlaps():
    # A while loop [0, 100) holding two body ops; a separate op after it.
    events = [(0, 100, "while"), (10, 30, "a"), (40, 90, "b"), (120, 130, "c")]
    excl = {name: t for _, _, name, t in _profile._exclusive(events)}
    assert excl == {"while": 30, "a": 20, "b": 50, "c": 10}
    assert _profile._union([(0, 10), (5, 20), (30, 40)]) == 30
    assert _profile._union([]) == 0


def test_breakdown_without_a_trace_says_so(tmp_path):
    with pytest.raises(RuntimeError, match="no \\*.xplane.pb"):
        _profile.breakdown(str(tmp_path), "", "jit_f", 1)
    assert not os.listdir(tmp_path)
