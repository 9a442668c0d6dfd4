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

import pathlib
import runpy

from jattn.train.config import apply_variant

small_task = runpy.run_path(str(pathlib.Path(__file__).with_name("_small_task.py")))["small_task"]

TASKS = {"copy": "kz_copy", "reverse": "kz_reverse", "addition": "kz_addition"}


def get_config(arg=None):
    items = [s.strip() for s in (arg or "").split(",") if s.strip()]
    tasks = [s for s in items if s in TASKS]
    if len(tasks) > 1:
        raise ValueError(f"configs/kazemnejad.py: one task at most, got {tasks}")
    task = tasks[0] if tasks else "copy"
    addition = task == "addition"  # inputs "a+b": about twice as long
    c = small_task(
        dataset=TASKS[task],
        tokenizer="char",
        max_input_len=96 if addition else 64,
        num_train_steps=1200,
        eval_max_len=48,  # the longest test_longer target: 42 tokens
        eval_max_input_len=88 if addition else 48,
        eval_decode_examples=1000,  # 2 x 512 rows: all 1,000 examples of each split
        model_max_len=128 if addition else 96,
        shaw_max_distance=20,  # the longest training length
    )
    return apply_variant(c, ",".join(s for s in items if s not in TASKS))
