"""Reversing digit strings (Ontañón et al. 2022) with a small model, on the CPU.

    jattn train --config configs/reverse_digits.py --workdir runs/reverse
    jattn train --config configs/reverse_digits.py:shaw --workdir runs/reverse_shaw
    jattn train --config configs/reverse_digits.py --config.dataset=duplicate_digits ...

"0123" -> "3210", one digit a token. Training and validation strings have
1-16 digits, `test_longer` 17-24: every test target is made of the ten digits
that training targets show, so a model that has learnt to reverse can get
every one right, and exact match on `test_longer` measures how the positional
scheme carries the rule past the lengths it was trained on. In tokens (EOS
included) inputs and targets have at most 17 in training and 25 in
`test_longer`.

Training packs examples into rows of 64 tokens a side (about 7 examples a
row). Evaluation decodes all 1,024 examples of each split greedily and reads
them at the last step (no checkpoint is chosen on validation: Csordás et al.
2021). Shaw's clipping distance is 16, the longest distance in training (as
in Ontañón et al.). `:arg` takes the variants of `jattn.train.apply_variant`.
"""

from jattn.train.config import apply_variant, default_config


def get_config(arg=None):
    c = default_config()
    c.dataset = "reverse_digits"
    c.tokenizer = "char"
    c.max_len = 64
    c.max_input_len = 64
    c.pack = True

    c.batch_size = 16
    c.num_train_steps = 1500
    c.schedule = "cosine"
    c.learning_rate = 3e-3
    c.warmup_steps = 100
    c.label_smoothing = 0.0
    c.grad_clip_norm = 1.0

    c.eval_every_steps = 1500
    c.eval_batch_size = 512
    c.eval_max_len = 32
    c.eval_max_input_len = 32
    c.eval_max_batches = 2
    c.eval_decode_examples = 1024
    c.decode = "greedy"
    c.best_metric = ""  # the final step is evaluated, nothing is selected on validation
    c.checkpoint_every_steps = 1500
    c.keep_checkpoints = 1
    c.log_every_steps = 50

    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.num_layers = 2
    c.model.d_ff = 256
    c.model.dropout_rate = 0.1
    c.model.max_len = 64
    c.model.max_relative_distance = 16
    c.model.position = "sinusoidal"
    return apply_variant(c, arg)
