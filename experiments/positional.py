"""The main job: which positional scheme carries reversing past the lengths it saw?

    jattn ablate --config experiments/positional.py --workdir runs/positional
    jattn ablate --config experiments/positional.py:duplicate --workdir runs/positional_dup
    jattn ablate --config experiments/positional.py:quick --workdir /tmp/pos  # a few minutes
    jattn ablate --config experiments/positional.py --workdir runs/positional --emit slurm

Trains `configs/reverse_digits.py` (Ontañón et al. 2022's reversing: digit
strings of 1-16 digits in training, 17-24 in `test_longer`) once per
positional scheme and seed on the CPU, and compares sequence exact match on
validation (1,024 strings of the training lengths) and on `test_longer`
(1,024 longer strings). Every `test_longer` target is made of digits that
training targets show (the run's data check says 100% producible), so a 0
there is the model's failure, not the data's. Every run is evaluated at its
last step; nothing is selected on validation.

The report gives, per scheme, the mean exact match with a 95% interval over
the 3 seeds, each run's k/N with a Wilson interval, which differences from the
sinusoidal baseline (the paper's scheme) are within noise, and exact match
against input length with the training lengths shaded.

`:arg` picks a preset: "" (reversing, every scheme, 3 seeds), "duplicate"
(the same grid on duplication, rows of 96 tokens: 25 min 38 s here, over the
20-minute aim; only T5 extrapolates, README "Duplication"), "quick" (fewer
steps and seeds, for a fast look), "tiny" (two schemes, one seed, a few steps: the tests). The Shaw
variants of Ontañón et al. (key/bias terms, rel2) are `experiments/shaw_variants.py`;
the earlier grid on German number words is `experiments/positional_numbers.py`.
"""

import ml_collections

SCHEMES = "none,sinusoidal,learned,shaw,sinusoidal+shaw,rope,alibi,t5"


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.base = "configs/reverse_digits.py"
    # Evaluation and row lengths as tuned in configs/reverse_digits.py; `train`
    # overrides them for every run. 1,200 steps (the config trains 1,500) keep
    # the main job within 20 minutes on 2 CPU cores.
    c.train = ml_collections.ConfigDict()
    c.train.num_train_steps = 1200
    c.train.eval_every_steps = 1200
    c.train.checkpoint_every_steps = 1200
    c.train.progress_bar = True

    c.grid = ml_collections.ConfigDict()
    c.grid.position = ml_collections.ConfigDict({"key": "model.position", "values": SCHEMES})
    c.grid.seed = ml_collections.ConfigDict({"key": "seed", "values": "0,1,2"})
    # Differences are tested against this group ("within noise" or not).
    c.reference = "position=sinusoidal"

    c.metrics = (
        "eval/test_longer/exact_match",
        "eval/validation/exact_match",
        "eval/test_longer/length_match",
        "eval/test_longer/accuracy",
        "train/loss",
        "num_params",
        "train/steps_per_sec",
    )

    if arg == "duplicate":
        c.train.dataset = "duplicate_digits"
        c.train.max_len = 96  # targets are twice the inputs: up to 33 tokens in training
        c.train.eval_max_len = 64
        c.train.model = ml_collections.ConfigDict({"max_len": 96})
    elif arg == "quick":
        c.train.num_train_steps = 600
        c.train.eval_every_steps = 600
        c.train.checkpoint_every_steps = 600
        c.grid.seed.values = "0"
    elif arg == "tiny":
        c.train.dataset = "reverse_digits/tiny"
        c.train.num_train_steps = 6
        c.train.eval_every_steps = 6
        c.train.checkpoint_every_steps = 3
        c.train.eval_decode_examples = 8
        c.train.eval_max_batches = 1
        c.train.eval_batch_size = 16
        c.train.progress_bar = False
        c.grid.position.values = "sinusoidal,shaw"
        c.grid.seed.values = "0"
    elif arg:
        raise ValueError(
            f"experiments/positional.py: unknown preset {arg!r} (duplicate, quick, tiny)"
        )
    return c
