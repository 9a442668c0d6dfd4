"""The rule `implementation=None` follows (`jattn.attention.rule`), branch by
branch, on the CPU: the platform is an argument of the pure function, so the
GPU branches are reached by naming a GPU. Also: what the entry point reads of
a call, that it runs the rule's choice and says so once per path, and that
every configuration in `VERIFIED` names a committed, passing GPU check."""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import make_problem

import jattn
from jattn import positions
from jattn.attention import call_features, rule
from jattn.score_mod import ScoreMod

REPO = pathlib.Path(__file__).resolve().parent.parent


def gpu_call(dtype="bfloat16", t=1024, s=1024, h=128, hv=None, bn=32, features=(), mod=""):
    """A call large enough that a GPU wants a kernel for it (B*N*T*S >= 2^20)."""
    return rule.Call(t, s, h, hv or h, bn, dtype, frozenset(features), mod)


def verified(family, dtype, h, features, mod=""):
    config = rule.KernelConfig(family, dtype, h, tuple(sorted(features)), mod)
    return (rule.Verified(config, "docs/gpu_runs/x.csv", "check/x", "H100"),)


# -- CPU and TPU: xla or chunked by size, never a kernel --------------------------------


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_cpu_and_tpu_pick_xla_small_and_chunked_large(platform):
    small = rule.choose(gpu_call(t=512, s=1024, bn=1024), platform)
    assert (small.name, small.wanted) == ("xla", None)
    large = rule.choose(gpu_call(t=1024, s=1024, bn=1), platform)
    assert (large.name, large.wanted) == ("chunked", None)
    # Even a "verified" kernel configuration is not used off a GPU.
    allowed = verified("cudnn", "bfloat16", 128, ())
    assert rule.choose(gpu_call(t=1024, s=1024), platform, allowed).name == "chunked"


def test_tpu_says_its_kernels_never_ran():
    assert "never ran on a TPU" in rule.choose(gpu_call(), "tpu").reason


# -- GPU: launch bound -> xla -------------------------------------------------------------


@pytest.mark.parametrize("platform", ["gpu", "cuda", "rocm"])
def test_gpu_small_call_is_xla_whatever_its_features(platform):
    call = gpu_call(dtype="float32", t=64, s=64, h=16, bn=255, features=("shaw", "dropout"))
    assert call.batch_heads * call.t * call.s < rule.GPU_SMALL_LOGITS
    choice = rule.choose(call, platform, verified("pallas", "float32", 16, ("dropout", "shaw")))
    assert (choice.name, choice.wanted) == ("xla", None)
    assert "launch bound" in choice.reason


# -- GPU: the wanted kernel, routed around while unverified -------------------------------


@pytest.mark.parametrize(
    ("features", "t", "expect"),
    [
        ((), 512, "xla"),
        (("causal",), 1024, "chunked"),
        (("causal", "lengths", "window"), 1024, "chunked"),
        (("mask",), 512, "xla"),
        (("bias",), 512, "xla"),
    ],
)
def test_gpu_call_that_fits_cudnn_wants_it_and_is_routed_around(features, t, expect):
    call = gpu_call(t=t, s=1024, features=features)
    choice = rule.choose(call, "gpu")  # VERIFIED: empty
    assert choice.name == expect
    assert choice.wanted == rule.KernelConfig("cudnn", "bfloat16", 128, tuple(sorted(features)))
    line = choice.message(call, "gpu")
    assert f"-> '{expect}'" in line and "would have used cudnn bfloat16 head dim 128" in line
    assert "has not passed the float64 check on a GPU" in line


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (dict(dtype="float32"), "bf16/fp16, not float32"),
        (dict(h=12), "multiples of 8"),
        (dict(h=256), "multiples of 8 up to 128"),
        (dict(hv=64), "equal key and value head dims"),
        (dict(features=("segments",)), "cannot take segments"),
        (dict(features=("causal", "shaw")), "cannot take shaw"),
        (dict(features=("score_mod",)), "cannot take score_mod"),
        (dict(features=("dropout",)), "cannot take dropout"),
        (dict(features=("positions",)), "cannot take positions"),
        (dict(features=("window", "window_right")), "cannot take window_right"),
        (dict(features=("traced_scale",)), "cannot take traced_scale"),
        (dict(features=("bias",), t=1023), "even lengths"),
    ],
)
def test_gpu_call_with_a_feature_cudnn_lacks_wants_pallas(change, why):
    call = gpu_call(**change)
    choice = rule.choose(call, "gpu")
    assert choice.wanted.family == "pallas" and choice.name in ("xla", "chunked")
    assert why in rule.cudnn_misfit(call, "gpu")
    assert why in choice.message(call, "gpu")


