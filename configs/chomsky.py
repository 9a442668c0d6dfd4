"""One of Delétang et al. (2023)'s 15 tasks with their Transformer's size.

    jattn train --config configs/chomsky.py:parity_check --workdir runs/parity
    jattn train --config configs/chomsky.py:binary_addition,rope --workdir runs/add_rope
    jattn train --config configs/chomsky.py:bucket_sort,test100 --workdir runs/sort

The tasks of `jattn.data.chomsky`: training lengths 1-40, `test_longer`
41-500 (``test100``: 41-100; ``tiny``: the tiny data set). The model is the
paper's (Delétang et al.'s `TransformerConfig`: d_model 64, 5 layers, 8
heads, d_ff 256, dropout 0.1) trained with Adam at 1e-3, batches of 128, for
their example script's 10,000 steps (the paper: 1,000,000); scale the steps
to the budget. The rows hold every example: lengths come from the task's
generator at the longest length of each split. `model.architecture` keeps
its default; the paper's encoder-only output tape is
``--config.model.architecture=encoder_only``.

`:arg` is comma-separated: one task (required: `jattn.data.chomsky.TASKS`),
optionally ``test100`` or ``tiny`` (the data set's config), and the variants
of `jattn.train.apply_variant` (a positional scheme, ...). A task may also be
named as its data set is (``reverse_string/test100`` is
``reverse_string,test100``), so that a grid whose ``task`` axis sets
``dataset`` can take each task's own config with
``base = "configs/chomsky.py:{task}"`` (`jattn.analysis.grid.run_base`).
"""

from jattn.data.chomsky import CONFIGS, TASKS
from jattn.data.chomsky_tasks import target_tokens
from jattn.train.config import apply_variant, default_config

DATA_CONFIGS = {c.name: c for c in CONFIGS}


def _is_dataset(item: str) -> bool:
    """Whether `item` names a task's data set, ``task/config``."""
    task, sep, data = item.partition("/")
    return bool(sep) and task in TASKS and data in DATA_CONFIGS


def get_config(arg=None):
    items = [s.strip() for s in (arg or "").split(",") if s.strip()]
    items = [part for s in items for part in (s.split("/", 1) if _is_dataset(s) else [s])]
    tasks = [s for s in items if s in TASKS]
    data = [s for s in items if s in DATA_CONFIGS]
    if len(tasks) != 1 or len(data) > 1:
        raise ValueError(
            f"configs/chomsky.py:<task>[,test100|tiny][,variants]: name one task of {list(TASKS)}"
            f" and at most one data config; got {items}"
        )
    (task,) = tasks
    data_config = DATA_CONFIGS[data[0] if data else "default"]
    train_max, test_max = data_config.train_lengths[1], data_config.test_lengths[1]

    c = default_config()
    c.dataset = f"{task}/{data_config.name}"
    c.max_input_len = train_max + 1
    c.max_len = target_tokens(task, train_max)
    c.batch_size = 128
    c.num_train_steps = 10_000
    c.schedule = "constant"
    c.learning_rate = 1e-3
    c.warmup_steps = 0
    c.label_smoothing = 0.0
    c.grad_clip_norm = 1.0

    c.eval_every_steps = c.checkpoint_every_steps = c.num_train_steps
    c.eval_max_input_len = test_max + 1
    c.eval_max_len = target_tokens(task, test_max)
    c.eval_batch_size = 64
    c.eval_max_batches = 0  # every example of each split
    c.eval_decode_examples = max(data_config.num_validation, data_config.num_test_longer)
    c.best_metric = ""  # the last step is evaluated, nothing is selected on validation
    c.keep_checkpoints = 1

    c.model.d_model = 64
    c.model.num_layers = 5
    c.model.num_heads = 8
    c.model.d_ff = 256
    c.model.dropout_rate = 0.1
    # Room for inputs, a separator and a tape of every target at once.
    c.model.max_len = c.eval_max_input_len + c.eval_max_len + 1
    c.model.position_options.shaw.max_distance = train_max  # the longest training length
    c.model.position = "sinusoidal"
    rest = ",".join(s for s in items if s not in tasks and s not in data)
    try:
        return apply_variant(c, rest)
    except ValueError as e:
        raise ValueError(f"{e}; or a task of configs/chomsky.py: {list(TASKS)}") from None
