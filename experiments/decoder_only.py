"""Kazemnejad et al. (2023) in jattn: which positional scheme lets a decoder-only model copy
and reverse past the lengths it saw?

    jattn ablate --config experiments/decoder_only.py --workdir runs/decoder_only
    jattn ablate --config experiments/decoder_only.py:tiny --workdir /tmp/dec  # the tests

Kazemnejad et al., "The Impact of Positional Encoding on Length
Generalization in Transformers" (NeurIPS 2023), find for decoder-only models
NoPE ≈ T5 > ALiBi > RoPE ≈ sinusoidal beyond the training lengths. This grid
trains `configs/kazemnejad.py` (training lengths 1-20, `test_longer` 21-40,
1,000 examples, every target token shown in training) on copy and reverse,
with no positions (NoPE), T5 buckets, ALiBi, RoPE, sinusoidal and FIRE, 3 seeds
each, and reports exact match on `test_longer` with its interval, the best
seed, and exact match by length (`jattn.analysis.anchors`).

Every run is `model.architecture = "decoder_only"`: one causal stack over
the input, a separator and the target (`jattn.models.decoder_only`).

`:arg` picks a preset: "" (copy and reverse, six schemes, 3 seeds),
"data_dependent" (below), "data_dependent_long" (the forget gate and
stick-breaking against RoPE on both tasks at 3,600 steps: the two grids named
under "long" below, 18 runs, about 2.5 hours with `--jobs 2`), "long"
(NoPE and T5 on copy at 3,600 steps: is NoPE's shortfall under-training?
`--config.grid.position.values=alibi,rope
--config.reference=task=kz_copy,position=alibi` runs the same for ALiBi and
RoPE, as docs/results.md's second check did, and `=sinusoidal` its third;
`--config.grid.task.values=kz_reverse
--config.grid.position.values=rope,forgetting,stick_breaking
--config.reference=task=kz_reverse,position=rope` the schemes of the tokens on
reverse, 2026-12-07: docs/results/decoder_only_data_dependent_long/; the same
with ``kz_copy`` for both on copy, 2026-12-07, 58 min with `--jobs 2`:
docs/results/decoder_only_data_dependent_copy_long/),
"repeated" (their copy variants with repeated tokens, below), "tiny" (one
task, two schemes, one seed, a few steps: the tests).

"data_dependent" trains the schemes of the tokens, the Forgetting
Transformer's gates, CoPE and stick-breaking attention, beside NoPE, ALiBi
and RoPE on both tasks (6 schemes, 3 seeds, 1,200 steps: 36 runs), RoPE the
reference, the Transformer their papers compare with. Ran 2026-12-06 with
`--jobs 2`: 133 min 45 s on a shared 2-core Xeon, CoPE's runs the slowest
(docs/results.md, "Positions from the tokens"; docs/results/decoder_only_data_dependent/).

"repeated" is where their ALiBi falls below NoPE: on copy with one token
repeated n times (``kz_copy_rsc``: NoPE 0.986, T5 0.771, ALiBi 0.289, RoPE
and sinusoidal 0.000, mean of their 3 seeds) and with a replacement
(``kz_copy_rdc``: NoPE 0.967, T5 0.939, ALiBi 0.170), every ALiBi seed below
every NoPE seed (their results/sanity_check.jsonl: `docs/results/anchors.json`,
Kazemnejad et al.), while on random-token copy ALiBi (0.331) is above NoPE
(0.305). Their five schemes, 3 seeds, 1,200 steps, both tasks: 30 runs.
Ran 2026-12-03 with `--jobs 2`: 86 min 47 s beside a test-suite run
(docs/results.md, "Their repeated-token copy"; docs/results/decoder_only_repeated/).
(``kz_copy_rsc2x`` doubles the target, 80 tokens at test: past this config's
`eval_max_len` of 48, so it is left out.)
"""

import pathlib
import runpy

import ml_collections

_presets = runpy.run_path(str(pathlib.Path(__file__).with_name("_presets.py")))
grid_experiment, length_metrics, tiny, train_steps = (
    _presets[n] for n in ("grid_experiment", "length_metrics", "tiny", "train_steps")
)

SCHEMES = "none,t5,alibi,rope,sinusoidal,fire"


def get_config(arg=None):
    c = grid_experiment(
        "configs/kazemnejad.py",
        steps=1200,
        reference="task=kz_copy,position=sinusoidal",
        metrics=length_metrics("beyond_train/accuracy"),
        task=("dataset", "kz_copy,kz_reverse"),
        position=("model.position", SCHEMES),
    )
    c.train.model = ml_collections.ConfigDict({"architecture": "decoder_only"})
    if arg in ("long", "data_dependent_long"):
        train_steps(c, 3600)  # 3x the steps: is a shortfall under-training?
        c.train.warmup_steps = 300
    if arg == "tiny":
        tiny(c, dataset="kz_copy/tiny", task="kz_copy/tiny", position="none,t5")
        c.reference = "task=kz_copy/tiny,position=none"
    elif arg == "long":
        # Is NoPE's shortfall on copy under-training? NoPE and T5 (the paper's
        # pair) at 3x the steps, the rest as the grid.
        c.grid.task.values = "kz_copy"
        c.grid.position.values = "none,t5"
        c.reference = "task=kz_copy,position=t5"
    elif arg == "repeated":
        c.grid.task.values = "kz_copy_rsc,kz_copy_rdc"
        c.grid.position.values = "none,t5,alibi,rope,sinusoidal"
        c.reference = "task=kz_copy_rsc,position=none"
    elif arg == "data_dependent_long":
        # The forget gate and stick-breaking against RoPE at 3x the steps, on both
        # tasks (each compared on its own task): 18 runs, the two 3,600-step grids
        # of docs/results.md ("Reverse at 3,600 steps", "Copy at 3,600 steps").
        c.grid.position.values = "rope,forgetting,stick_breaking"
        c.reference = "task=kz_copy,position=rope"
    elif arg == "data_dependent":
        # The schemes of the tokens (forget gates, CoPE, stick-breaking)
        # beside NoPE, ALiBi and RoPE, on copy and reverse; RoPE is the
        # Transformer each of their papers compares against.
        c.grid.position.values = "none,alibi,rope,forgetting,cope,stick_breaking"
        c.reference = "task=kz_copy,position=rope"
    elif arg:
        raise ValueError(
            f"experiments/decoder_only.py: unknown preset {arg!r} "
            "(long, repeated, data_dependent, data_dependent_long, tiny)"
        )
    return c
