"""Tiny config for tests and smoke runs: `copy/tiny`, a 1+1-layer model, 40 steps.

    jattn train --config configs/smoke.py --workdir /tmp/smoke

Takes seconds on one CPU core. `:arg` takes the variants of
`jattn.train.apply_variant` (e.g. `configs/smoke.py:rope`).
"""

from jattn.train.config import apply_variant, default_config


def get_config(arg=None):
    c = default_config()
    c.dataset = "copy/tiny"
    c.max_len = 16
    c.pack = True
    c.batch_size = 8
    c.num_train_steps = 40
    c.schedule = "constant"
    c.learning_rate = 3e-3
    c.warmup_steps = 5
    c.label_smoothing = 0.1

    c.eval_every_steps = 20
    c.eval_batch_size = 8
    c.eval_max_len = 32
    c.eval_max_batches = 1
    c.eval_decode_examples = 8
    c.checkpoint_every_steps = 10
    c.keep_checkpoints = 2
    c.log_every_steps = 1
    c.progress_bar = False

    c.model.d_model = 32
    c.model.num_heads = 2
    c.model.num_layers = 1
    c.model.d_ff = 64
    c.model.dropout_rate = 0.1
    c.model.max_len = 32
    c.model.position = "sinusoidal"
    return apply_variant(c, arg)
