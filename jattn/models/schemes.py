"""The built-in positional schemes' registry: every component registered in `SCHEMES` by name.

Each scheme is a `jattn.models.scheme.Scheme` (what a component is, its
hooks and the registry are there): its options (`Options`, a frozen dataclass
of its own with its defaults and checks), and the hooks it overrides. The
components live by kind, one concern a file:

    jattn/models/absolute_schemes.py   "sinusoidal", "learned"
    jattn/models/shaw_schemes.py       "shaw", "sinusoidal+shaw", "transformer_xl"
    jattn/models/rotary_schemes.py     "rope", "xpos"
    jattn/models/score_mod_schemes.py  "alibi", "kerple", "sandwich", "fire", "t5"
    jattn/models/data_schemes.py       "forgetting", "cope", "stick_breaking"

This module registers them, in the order `SCHEMES` lists them, and keeps the
names users import from here (`SCHEMES`, `Scheme`, `Site`, `register`, ...;
the components too, e.g. `jattn.models.schemes.T5`). The arithmetic is in
`jattn.positions`; a hook reads the config and its options, declares the
parameters and calls it:

    SCHEMES["alibi"].score_mod(layer, config, site, state)  # a jattn.ScoreMod

Hooks that own parameters receive the flax module to declare them on
(`axes.param(module, ...)`), so a scheme's tables keep the checkpoint names
they had before the registry (`rel_key`, `rel_bias`, `t5_bias/table`,
`positions/table`). The relative hooks (`rotate`, `score_mod`, `shaw`) act in
self-attention and, with `TransformerConfig.relative_cross`, in
decoder-to-encoder attention (`Site.cross`); `Site.causal` tells a causal
(decoder) layer from a bidirectional one.

Adding a scheme: docs/schemes.md (FIRE is the worked example): its component
in the file of its kind, and one line in the registry below.
"""

from __future__ import annotations

from jattn.models.absolute_schemes import Learned, Sinusoidal
from jattn.models.data_schemes import Cope, Forgetting, StickBreaking
from jattn.models.rotary_schemes import Rope, XPos
from jattn.models.scheme import (
    SCHEMES,
    PositionOptions,
    Scheme,
    SchemeOptions,
    Site,
    default_position_options,
    get_scheme,
    option_groups,
    register,
)
from jattn.models.score_mod_schemes import T5, Alibi, Fire, Kerple, Sandwich
from jattn.models.shaw_schemes import SHAW_TERMS, Shaw, SinusoidalShaw, TransformerXL

__all__ = [
    "SCHEMES",
    "SHAW_TERMS",
    "PositionOptions",
    "Scheme",
    "SchemeOptions",
    "Site",
    "default_position_options",
    "get_scheme",
    "option_groups",
    "register",
]


# -- the registry ------------------------------------------------------------------------

for _scheme in (
    Scheme("none", shift_invariant=True, order_blind=True),
    Sinusoidal("sinusoidal"),
    Learned("learned"),
    Shaw("shaw"),
    SinusoidalShaw("sinusoidal+shaw"),
    Rope("rope"),
    Alibi("alibi"),
    T5("t5"),
    XPos("xpos"),
    Fire("fire"),
    Kerple("kerple"),
    TransformerXL("transformer_xl"),
    Sandwich("sandwich"),
    Forgetting("forgetting"),
    Cope("cope"),
    StickBreaking("stick_breaking"),
):
    register(_scheme)
