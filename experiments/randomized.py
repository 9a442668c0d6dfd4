"""Do randomised positions (Ruoss et al. 2023) carry reversing past the trained lengths?

    jattn ablate --config experiments/randomized.py --workdir runs/randomized
    jattn ablate --config experiments/randomized.py:tiny --workdir /tmp/rand  # the tests

Ruoss et al. ("Randomized Positional Encodings Boost Length Generalization
of Transformers") train each sequence with positions drawn as a sorted
random sample of [0, M), M much longer than any training sequence, so that
the positions of longer test inputs are ones the model has already seen;
they report +12.0% test accuracy on average over their 15 tasks. This grid
asks the same of `configs/reverse_digits.py` (1-16 digits in training,
17-24 in `test_longer`): six schemes (sinusoidal, learned, RoPE, ALiBi, T5,
FIRE), each trained with plain positions (`random=0`) and with
`model.random_positions=128` (M = 128 > the 25 tokens of the longest test
target; the learned table gets 128 rows in both arms), 3 seeds each.

The random arm is evaluated with random positions too, as Ruoss et al. do
(`model.random_positions_eval=True`: the teacher-forced metrics and greedy
and beam decoding draw them; it acts only where random_positions = M > 0,
so the plain arm is evaluated at plain positions). A randomised model
evaluated at plain positions (`--config.train.model.random_positions_eval=false`)
meets positions it never trained on and collapses even on validation.

36 runs of 800 steps: 19 min 46 s on 2 CPU cores (docs/results.md, "Randomised
positions"); a randomised run trains at 0.82-1.00x a plain run's steps per
second. At 800 steps the randomised runs have not learned the training
lengths yet (validation 0.18-0.80). The report gives, per group, the mean
exact match with a 95% interval over the seeds, whether it differs beyond
noise from its own scheme's plain arm, and each run's k/N with a Wilson
interval. `:arg`: "" (the grid), "tiny" (two
schemes, one seed, a few steps: the tests).
"""

import pathlib
import runpy

import ml_collections

_presets = runpy.run_path(str(pathlib.Path(__file__).with_name("_presets.py")))
grid_experiment, length_metrics, tiny, train_steps = (
    _presets[n] for n in ("grid_experiment", "length_metrics", "tiny", "train_steps")
)

SCHEMES = "sinusoidal,learned,rope,alibi,t5,fire"
M = 128


def get_config(arg=None):
    c = grid_experiment(
        "configs/reverse_digits.py",
        steps=800,
        # Group names list the axes in config order: "position=...,random=...".
        reference="position=sinusoidal,random=0",
        metrics=length_metrics("accuracy", speed=False),
        position=("model.position", SCHEMES),
        random=("model.random_positions", f"0,{M}"),
    )
    # The learned table must hold every position a randomised run can draw.
    # The random arm is evaluated at random positions too, as Ruoss et al. do
    # (acts only where random_positions = M > 0: the plain arm is unchanged).
    c.train.model = ml_collections.ConfigDict({"max_len": M, "random_positions_eval": True})
    # The claim is per scheme: each group against its own scheme's plain arm.
    c.reference_within = "position"
    if arg == "tiny":
        tiny(c, dataset="reverse_digits/tiny", steps=4, checkpoint_every=4, position="rope,fire")
        c.reference = "position=rope,random=0"
    elif arg:
        raise ValueError(f"experiments/randomized.py: unknown preset {arg!r} (tiny)")
    return c
