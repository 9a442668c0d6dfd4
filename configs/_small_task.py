"""The body the small CPU task configs share (not a config: `jattn configs` skips `_` files).

configs/reverse_digits.py, scan.py, numbers.py and kazemnejad.py train the
same 2+2-layer encoder-decoder of width 64 (4 heads, d_ff 256, dropout
0.1, sinusoidal positions) on packed rows of 64 target tokens, 16 rows a
step, with a cosine schedule from 3e-3 after 100 warmup steps and gradients
clipped at norm 1; they evaluate by greedy decoding, twice 512 rows, at
their last step, keep one checkpoint and select nothing on validation
(Csordás et al. 2021). `small_task` writes that once; a config passes its
task's lengths and changes what differs (numbers: a higher rate, label
smoothing, evaluation every 400 steps). A config file is loaded by path, so
it reads this one with `runpy.run_path`.
"""

from jattn.train.config import default_config


def small_task(
    *,
    dataset: str,
    tokenizer: str,
    max_input_len: int,
    num_train_steps: int,
    eval_max_len: int,
    eval_max_input_len: int,
    eval_decode_examples: int,
    model_max_len: int,
    shaw_max_distance: int,
    **changes,
):
    """A small task's config before its `:arg` variants.

    Args:
      dataset, tokenizer: the task.
      max_input_len: encoder row length in training (target rows are 64).
      num_train_steps: the run's length; it is evaluated and checkpointed at
        the end.
      eval_max_len, eval_max_input_len: evaluation row lengths (target, input).
      eval_decode_examples: examples decoded per split.
      model_max_len: the model's longest position.
      shaw_max_distance: Shaw's clipping distance (the longest distance
        in training, as in Ontañón et al.).
      **changes: top-level keys that differ from this body.

    Returns:
      an unlocked `ml_collections.ConfigDict`.
    """
    c = default_config()
    c.dataset = dataset
    c.tokenizer = tokenizer
    c.max_len = 64
    c.max_input_len = max_input_len
    c.pack = True

    c.batch_size = 16
    c.num_train_steps = num_train_steps
    c.schedule = "cosine"
    c.learning_rate = 3e-3
    c.warmup_steps = 100
    c.label_smoothing = 0.0
    c.grad_clip_norm = 1.0

    c.eval_every_steps = num_train_steps
    c.eval_batch_size = 512
    c.eval_max_len = eval_max_len
    c.eval_max_input_len = eval_max_input_len
    c.eval_max_batches = 2
    c.eval_decode_examples = eval_decode_examples
    c.decode = "greedy"
    c.best_metric = ""  # the final step is evaluated, nothing is selected on validation
    c.checkpoint_every_steps = num_train_steps
    c.keep_checkpoints = 1
    c.log_every_steps = 50

    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.num_layers = 2
    c.model.d_ff = 256
    c.model.dropout_rate = 0.1
    c.model.max_len = model_max_len
    c.model.position_options.shaw.max_distance = shaw_max_distance
    c.model.position = "sinusoidal"
    for key, value in changes.items():
        c[key] = value
    return c
