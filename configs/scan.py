"""SCAN's length split, Csordás et al. 2021's cutoff 26, with a small model on the CPU.

    jattn train --config configs/scan.py --workdir runs/scan
    jattn train --config configs/scan.py:rope --workdir runs/scan_rope
    jattn train --config configs/scan.py --config.dataset=scan/length ...  # Lake and Baroni's 22

Commands to actions, one word a token (``tokenizer = "word"``):
"jump twice after walk left" -> "LTURN WALK JUMP JUMP". Training and
validation (90% / 10% of the commands whose action sequences have at most 26
actions, 16,458 / 1,828) are the short regime; `test_longer` is every command
with 27-48 actions (2,624), each made of the six actions training shows (see
`jattn.data.scan`). In tokens (EOS included) inputs have at most 10, targets
27 in training and 49 in `test_longer`.

Training packs examples into rows of 64 target and 40 input tokens (4-5
examples a row), 2,000 steps. Evaluation decodes the first 1,024 examples of
each split (`experiments/scan.py`: all of them) greedily, up to 64 tokens, at
the last step, with no checkpoint chosen on
validation (Csordás et al.). Shaw's clipping distance is 26, the longest
distance in a training target. `:arg` takes the variants of
`jattn.train.apply_variant`.
"""

from jattn.train.config import apply_variant, default_config


def get_config(arg=None):
    c = default_config()
    c.dataset = "scan/length_cutoff26"
    c.tokenizer = "word"
    c.max_len = 64
    c.max_input_len = 40
    c.pack = True

    c.batch_size = 16
    c.num_train_steps = 2000
    c.schedule = "cosine"
    c.learning_rate = 3e-3
    c.warmup_steps = 100
    c.label_smoothing = 0.0
    c.grad_clip_norm = 1.0

    c.eval_every_steps = 2000
    c.eval_batch_size = 512
    c.eval_max_len = 64
    c.eval_max_input_len = 16
    c.eval_max_batches = 2
    c.eval_decode_examples = 1024
    c.decode = "greedy"
    c.best_metric = ""  # the final step is evaluated, nothing is selected on validation
    c.checkpoint_every_steps = 2000
    c.keep_checkpoints = 1
    c.log_every_steps = 50

    c.model.d_model = 64
    c.model.num_heads = 4
    c.model.num_layers = 2
    c.model.d_ff = 256
    c.model.dropout_rate = 0.1
    c.model.max_len = 64
    c.model.max_relative_distance = 26
    c.model.position = "sinusoidal"
    return apply_variant(c, arg)
