"""The CPU default: the local `numbers` task (German number words) with a small model.

    jattn train --config configs/numbers.py --workdir runs/numbers
    jattn train --config configs/numbers.py:rope --workdir runs/numbers_rope

Digits in, German words out, one character a token: "342" ->
"dreihundertzweiundvierzig". Training and validation numbers have 1-5 digits;
`test_longer` has 6 digits, so it measures length generalisation of the
positional scheme, and every character of its targets occurs in training
targets (the run's data check says so). Inputs have at most 6 tokens (EOS
included) in training, 7 in test_longer; targets fit the rows of 64 tokens.
So encoder rows get 16 slots and decoder rows 64. A 2+2-layer model of width 64 learns
the task in under a minute on two CPU cores; the positional ablation (`jattn
ablate`) runs it for every scheme and seed.
`:arg` takes the variants of `jattn.train.apply_variant` (a positional scheme,
an attention implementation, `bf16`, `greedy`/`beam`).
"""

from jattn.train.config import apply_variant, default_config


def get_config(arg=None):
    c = default_config()
    c.dataset = "numbers"
    c.tokenizer = "char"
    c.max_len = 64
    c.max_input_len = 16
    c.pack = True

    c.batch_size = 16
    c.num_train_steps = 800
    c.schedule = "cosine"
    c.learning_rate = 5e-3
    c.warmup_steps = 50
    c.label_smoothing = 0.1
    c.grad_clip_norm = 1.0

    c.eval_every_steps = 400
    c.eval_batch_size = 64
    c.eval_max_len = 96
    c.eval_max_input_len = 16
    c.eval_max_batches = 2
    c.eval_decode_examples = 128
    c.decode = "greedy"
    c.checkpoint_every_steps = 400
    c.keep_checkpoints = 1
    c.log_every_steps = 25

    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.num_layers = 2
    c.model.d_ff = 256
    c.model.dropout_rate = 0.1
    c.model.max_len = 96
    c.model.max_relative_distance = 16
    c.model.position = "sinusoidal"
    return apply_variant(c, arg)
