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

import pathlib
import runpy

from jattn.train.config import apply_variant

small_task = runpy.run_path(str(pathlib.Path(__file__).with_name("_small_task.py")))["small_task"]


def get_config(arg=None):
    c = small_task(
        dataset="scan/length_cutoff26",
        tokenizer="word",
        max_input_len=40,
        num_train_steps=2000,
        eval_max_len=64,
        eval_max_input_len=16,
        eval_decode_examples=1024,
        model_max_len=64,
        shaw_max_distance=26,
    )
    return apply_variant(c, arg)
