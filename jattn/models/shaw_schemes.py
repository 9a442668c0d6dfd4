"""The schemes of learned relative tables, one component each: Shaw et al.'s and Transformer-XL's.

"shaw" and "sinusoidal+shaw" hold Shaw et al.'s key and value tables over
clipped distances and Ontañón et al.'s per-head bias (`ShawOptions.terms`);
"transformer_xl" is Dai et al.'s relative attention built from the same
pieces (Shaw's per-head key table and a Shaw bias, `shift_queries` for its
u). The layer hands the tables to `jattn.dot_product_attention` as
`relative=` (`jattn.positions.ShawRelative`). Registered in
`jattn.models.schemes`. Shapes: N query heads, H head dim, D width, R
`2k + 1` clipped distances.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jattn import positions as pos_lib
from jattn.models.absolute_schemes import Sinusoidal
from jattn.models.axes import param
from jattn.models.scheme import (
    Scheme,
    SchemeOptions,
    int_at_least_0,
    layer_params,
    positive_int,
)
from jattn.positions import ShawRelative

__all__ = [
    "SHAW_TERMS",
    "Shaw",
    "ShawOptions",
    "SinusoidalShaw",
    "TransformerXL",
    "TransformerXLOptions",
]

_xavier = jax.nn.initializers.xavier_uniform

# -- Shaw et al. ------------------------------------------------------------------------


# The terms of Shaw's relative attention a model can have (`ShawOptions.terms`, "+"-joined):
# "key": a^K, a learned vector per clipped distance added to the keys (Shaw et al.);
# "value": a^V, the same for the values (Shaw et al.);
# "bias": a learned scalar per clipped distance and head added to the logits
#   (Ontañón et al. 2022's "rel-b"; with "key" their "rel-eb").
SHAW_TERMS = ("key", "value", "bias")


@dataclasses.dataclass(frozen=True)
class ShawOptions(SchemeOptions):
    """Options of "shaw" and "sinusoidal+shaw".

    Attributes:
      max_distance: Shaw's clip distance k.
      terms: which of Shaw's terms the model has, "+"-joined from
        `SHAW_TERMS`: "key+value" (Shaw et al.), "key" (Ontañón et al.'s
        rel-e), "bias" (rel-b), "key+bias" (rel-eb), ...
    """

    max_distance: int = 16
    terms: str = "key+value"

    def check(self):
        positive_int("max_distance", self.max_distance)
        terms = str(self.terms).split("+")
        if len(set(terms)) != len(terms) or not set(terms) <= set(SHAW_TERMS):
            raise ValueError(
                f"terms={self.terms!r} must join distinct terms of {SHAW_TERMS} with '+', "
                "e.g. 'key+value', 'key', 'bias', 'key+bias'"
            )

    @property
    def term_set(self) -> frozenset[str]:
        """The terms of `terms`, e.g. {"key", "value"}."""
        return frozenset(self.terms.split("+"))


@dataclasses.dataclass(frozen=True)
class Shaw(Scheme):
    """Shaw et al.'s relative terms, those of `ShawOptions.terms`: key and
    value tables `[2k+1, H]` shared by the heads, and a per-head scalar bias
    `[N, 2k+1]`."""

    Options = ShawOptions
    options_key = "shaw"

    relative: bool = True
    shift_invariant: bool = True

    def score_mod(self, module, cfg, site, state):
        opts = self.options(cfg)
        if "bias" not in opts.term_set:
            return None
        table = param(
            module,
            "rel_bias",
            nn.initializers.zeros,
            (cfg.num_heads, 2 * opts.max_distance + 1),
            ("heads", None),
            cfg.params_dtype,
        )  # [N, R]
        return pos_lib.shaw_bias_score_mod(table.astype(jnp.float32), opts.max_distance)

    def shaw(self, module, cfg):
        opts = self.options(cfg)
        terms = opts.term_set & {"key", "value"}
        if not terms:
            return None
        r, h, c = 2 * opts.max_distance + 1, cfg.head_dim, cfg.compute_dtype
        tables = {
            term: param(module, f"rel_{term}", _xavier(), (r, h), (None, "kv"), cfg.params_dtype)
            for term in ("key", "value")  # this order fixes the initial values
            if term in terms
        }
        return ShawRelative(
            key=tables["key"].astype(c) if "key" in tables else None,
            value=tables["value"].astype(c) if "value" in tables else None,
            max_distance=opts.max_distance,
        )


@dataclasses.dataclass(frozen=True)
class SinusoidalShaw(Shaw):
    """Shaw et al.'s combination: sinusoids on the embeddings and relative terms."""

    absolute: bool = True
    shift_invariant: bool = False

    embed = Sinusoidal.embed

    check = Sinusoidal.check


