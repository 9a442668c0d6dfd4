"""What the ablation grids of experiments/ share (a helper: `jattn configs` skips `_` files).

Each grid is a base config, overrides for every run (`train`), axes
(`grid`), a reference group and the metrics of its report
(`jattn.analysis.grid`). `grid_experiment` builds that skeleton,
`length_metrics` gives the usual report columns, `train_steps` a run's
length (evaluated and checkpointed at its end) and `tiny` the tests'
preset: a few steps, eight decoded examples, one seed. An experiment file
is loaded by path, so it reads this one with `runpy.run_path`.
"""

import ml_collections

SEEDS = "0,1,2"


def length_metrics(accuracy: str, *, speed: bool = True) -> tuple[str, ...]:
    """The report's metrics of a length-generalisation grid: exact match on
    `test_longer` (compared with the reference), its teacher-forced sequence
    accuracy (Ontañón et al.'s score; a run evaluated before it existed has
    none, and the report leaves the column out), exact match on validation,
    the share of the right length, `test_longer`'s
    `accuracy` (token accuracy, or "beyond_train/accuracy" past the training
    lengths), loss, size and (with `speed`) steps per second."""
    found = (
        "eval/test_longer/exact_match",
        "eval/test_longer/tf_sequence_accuracy",
        "eval/validation/exact_match",
        "eval/test_longer/length_match",
        f"eval/test_longer/{accuracy}",
        "train/loss",
        "num_params",
    )
    return found + (("train/steps_per_sec",) if speed else ())


def grid_experiment(
    base: str, *, metrics: tuple, reference: str, steps: int | None = None, **axes
) -> ml_collections.ConfigDict:
    """The skeleton of one grid.

    Args:
      base: the base config spec (``configs/X.py[:arg]``).
      metrics: the report's metrics.
      reference: the group differences are tested against.
      steps: every run's training steps (None: the base config's).
      **axes: axis name -> `(config key, comma-separated values)`, in the
        order group names list them; a `seed` axis over `SEEDS` follows
        unless one is given.

    Returns:
      the experiment config, `train.progress_bar` on.
    """
    c = ml_collections.ConfigDict()
    c.base = base
    c.train = ml_collections.ConfigDict()
    if steps is not None:
        train_steps(c, steps)
    c.train.progress_bar = True
    c.grid = ml_collections.ConfigDict()
    for name, (key, values) in {**axes, "seed": axes.get("seed", ("seed", SEEDS))}.items():
        c.grid[name] = ml_collections.ConfigDict({"key": key, "values": values})
    c.reference = reference
    c.metrics = metrics
    return c


def train_steps(c: ml_collections.ConfigDict, steps: int, checkpoint_every: int | None = None):
    """Every run trains `steps` steps and is evaluated at the last one."""
    c.train.num_train_steps = steps
    c.train.eval_every_steps = steps
    c.train.checkpoint_every_steps = checkpoint_every or steps


def tiny(
    c: ml_collections.ConfigDict,
    *,
    dataset: str | None,
    steps: int = 6,
    checkpoint_every: int = 3,
    eval_batch_size: int | None = 16,
    **values: str,
) -> None:
    """The tests' preset, in place: `steps` steps on `dataset` (None: the
    grid's), eight examples decoded from one batch, one seed, no progress
    bar; `values` gives an axis its values (``position="none,t5"``)."""
    if dataset is not None:
        c.train.dataset = dataset
    train_steps(c, steps, checkpoint_every)
    c.train.eval_decode_examples = 8
    c.train.eval_max_batches = 1
    if eval_batch_size is not None:
        c.train.eval_batch_size = eval_batch_size
    c.train.progress_bar = False
    for axis, axis_values in values.items():
        c.grid[axis].values = axis_values
    c.grid.seed.values = "0"
