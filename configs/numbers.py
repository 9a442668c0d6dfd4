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

import pathlib
import runpy

from jattn.train.config import apply_variant

small_task = runpy.run_path(str(pathlib.Path(__file__).with_name("_small_task.py")))["small_task"]


def get_config(arg=None):
    c = small_task(
        dataset="numbers",
        tokenizer="char",
        max_input_len=16,
        num_train_steps=800,
        eval_max_len=96,
        eval_max_input_len=16,
        eval_decode_examples=128,
        model_max_len=96,
        shaw_max_distance=16,
        # Faster and smoothed; evaluated twice, on 64-row batches; the best
        # checkpoint on validation exact match is kept.
        learning_rate=5e-3,
        warmup_steps=50,
        label_smoothing=0.1,
        eval_every_steps=400,
        eval_batch_size=64,
        best_metric="eval/validation/exact_match",
        checkpoint_every_steps=400,
        log_every_steps=25,
    )
    return apply_variant(c, arg)