def test_rocm_has_no_cudnn():
    choice = rule.choose(gpu_call(), "rocm")
    assert choice.wanted.family == "pallas"


def test_gpu_fallback_tiles_when_all_logits_would_not_fit():
    call = gpu_call(t=512, s=512, bn=1024)  # 2^28 logits over all heads, 2^18 per head
    assert call.t * call.s < rule.CHUNKED_MIN_LOGITS
    assert rule.choose(call, "gpu").name == "chunked"
    assert rule.choose(call, "cpu").name == "xla"  # the CPU rule is per head, as before


# -- GPU: a verified configuration runs, exactly that configuration -------------------------


def test_verified_cudnn_configuration_is_used():
    call = gpu_call(features=("causal",))
    choice = rule.choose(call, "gpu", verified("cudnn", "bfloat16", 128, ("causal",)))
    assert (choice.name, choice.wanted) == ("cudnn", None)
    assert "verified on a GPU" in choice.reason


def test_verified_pallas_configuration_is_used():
    call = gpu_call(dtype="float32", h=16, features=("causal", "segments"))
    choice = rule.choose(call, "cuda", verified("pallas", "float32", 16, ("segments", "causal")))
    assert choice.name == "pallas"


@pytest.mark.parametrize(
    "other",
    [dict(dtype="float16"), dict(h=64), dict(features=("causal", "mask"))],
)
def test_a_verified_configuration_covers_no_other(other):
    allowed = verified("cudnn", "bfloat16", 128, ("causal",))
    call = gpu_call(**{"features": ("causal",), **other})
    choice = rule.choose(call, "gpu", allowed)
    assert choice.name != "cudnn" and choice.wanted is not None


def test_call_rejects_unknown_features():
    with pytest.raises(ValueError, match="unknown features"):
        rule.Call(8, 8, 8, 8, 1, "float32", frozenset({"alibi"}))
    with pytest.raises(ValueError, match="without the score_mod feature"):
        rule.Call(8, 8, 8, 8, 1, "float32", frozenset({"causal"}), "alibi (per logit)")


# Each score mod is its own kernel code, and so is each form of one (distance tiles at
# default positions, per logit with packed or given positions): a GPU pass of ALiBi's
# cell admits ALiBi in that form, not T5, and not ALiBi in the other form.
ALIBI_PACKED = rule.mod_form("alibi", distance=False)


@pytest.mark.parametrize(
    "mod, admitted",
    [
        (ALIBI_PACKED, True),
        (rule.mod_form("alibi", distance=True), False),
        (rule.mod_form("t5", distance=False), False),
    ],
)
def test_a_verified_score_mod_covers_that_mod_in_that_form_alone(mod, admitted):
    features = ("causal", "score_mod", "segments")
    allowed = verified("pallas", "float32", 16, features, ALIBI_PACKED)
    call = gpu_call(dtype="float32", h=16, features=features, mod=mod)
    choice = rule.choose(call, "gpu", allowed)
    assert (choice.name == "pallas") == admitted
    if not admitted:
        message = choice.message(call, "gpu")
        assert choice.wanted.score_mod == mod and f"causal+score_mod+segments [{mod}] (" in message


