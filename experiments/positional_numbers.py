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

import pathlib
import runpy

_presets = runpy.run_path(str(pathlib.Path(__file__).with_name("_presets.py")))
grid_experiment, tiny, train_steps = (
    _presets[n] for n in ("grid_experiment", "tiny", "train_steps")
)

SCHEMES = "none,sinusoidal,learned,shaw,sinusoidal+shaw,rope,alibi,t5"


def get_config(arg=None):
    # Steps, evaluation, checkpoints and row lengths as tuned in configs/numbers.py
    # (800 steps: about a minute a run on 2 CPU cores; encoder rows of 16 tokens,
    # decoder rows of 64, which both datasets below fit); `train` overrides them.
    c = grid_experiment(
        "configs/numbers.py",
        reference="position=sinusoidal",
        metrics=(
            "eval/validation/exact_match",
            "eval/validation/chrf",
            "eval/test_longer/exact_match",
            "eval/test_longer/chrf",
            "train/loss",
            "num_params",
            "train/steps_per_sec",
        ),
        position=("model.position", SCHEMES),
    )
    c.train.dataset = "numbers"
    c.train.eval_decode_examples = 1000  # every example of each split
    c.train.eval_max_batches = 16
    if arg == "quick":
        train_steps(c, 300)
    elif arg == "tiny":
        tiny(c, dataset=None, eval_batch_size=None, position="sinusoidal,shaw")
    elif arg:
        raise ValueError(f"experiments/positional_numbers.py: unknown preset {arg!r} (quick, tiny)")
    return c
