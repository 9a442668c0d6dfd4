"""Ontañón et al.'s relative-position variants on reversing (a second grid).

    jattn ablate --config experiments/shaw_variants.py --workdir runs/shaw_variants
    jattn ablate --config experiments/shaw_variants.py:duplicate --workdir runs/shaw_dup

Ontañón et al. (2022) compare relative attention with learned embeddings only
("rel-e", Shaw's key term), a learned scalar bias only ("rel-b") and both
("rel-eb"), in self-attention alone or also in decoder-to-encoder attention
("rel2-*"), with the clipping distance k at the longest training distance
(16). This grid trains each of the six on `configs/reverse_digits.py` with 3
seeds (18 runs) and reports exact match on validation and on `test_longer`
(17-24 digits) with intervals, against rel-e (the key term alone, in
self-attention) as the reference. Shaw et al.'s key+value term is jattn's
plain "shaw" in `experiments/positional.py`.

`:arg`: "" (reversing), "duplicate" (duplication), "tiny" (the tests).
"""

import ml_collections


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.base = "configs/reverse_digits.py:shaw"
    c.train = ml_collections.ConfigDict()
    c.train.progress_bar = True

    c.grid = ml_collections.ConfigDict()
    c.grid.terms = ml_collections.ConfigDict(
        {"key": "model.shaw_terms", "values": "key,bias,key+bias"}
    )
    c.grid.rel2 = ml_collections.ConfigDict({"key": "model.relative_cross", "values": "false,true"})
    c.grid.seed = ml_collections.ConfigDict({"key": "seed", "values": "0,1,2"})
    # Group names list the axes alphabetically: "rel2=...,terms=...".
    c.reference = "rel2=false,terms=key"

    c.metrics = (
        "eval/test_longer/exact_match",
        "eval/validation/exact_match",
        "eval/test_longer/length_match",
        "eval/test_longer/accuracy",
        "train/loss",
        "num_params",
    )
    if arg == "duplicate":
        c.train.dataset = "duplicate_digits"
        c.train.max_len = 96
        c.train.eval_max_len = 64
        c.train.model = ml_collections.ConfigDict({"max_len": 96})
    elif arg == "tiny":
        c.train.dataset = "reverse_digits/tiny"
        c.train.num_train_steps = 4
        c.train.eval_every_steps = 4
        c.train.checkpoint_every_steps = 4
        c.train.eval_decode_examples = 8
        c.train.eval_max_batches = 1
        c.train.eval_batch_size = 16
        c.train.progress_bar = False
        c.grid.terms.values = "bias,key+bias"
        c.grid.rel2.values = "true"
        c.grid.seed.values = "0"
    elif arg:
        raise ValueError(f"experiments/shaw_variants.py: unknown preset {arg!r} (duplicate, tiny)")
    return c