# -- the entry point: what it reads, what it runs, what it says -----------------------------


def test_call_features_reads_every_argument():
    q = np.zeros((2, 6, 4, 8), np.float32)
    k = v = np.zeros((2, 5, 2, 8), np.float32)
    seg = np.ones((2, 6), np.int32)
    kw = dict(
        is_causal=True,
        q_segment_ids=seg,
        kv_segment_ids=seg[:, :5],
        q_positions=np.zeros((2, 6), np.int32),
        local_window_size=(3, 2),
        key_value_seq_lengths=np.array([5, 4]),
        relative=jattn.ShawRelative(key=np.zeros((5, 8), np.float32), max_distance=2),
        score_mod=ScoreMod(lambda p, s, *_: s, ()),
        row_col_bias=(np.zeros((2, 4, 6), np.float32), np.zeros((2, 4, 5), np.float32)),
        dropout_rate=0.1,
        scale=0.5,
    )
    vis, rest = jattn.visibility.split_keywords(kw)
    call = call_features(
        q, k, v, np.zeros((1, 1, 6, 5)), np.ones((1, 1, 6, 5), bool), visibility=vis, **rest
    )
    assert (call.t, call.s, call.head_dim, call.value_head_dim, call.batch_heads) == (6, 5, 8, 8, 8)
    assert call.dtype == "float32"
    assert call.features == set(rule.FEATURES) - {"window_right", "traced_scale"}
    window = jattn.Visibility(local_window_size=2)
    bare = call_features(q[0].astype(jnp.bfloat16), k[0], v[0], visibility=window)
    assert bare.batch_heads == 4 and bare.dtype == "bfloat16"
    assert bare.features == {"window", "window_right"}  # an int window reaches right too
    assert call.score_mod == "<lambda> (per logit)" and bare.score_mod == ""
    seen = []
    jax.jit(lambda sc: seen.append(call_features(q, k, v, scale=sc).features))(0.5)
    assert seen == [{"traced_scale"}]


def test_call_features_names_the_mod_and_the_form_its_kernels_take():
    """A distance mod runs from distance tiles at default positions (none given, or
    `default_positions`), per logit at given positions; any other mod per logit."""
    q = k = v = np.zeros((2, 6, 2, 8), np.float32)
    t5 = positions.t5_score_mod(np.zeros((2, 8), np.float32))
    alibi = positions.alibi_score_mod(positions.alibi_slopes(2), mode="causal")  # per logit
    pos = np.arange(6, dtype=np.int32)
    cases = [
        (t5, {}, "t5 (distance tiles)"),
        (t5, dict(q_positions=pos, kv_positions=pos), "t5 (per logit)"),
        (alibi, {}, "alibi_causal (per logit)"),  # each mode its own code
        (ScoreMod(lambda p, s, *_: s, (), name="mine"), {}, "mine (per logit)"),
    ]
    for mod, given, expect in cases:
        vis, rest = jattn.visibility.split_keywords(dict(is_causal=True, **given))
        assert call_features(q, k, v, visibility=vis, score_mod=mod, **rest).score_mod == expect
    # What `normalised` marks as default positions is distance tiles too.
    vis = jattn.Visibility(q_positions=pos, kv_positions=pos, default_positions=True)
    assert call_features(q, k, v, visibility=vis, score_mod=t5).score_mod == "t5 (distance tiles)"