# -- Transformer-XL ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TransformerXLOptions(SchemeOptions):
    """Options of "transformer_xl".

    Attributes:
      max_distance: the clip distance of `i - j` (0: the longest row the
        config allows, `max(max_len, random_positions) - 1`, so unclipped there).
    """

    max_distance: int = 0

    def check(self):
        int_at_least_0("max_distance", self.max_distance)


@dataclasses.dataclass(frozen=True)
class TransformerXL(Scheme):
    """Dai et al. 2019's relative attention, as Csordás et al. 2021 use it:
    `(q + u)·k + (q + v)·W_R R(i - j)` with R the sinusoidal embedding of the
    distance (width D), learned per-layer u, v `[N, H]` and W_R `[D, N, H]`,
    no absolute positions. Distances are clipped at its `max_distance` (0:
    the longest row the config allows, so unclipped there).

    Built from jattn's pieces (`jattn.positions.transformer_xl_tables`): the
    queries shifted by u, Shaw's per-head key table `W_R R` and a Shaw bias
    table `(v - u)·W_R R`; memory is O(T·k) a head, linear in L for a fixed
    clip (set `max_distance`; the default clip ~ L is O(L^2)).
    """

    Options = TransformerXLOptions
    options_key = "transformer_xl"

    relative: bool = True
    shift_invariant: bool = True

    def check(self, cfg):
        if cfg.d_model % 2:
            raise ValueError(
                f"TransformerConfig: transformer_xl's sinusoidal R needs an even d_model, "
                f"got {cfg.d_model}"
            )

    def clip(self, cfg) -> int:
        """The clip distance k: its `max_distance`, or the widest row's span."""
        return self.options(cfg).max_distance or max(cfg.max_len, cfg.random_positions) - 1

    def shift_queries(self, module, cfg, site, q):
        n, h, d = cfg.num_heads, cfg.head_dim, cfg.d_model
        zeros, pdt = nn.initializers.zeros, cfg.params_dtype
        u = param(module, "xl_u", zeros, (n, h), ("heads", "kv"), pdt)  # [N, H]
        param(module, "xl_v", zeros, (n, h), ("heads", "kv"), pdt)
        param(module, "xl_r", _xavier(in_axis=0, out_axis=(1, 2)), (d, n, h),
              ("embed", "heads", "kv"), pdt)  # fmt: skip
        return q + u.astype(q.dtype)[None, None]  # [B, T, N, H]

    def _tables(self, module, cfg):
        w_r, u, v = layer_params(module, "xl_r", "xl_u", "xl_v")
        return pos_lib.transformer_xl_tables(w_r, u, v, self.clip(cfg), cfg.head_dim**-0.5)

    def score_mod(self, module, cfg, site, state):
        _, bias = self._tables(module, cfg)  # [N, 2k+1]
        return pos_lib.shaw_bias_score_mod(bias, self.clip(cfg))

    def shaw(self, module, cfg):
        key_table, _ = self._tables(module, cfg)  # [N, 2k+1, H]
        return ShawRelative(
            key=key_table.astype(cfg.compute_dtype), value=None, max_distance=self.clip(cfg)
        )
