"""The positional ablation on German number words: every scheme x seeds on `numbers`.

    jattn ablate --config experiments/positional_numbers.py --workdir runs/positional_numbers
    jattn ablate --config experiments/positional_numbers.py:quick --workdir /tmp/pos
    jattn ablate --config experiments/positional_numbers.py --workdir runs/pn --emit slurm

Trains `configs/numbers.py` (digits -> German
number words, characters as tokens) once per positional scheme and seed on
the CPU, then compares exact match and chrF on the validation split (1-5
digit numbers, as in training) and on `test_longer` (6 digits, never seen,
but made only of word pieces training shows), plus loss curves and accuracy
against input length. `--config.train.dataset=numbers/de_7to8` is the split
of jattn before 2026-11 (test 7-8 digits), whose test targets need words
training never shows: the run's data check reports them unproducible.

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
    c.train.dataset = "numbers"
    c.train.progress_bar = True
    c.train.eval_decode_examples = 1000  # every example of each split
    c.train.eval_max_batches = 16

    c.grid = ml_collections.ConfigDict()
    c.grid.position = ml_collections.ConfigDict({"key": "model.position", "values": SCHEMES})
    c.grid.seed = ml_collections.ConfigDict({"key": "seed", "values": "0,1,2"})
    c.reference = "position=sinusoidal"

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
        raise ValueError(f"experiments/positional_numbers.py: unknown preset {arg!r} (quick, tiny)")
    return c
