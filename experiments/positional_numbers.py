"""The positional ablation: every scheme x seeds on the local `numbers` task.

    jattn ablate --config experiments/positional.py --workdir runs/positional
    jattn ablate --config experiments/positional.py:quick --workdir /tmp/pos  # a few minutes
    jattn ablate --config experiments/positional.py --workdir runs/positional --emit slurm

The main job of the README: trains `configs/numbers.py` (digits -> German
number words, characters as tokens) once per positional scheme and seed on
the CPU, then compares exact match and chrF on the validation split (1-6
digit numbers, as in training) and on `test_longer` (7-8 digits, never seen),
plus loss curves and accuracy against input length.

`:arg` picks a preset: "" (the full grid), "quick" (fewer steps, for a fast
look), "tiny" (two schemes, one seed, a few steps: the tests).
"""

import ml_collections

SCHEMES = "none,sinusoidal,learned,shaw,sinusoidal+shaw,rope,alibi,t5"


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.base = "configs/numbers.py"
    # Steps, evaluation, checkpoints and row lengths as tuned in configs/numbers.py
    # (800 steps: about a minute a run on 2 CPU cores; encoder rows of 16 tokens,
    # decoder rows of 64, which both datasets below fit); `train` overrides them.
    c.train = ml_collections.ConfigDict()
    c.train.dataset = "numbers"  # or "numbers/de_millions": round millions in training
    c.train.progress_bar = True

    c.grid = ml_collections.ConfigDict()
    c.grid.position = ml_collections.ConfigDict({"key": "model.position", "values": SCHEMES})
    c.grid.seed = ml_collections.ConfigDict({"key": "seed", "values": "0,1"})

    c.metrics = (
        "eval/validation/exact_match",
        "eval/validation/chrf",
        "eval/test_longer/exact_match",
        "eval/test_longer/chrf",
        "train/loss",
        "num_params",
        "train/steps_per_sec",
    )

    if arg == "quick":
        c.train.num_train_steps = 300
        c.train.eval_every_steps = 300
        c.train.checkpoint_every_steps = 300
    elif arg == "tiny":
        c.train.num_train_steps = 6
        c.train.eval_every_steps = 6
        c.train.checkpoint_every_steps = 3
        c.train.eval_decode_examples = 8
        c.train.eval_max_batches = 1
        c.train.progress_bar = False
        c.grid.position.values = "sinusoidal,shaw"
        c.grid.seed.values = "0"
    elif arg:
        raise ValueError(f"experiments/positional.py: unknown preset {arg!r} (quick, tiny)")
    return c