def test_none_runs_the_rules_choice():
    q, k, v = make_problem(3, 2, 16, 16, 4, 2, 8)
    assert jattn.default_implementation(q, k, v, is_causal=True) == "xla"
    assert jattn.default_implementation(q, k, v, is_causal=True, platform="gpu") == "xla"
    out = jattn.dot_product_attention(q, k, v, is_causal=True)
    ref = jattn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_announce_says_each_path_once_and_warns_when_routed_around(caplog):
    seen: set = set()
    routed_call = gpu_call(features=("causal",))
    routed = rule.choose(routed_call, "gpu")
    plain_call = gpu_call(t=8, s=8, bn=1)
    plain = rule.choose(plain_call, "gpu")
    with caplog.at_level(logging.INFO, logger="jattn.attention"):
        for _ in range(3):
            rule.announce(routed, routed_call, "gpu", seen)
            rule.announce(plain, plain_call, "gpu", seen)
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "jattn.attention"]
    assert [level for level, _ in records] == [logging.WARNING, logging.INFO]
    assert "would have used cudnn" in records[0][1] and "launch bound" in records[1][1]


def test_collected_paths_says_each_path_afresh_and_leaves_the_process_as_it_was(caplog):
    """What `jattn configs --paths` reads a config through: inside, a path the
    process already said is said again, into the list only; after, the
    process's once-per-path memory is what it was before."""
    before_call, inside_call = gpu_call(t=8, s=8, bn=1), gpu_call(features=("causal",), h=88)
    before, inside = rule.choose(before_call, "gpu"), rule.choose(inside_call, "gpu")
    with caplog.at_level(logging.INFO, logger="jattn.attention"):
        rule.announce(before, before_call, "gpu")  # the process's memory now holds it
        with rule.collected_paths() as lines:
            rule.announce(before, before_call, "gpu")
            rule.announce(inside, inside_call, "gpu")
            rule.announce(inside, inside_call, "gpu")
        assert len(lines) == 2 and "launch bound" in lines[0] and "H=88" in lines[1]
        caplog.clear()
        rule.announce(before, before_call, "gpu")  # still remembered: not said again
        rule.announce(inside, inside_call, "gpu")  # said inside only: said now
    said = [r.getMessage() for r in caplog.records if r.name == "jattn.attention"]
    assert len(said) == 1 and "H=88" in said[0], said


