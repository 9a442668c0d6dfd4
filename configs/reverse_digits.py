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

import pathlib
import runpy

from jattn.train.config import apply_variant

small_task = runpy.run_path(str(pathlib.Path(__file__).with_name("_small_task.py")))["small_task"]


def get_config(arg=None):
    c = small_task(
        dataset="reverse_digits",
        tokenizer="char",
        max_input_len=64,
        num_train_steps=1500,
        eval_max_len=32,
        eval_max_input_len=32,
        eval_decode_examples=1024,
        model_max_len=64,
        shaw_max_distance=16,
    )
    return apply_variant(c, arg)
