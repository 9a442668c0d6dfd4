"""Kazemnejad et al. (2023) in jattn: which positional scheme lets a decoder-only model copy
and reverse past the lengths it saw?

    jattn ablate --config experiments/decoder_only.py --workdir runs/decoder_only
    jattn ablate --config experiments/decoder_only.py:tiny --workdir /tmp/dec  # the tests

Kazemnejad et al., "The Impact of Positional Encoding on Length
Generalization in Transformers" (NeurIPS 2023), find for decoder-only models
NoPE ≈ T5 > ALiBi > RoPE ≈ sinusoidal beyond the training lengths. This grid
trains `configs/kazemnejad.py` (training lengths 1-20, `test_longer` 21-40,
1,000 examples, every target token shown in training) on copy and reverse,
with no positions (NoPE), T5 buckets, ALiBi, RoPE, sinusoidal and FIRE, 3 seeds
each, and reports exact match on `test_longer` with its interval, the best
seed, and exact match by length (`jattn.analysis.anchors`).

Every run is `model.architecture = "decoder_only"`: one causal stack over
the input, a separator and the target (`jattn.models.decoder_only`).

`:arg` picks a preset: "" (copy and reverse, six schemes, 3 seeds), "long"
(NoPE and T5 on copy at 3,600 steps: is NoPE's shortfall under-training?
`--config.grid.position.values=alibi,rope
--config.reference=task=kz_copy,position=alibi` runs the same for ALiBi and
RoPE, as the README's second check did, and `=sinusoidal` its third),
"tiny" (one task, two schemes, one seed, a few steps: the tests).
"""

import ml_collections

SCHEMES = "none,t5,alibi,rope,sinusoidal,fire"


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.base = "configs/kazemnejad.py"
    c.train = ml_collections.ConfigDict()
    c.train.num_train_steps = 1200
    c.train.eval_every_steps = 1200
    c.train.checkpoint_every_steps = 1200
    c.train.progress_bar = True
    c.train.model = ml_collections.ConfigDict({"architecture": "decoder_only"})

    c.grid = ml_collections.ConfigDict()
    c.grid.task = ml_collections.ConfigDict({"key": "dataset", "values": "kz_copy,kz_reverse"})
    c.grid.position = ml_collections.ConfigDict({"key": "model.position", "values": SCHEMES})
    c.grid.seed = ml_collections.ConfigDict({"key": "seed", "values": "0,1,2"})
    c.reference = "task=kz_copy,position=sinusoidal"

    c.metrics = (
        "eval/test_longer/exact_match",
        "eval/validation/exact_match",
        "eval/test_longer/length_match",
        "eval/test_longer/beyond_train/accuracy",
        "train/loss",
        "num_params",
        "train/steps_per_sec",
    )

    if arg == "tiny":
        c.train.dataset = "kz_copy/tiny"
        c.train.num_train_steps = 6
        c.train.eval_every_steps = 6
        c.train.checkpoint_every_steps = 3
        c.train.eval_decode_examples = 8
        c.train.eval_max_batches = 1
        c.train.eval_batch_size = 16
        c.train.progress_bar = False
        c.grid.task.values = "kz_copy/tiny"
        c.grid.position.values = "none,t5"
        c.grid.seed.values = "0"
        c.reference = "task=kz_copy/tiny,position=none"
    elif arg == "long":
        # Is NoPE's shortfall on copy under-training? NoPE and T5 (the paper's
        # pair) at 3x the steps, the rest as the grid.
        for key in ("num_train_steps", "eval_every_steps", "checkpoint_every_steps"):
            c.train[key] = 3600
        c.train.warmup_steps = 300
        c.grid.task.values = "kz_copy"
        c.grid.position.values = "none,t5"
        c.reference = "task=kz_copy,position=t5"
    elif arg:
        raise ValueError(f"experiments/decoder_only.py: unknown preset {arg!r} (long, tiny)")
    return c
