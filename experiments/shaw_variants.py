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

import pathlib
import runpy

import ml_collections

_presets = runpy.run_path(str(pathlib.Path(__file__).with_name("_presets.py")))
grid_experiment, length_metrics, tiny, train_steps = (
    _presets[n] for n in ("grid_experiment", "length_metrics", "tiny", "train_steps")
)


def get_config(arg=None):
    c = grid_experiment(
        "configs/reverse_digits.py:shaw",
        # Group names list the axes alphabetically: "rel2=...,terms=...".
        reference="rel2=false,terms=key",
        metrics=length_metrics("accuracy", speed=False),
        terms=("model.position_options.shaw.terms", "key,bias,key+bias"),
        rel2=("model.relative_cross", "false,true"),
    )
    if arg == "duplicate":
        c.train.dataset = "duplicate_digits"
        c.train.max_len = 96
        c.train.eval_max_len = 64
        c.train.model = ml_collections.ConfigDict({"max_len": 96})
    elif arg == "tiny":
        tiny(
            c,
            dataset="reverse_digits/tiny",
            steps=4,
            checkpoint_every=4,
            terms="bias,key+bias",
            rel2="true",
        )
    elif arg:
        raise ValueError(f"experiments/shaw_variants.py: unknown preset {arg!r} (duplicate, tiny)")
    return c