def test_a_process_prints_its_path_once(tmp_path):
    """`show_choices` (what `jattn train` calls): one stderr line per path taken,
    however many calls take it."""
    script = (
        "import jax.numpy as jnp, jattn\n"
        "from jattn.attention import rule\n"
        "rule.show_choices()\n"
        "q = jnp.ones((1, 8, 2, 4))\n"
        "for _ in range(3): jattn.dot_product_attention(q, q, q)\n"
        "big = jnp.ones((1, 1024, 1, 4))\n"
        "jattn.dot_product_attention(big, big, big, is_causal=True)\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("jattn: attention")]
    assert len(lines) == 2, proc.stderr
    assert "-> 'xla'" in lines[0] and "on cpu" in lines[0]
    assert "-> 'chunked'" in lines[1]


# -- VERIFIED: every entry names a committed, passing float64 check on a GPU ----------------


def _tracked() -> set[str]:
    out = subprocess.run(
        ["git", "ls-files", "docs/gpu_runs"], cwd=REPO, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


def test_every_verified_configuration_names_a_committed_passing_run():
    gpu_doc = (REPO / "docs" / "gpu.md").read_text()
    assert rule.verified_problems(rule.VERIFIED, REPO, _tracked(), gpu_doc) == []


def test_the_verified_check_refuses_what_no_gpu_run_shows(tmp_path):
    gpu_doc = (REPO / "docs" / "gpu.md").read_text()
    config = rule.KernelConfig("pallas", "float32", 64, ("causal", "segments"))
    h200 = "docs/gpu_runs/2026-12-04_h200.csv"
    failed = rule.Verified(config, h200, "check/f32_causal_gqa", "H200")  # FAIL in that run
    smoke = rule.Verified(config, h200, "smoke/pallas", "H200")  # ok, but no float64 check
    missing = rule.Verified(config, "docs/gpu_runs/none.csv", "check/x", "H200")
    problems = rule.verified_problems([failed, smoke, missing], REPO, _tracked(), gpu_doc)
    assert len(problems) == 3
    assert "float64 check did not pass (-: FAIL exit status 1)" in problems[0]  # no backward
    assert "no float64 check row" in problems[1]
    assert "not a committed file" in problems[2]
    # The rows the check stage writes (benchmarks/gpu.py --stage check): one per
    # backward, and in a score mods cell one set per mod (its `impl`).
    run = tmp_path / "docs" / "gpu_runs" / "run.csv"
    run.parent.mkdir(parents=True)
    rows = [
        ("f32_h64", "pallas", "split", "PASS"),
        ("f32_h64", "pallas", "fused", "PASS"),
        ("f32_h64b", "pallas", "split", "PASS"),
        ("f32_h64b", "pallas", "fused", "FAIL max_rel_err 0.3"),
        ("mods_f32", "pallas_alibi", "split", "PASS"),
        ("mods_f32", "pallas_t5", "split", "FAIL exit 1"),
    ]
    run.write_text(
        "stage,cell,impl,head_dim,causal,dtype,backward,status\n"
        + "".join(f"check,{c},{i},64,True,float32,{b},{st}\n" for c, i, b, st in rows)
        + "check,bf16_h64,pallas,64,True,bfloat16,split,PASS\n"
        + "check,cudnn_h64,cudnn,64,True,float32,-,PASS\n"
        + "check,f32_h128,pallas,128,False,float32,split,PASS\n"
    )
    doc = "gpu_runs/run.csv on one H100"
    entry = lambda cell, impl="", cfg=config: rule.Verified(
        cfg, "docs/gpu_runs/run.csv", cell, "H100", impl
    )
    alibi = dataclasses.replace(
        config,
        features=("causal", "score_mod", "segments"),
        score_mod=rule.mod_form("alibi_causal", distance=False),
    )
    good = [entry("check/f32_h64"), entry("check/mods_f32", "pallas_alibi", alibi)]
    assert rule.verified_problems(good, tmp_path, {good[0].run}, doc) == []
    assert rule.verified_problems(good, tmp_path, {good[0].run}, "no mention") != []
    # A cell with one backward failed, a mod whose rows failed beside one that passed,
    # and a mod that cell never ran: refused.
    bad = [entry("check/f32_h64b"), entry("check/mods_f32", "pallas_t5"),
           entry("check/mods_f32", "pallas_fire")]  # fmt: skip
    problems = rule.verified_problems(bad, tmp_path, {good[0].run}, doc)
    assert "did not pass (fused: FAIL max_rel_err 0.3)" in problems[0]
    assert "did not pass (split: FAIL exit 1)" in problems[1]
    assert "no float64 check row" in problems[2] and len(problems) == 3
    # An entry whose configuration is not what its cell ran (the dtype, the kernel
    # family, the head dim and causality): refused, naming what the rows say.
    t5 = dataclasses.replace(alibi, score_mod=rule.mod_form("t5", distance=False))
    mislabelled = [
        entry("check/bf16_h64"),
        entry("check/cudnn_h64"),
        entry("check/f32_h128"),
        entry("check/mods_f32", "pallas_alibi", t5),  # ALiBi's rows named as T5
        entry("check/mods_f32", "pallas_alibi"),  # ALiBi's rows named as no mod
        entry("check/f32_h64", cfg=alibi),  # a plain cell named as ALiBi
    ]
    problems = rule.verified_problems(mislabelled, tmp_path, {good[0].run}, doc)
    assert "another configuration (dtype bfloat16)" in problems[0]
    assert "another configuration (impl cudnn)" in problems[1]
    assert "another configuration (causal False, head_dim 128)" in problems[2]
    assert all("another configuration (impl pallas_alibi)" in p for p in problems[3:5])
    assert "another configuration (impl pallas)" in problems[5] and len(problems) == 6
