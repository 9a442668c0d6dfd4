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

36 runs of 800 steps: 19 min 46 s on 2 CPU cores (README, "Randomised
positions"); a randomised run trains at 0.85-0.99x a plain run's steps per
second. At 800 steps the randomised runs have not learned the training
lengths yet (validation 0.18-0.80). The report gives, per group, the mean
exact match with a 95% interval over the seeds, whether it differs beyond
noise from its own scheme's plain arm, and each run's k/N with a Wilson
interval. `:arg`: "" (the grid), "tiny" (two
schemes, one seed, a few steps: the tests).
"""

import ml_collections

SCHEMES = "sinusoidal,learned,rope,alibi,t5,fire"
M = 128


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.base = "configs/reverse_digits.py"
    c.train = ml_collections.ConfigDict()
    c.train.num_train_steps = 800
    c.train.eval_every_steps = 800
    c.train.checkpoint_every_steps = 800
    c.train.progress_bar = True
    # The learned table must hold every position a randomised run can draw.
    # The random arm is evaluated at random positions too, as Ruoss et al. do
    # (acts only where random_positions = M > 0: the plain arm is unchanged).
    c.train.model = ml_collections.ConfigDict({"max_len": M, "random_positions_eval": True})

    c.grid = ml_collections.ConfigDict()
    c.grid.position = ml_collections.ConfigDict({"key": "model.position", "values": SCHEMES})
    c.grid.random = ml_collections.ConfigDict({"key": "model.random_positions", "values": f"0,{M}"})
    c.grid.seed = ml_collections.ConfigDict({"key": "seed", "values": "0,1,2"})
    # Group names list the axes in config order: "position=...,random=...".
    c.reference = "position=sinusoidal,random=0"
    # The claim is per scheme: each group against its own scheme's plain arm.
    c.reference_within = "position"

    c.metrics = (
        "eval/test_longer/exact_match",
        "eval/validation/exact_match",
        "eval/test_longer/length_match",
        "eval/test_longer/accuracy",
        "train/loss",
        "num_params",
    )
    if arg == "tiny":
        c.train.dataset = "reverse_digits/tiny"
        c.train.num_train_steps = 4
        c.train.eval_every_steps = 4
        c.train.checkpoint_every_steps = 4
        c.train.eval_decode_examples = 8
        c.train.eval_max_batches = 1
        c.train.eval_batch_size = 16
        c.train.progress_bar = False
        c.grid.position.values = "rope,fire"
        c.grid.seed.values = "0"
        c.reference = "position=rope,random=0"
    elif arg:
        raise ValueError(f"experiments/randomized.py: unknown preset {arg!r} (tiny)")
    return c
