"""Copy, reverse or addition with Kazemnejad et al. (2023)'s lengths, on the CPU.

    jattn train --config configs/kazemnejad.py --workdir runs/kz_copy
    jattn train --config configs/kazemnejad.py:reverse,rope --workdir runs/kz_reverse_rope
    jattn train --config configs/kazemnejad.py:addition --workdir runs/kz_addition

The tasks of `jattn.data.kazemnejad`: training lengths 1-20, `test_longer`
21-40 (1,000 examples, every one longer than any training example, every
target token shown in training), scored by sequence exact match on every
evaluation example at the last step (nothing selected on validation). In
tokens (EOS included), copy and reverse have at most 21 a side in training
and 41 in `test_longer`; addition's inputs ("a+b") have 43 and 83, its
targets 22 and 42.

The data side of the decoder-only grid (`experiments/decoder_only.py`): the
model here is jattn's encoder-decoder (`model.architecture` defaults to
"encoder_decoder"); the grid sets "decoder_only". `:arg` is a
comma-separated list: a task ("copy", the default, "reverse", "addition")
and the variants of `jattn.train.apply_variant` (a positional scheme, ...).
"""

from jattn.train.config import apply_variant, default_config

TASKS = {"copy": "kz_copy", "reverse": "kz_reverse", "addition": "kz_addition"}


def get_config(arg=None):
    items = [s.strip() for s in (arg or "").split(",") if s.strip()]
    tasks = [s for s in items if s in TASKS]
    if len(tasks) > 1:
        raise ValueError(f"configs/kazemnejad.py: one task at most, got {tasks}")
    task = tasks[0] if tasks else "copy"

    c = default_config()
    c.dataset = TASKS[task]
    c.tokenizer = "char"
    c.max_len = 64
    c.max_input_len = 64 if task != "addition" else 96
    c.pack = True

    c.batch_size = 16
    c.num_train_steps = 1200
    c.schedule = "cosine"
    c.learning_rate = 3e-3
    c.warmup_steps = 100
    c.label_smoothing = 0.0
    c.grad_clip_norm = 1.0

    c.eval_every_steps = 1200
    c.eval_batch_size = 512
    c.eval_max_len = 48  # the longest test_longer target: 42 tokens
    c.eval_max_input_len = 48 if task != "addition" else 88
    c.eval_max_batches = 2  # 2 x 512 rows: all 1,000 examples of each split
    c.eval_decode_examples = 1000
    c.decode = "greedy"
    c.best_metric = ""  # the final step is evaluated, nothing is selected on validation
    c.checkpoint_every_steps = 1200
    c.keep_checkpoints = 1
    c.log_every_steps = 50

    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.num_layers = 2
    c.model.d_ff = 256
    c.model.dropout_rate = 0.1
    c.model.max_len = 96 if task != "addition" else 128
    c.model.max_relative_distance = 20  # the longest training length
    c.model.position = "sinusoidal"
    return apply_variant(c, ",".join(s for s in items if s not in TASKS))
