"""Positional schemes as pure functions.

Absolute schemes produce vectors added to embeddings (`sinusoidal`); rotary
embeddings rotate queries and keys (`rope`, its scalings `rope_frequencies`,
and the decaying `xpos`); relative schemes produce either
tables read inside attention (`ShawRelative`, `relative_ids`) or score mods (`jattn.ScoreMod`:
ALiBi, T5 buckets, Shaw's bias term, FIRE, KERPLE, Sandwich, soft-capping) applied inside
the attention tiles. Every function takes explicit
integer positions so packed rows (positions restarting at each segment) and
cached decoding (positions offset into the cache) work the same way as plain
`arange` positions.

Shapes: B batch, T query length, S key length, N query heads, H head dim,
R = 2k + 1 relative distances for Shaw with clip distance k.

One module per family: `absolute` (sinusoidal), `rotary` (RoPE, its
scalings, xPos), `relative` (Shaw's ids and tables, Transformer-XL's as
Shaw's), `biases` (the score mods: ALiBi, T5, Shaw's bias, KERPLE,
Sandwich, soft-capping), `fire` (FIRE), `forgetting` (the Forgetting
Transformer's data-dependent forget gate, a row and a column term) and
`tables` (the per-head table read the score mods share); every public name is imported
here, so `jattn.positions.X` is the one name to use.
"""

from jattn.positions.absolute import sinusoidal
from jattn.positions.biases import (
    ALIBI_MODES,
    SANDWICH_DIM,
    alibi_score_mod,
    alibi_slopes,
    kerple_score_mod,
    sandwich_bias,
    sandwich_score_mod,
    shaw_bias_score_mod,
    softcap_score_mod,
    t5_relative_bucket,
    t5_score_mod,
)
from jattn.positions.fire import FIRE_HIDDEN, fire_param_specs, fire_score_mod, init_fire_params
from jattn.positions.forgetting import (
    FORGET_BIAS_INIT,
    forget_gate_param_specs,
    forget_row_col,
    log_forget_gates,
    segment_cumsum,
)
from jattn.positions.relative import ShawRelative, relative_ids, transformer_xl_tables
from jattn.positions.rotary import (
    ROPE_SCALINGS,
    YARN_CONVENTIONS,
    YarnOptions,
    rope,
    rope_frequencies,
    xpos,
    xpos_max_span,
    xpos_reference,
)

__all__ = [
    "ALIBI_MODES",
    "FIRE_HIDDEN",
    "FORGET_BIAS_INIT",
    "ROPE_SCALINGS",
    "SANDWICH_DIM",
    "YARN_CONVENTIONS",
    "ShawRelative",
    "YarnOptions",
    "alibi_score_mod",
    "alibi_slopes",
    "fire_param_specs",
    "fire_score_mod",
    "forget_gate_param_specs",
    "forget_row_col",
    "init_fire_params",
    "kerple_score_mod",
    "log_forget_gates",
    "relative_ids",
    "rope",
    "rope_frequencies",
    "sandwich_bias",
    "sandwich_score_mod",
    "segment_cumsum",
    "shaw_bias_score_mod",
    "sinusoidal",
    "softcap_score_mod",
    "t5_relative_bucket",
    "t5_score_mod",
    "transformer_xl_tables",
    "xpos",
    "xpos_max_span",
    "xpos_reference",
]
