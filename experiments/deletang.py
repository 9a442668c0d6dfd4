"""Delétang et al. 2023 / Ruoss et al. 2023 on their own terms: an encoder-only
Transformer with an output tape, plain against randomised positions.

    jattn ablate --config experiments/deletang.py --workdir runs/deletang --jobs 2
    jattn ablate --config experiments/deletang.py:tiny --workdir /tmp/del  # the tests

Ruoss et al. ("Randomized Positional Encodings Boost Length Generalization
of Transformers") train Delétang et al.'s encoder-only model (5 layers,
width 64, 8 heads; the input, then an output tape of blank cells, every
output token predicted at once) on the 15 tasks of "Neural Networks and the
Chomsky Hierarchy", lengths 1-40, and test on 41-500, scoring per-token
accuracy averaged over test lengths, best of 10 seeds; randomised positions
raise it by 12.0% on average. This grid asks the same of
`configs/chomsky.py` with `model.architecture="encoder_only"`.

Scaled to this machine, and saying which: one task per level of the
hierarchy, chosen before any result (regular: even_pairs; deterministic
context-free: reverse_string; context-sensitive: duplicate_string), each
under its own config (``configs/chomsky.py:{task}``: its own row lengths;
until 2026-12-04 every task had duplicate_string's, the longest); the
`test100` data (test lengths 41-100, not 41-500); the paper's model;
`STEPS` steps of batch 128 (their example script trains 10,000, the paper
1,000,000); 3 seeds (not 10). The schemes: sinusoidal, RoPE, ALiBi, T5 and
learned, each with plain positions and with `random_positions` = M = 512
(sorted samples of [0, 512): the longest test stream, duplicate_string's
101 input tokens and 201 tape cells, fits; `model.max_len` = M in both arms,
so the learned table has the same rows), and NoPE ("none") as the
reference (its random arm must equal its plain one: it reads no positions).
Every run is evaluated with its own kind of positions (`random_positions_eval`), as Ruoss et al. do.

Cost, measured 2026-12-02 on this 2-core machine under load 9 (a
duplicate_string run of 60 steps, `configs/chomsky.py:duplicate_string,test100`
encoder-only): 0.06-0.09 steps/s, about 4.2 CPU-seconds a step (rows of 41
input and 81 target tokens, 128 a step). Quiet, one core a run (2026-12-03,
600-step probes with each task's own config: docs/results/deletang_probe/):
even_pairs 0.45-0.6 s a step, reverse_string 1.0-1.1 s; neither fits its
training lengths at 600 steps (validation exact match 0.64 and 0.29). A
reverse_string pair (sinusoidal, plain and random, one seed, 3,000 steps,
2026-12-04: docs/results.md, "On their terms: one pair and the cost of the
grid"; docs/results/deletang_reverse/) fitted the plain arm at 2,000-3,000
steps and left the random arm short (validation exact match 0.56). At that
budget the grid's 108 runs are about 100 CPU-hours here: it is written down
to be run where the compute is (`--emit slurm`), and was not run whole
here. Its reverse_string slice was (one seed, all six schemes, both arms,
3,000 steps; 2026-12-04: docs/results.md, "On their terms: reverse_string,
six schemes", with its command).

The report gives token accuracy on `test_longer` (the teacher-forced
accuracy is the prediction: an encoder-only model reads no targets) and
exact match, each group's mean with its 95% interval and its best seed;
its "As the anchors report" section adds their score, token accuracy per
test length averaged over the lengths (`beyond_train/length_avg_accuracy`),
beside the same pooled over tokens.
`:arg`: "" (the grid), "reverse" (its reverse_string slice at Ruoss et al.'s
example script's 10,000 steps, all six schemes, both arms, 3 seeds: 36 runs, for
one GPU, `scripts/gpu_window.sh OUTDIR --grid`; evaluated every 2,000 steps),
"tiny" (one task, two schemes, one seed, a few steps: the tests).
"""

import pathlib
import runpy

import ml_collections

_presets = runpy.run_path(str(pathlib.Path(__file__).with_name("_presets.py")))
grid_experiment, length_metrics, tiny, train_steps = (
    _presets[n] for n in ("grid_experiment", "length_metrics", "tiny", "train_steps")
)

TASKS = "even_pairs/test100,reverse_string/test100,duplicate_string/test100"
SCHEMES = "none,sinusoidal,rope,alibi,t5,learned"
M = 512
STEPS = 1_000
REVERSE_STEPS = 10_000


def get_config(arg=None):
    c = grid_experiment(
        # Each task's own config (its row lengths), named by the task axis's value.
        "configs/chomsky.py:{task}",
        steps=STEPS,
        reference="task=even_pairs/test100,position=none,random=0",
        metrics=length_metrics("accuracy"),
        task=("dataset", TASKS),
        position=("model.position", SCHEMES),
        random=("model.random_positions", f"0,{M}"),
    )
    c.train.model = ml_collections.ConfigDict(
        {"architecture": "encoder_only", "random_positions_eval": True, "max_len": M}
    )
    c.train.eval_decode_examples = 200
    # Each randomised group against its own scheme's and task's plain arm.
    c.reference_within = "task,position"
    if arg == "reverse":
        c.grid.task.values = "reverse_string/test100"
        c.reference = "task=reverse_string/test100,position=none,random=0"
        train_steps(c, REVERSE_STEPS, checkpoint_every=1_000)
        c.train.eval_every_steps = 2_000
    elif arg == "tiny":
        tiny(c, dataset=None, steps=4, checkpoint_every=4, position="rope,t5")
        c.grid.task.values = "reverse_string/tiny"
        c.reference = "task=reverse_string/tiny,position=rope,random=0"
    elif arg:
        raise ValueError(f"experiments/deletang.py: unknown preset {arg!r} (reverse, tiny)")
    return c
