"""The data-dependent schemes, one component each: terms read from the tokens, not their positions.

Every other scheme is a function of where a token sits; these three are
functions of what the tokens are, the schemes recent papers compare for
length generalisation:

- "forgetting": Lin, Nikishin, He and Courville's forget gate (ICLR 2025), a
  per-token, per-head gate of the layer's input whose log sums between key
  and query are added to the logits (`jattn.positions.forgetting`, read per
  tile as row and column terms by every implementation, the Pallas
  kernels included).
- "cope": Golovneva, Wang, Weston and Sukhbaatar's contextual positions
  (2024), a key's position the count of open gates between it and the query
  (`jattn.attention.cope`).
- "stick_breaking": Tan, Yang, Courville, Panda and Shen's stick-breaking
  attention (ICLR 2025), weights without a softmax
  (`jattn.attention.stick_breaking`).

All three are defined for causal self-attention, as their papers' decoders
use them; bidirectional layers (an encoder, a prefix LM's stack) and
cross-attention get no term, so an encoder under them is order blind, as
with "none", and an encoder-decoder cannot tell its source's order: compare
them in decoder-only models (experiments/decoder_only.py:data_dependent).
They read no positions (`data_dependent`): a shifted input gives shifted
outputs, and drawing positions at random changes nothing.

CoPE and stick-breaking replace softmax attention in the layer
(`Scheme.attention_form`): `attention_impl="xla"` runs their materialised
form, "chunked" their tiled reverse scan (O(L) memory), and the default
(None) the materialised form up to the size where the scan is faster on a
CPU (`Form.materialised_up_to`: stick-breaking T·S ≤ 128·128, one tile of
the scan; CoPE T·S ≤ 32·32) and the scan above. The Pallas
kernels have no reverse scan: `attention_impl="pallas"` is a config error
for CoPE and stick-breaking, while the forget gate's row and column terms
run in them as in xla and chunked (the rule's default, `attention_impl=None`,
takes a kernel only for a configuration verified on a GPU). CoPE and
stick-breaking apply no attention-weight dropout (`attention_dropout_rate`
must be 0), and `capture_attention` cannot sow their weights.

Shapes: B batch, T queries, S keys, N query heads, K kv heads, H head dim,
D width, P `npos_max`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax

from jattn import positions as pos_lib
from jattn.attention.cope import cope_attention, cope_attention_xla
from jattn.attention.stick_breaking import (
    stick_breaking_attention,
    stick_breaking_attention_xla,
)
from jattn.models.scheme import Scheme, SchemeOptions, SchemeParams, positive_int

Array = jax.Array

# T·S at or below which the default runs the materialised form: the reverse
# scan's default tiles are 128 x 128, so below it the scan is one tile.
ONE_TILE = 128 * 128
# CoPE's: its scan (64-row query tiles) makes a Kazemnejad decoder's training
# step faster than its materialised form from T = S = 64 on, and as fast at 32
# (docs/benchmarks.md, "CoPE's lookup").
COPE_MATERIALISED_UP_TO = 32 * 32

# CoPE's query tiles in the models: its backward (autodiff through the
# checkpointed scan) keeps one query tile's residuals against every key,
# O(block_q · L) a head, so half the function's default 128 rows halves it.
COPE_BLOCK_Q = 64

__all__ = ["Cope", "CopeOptions", "Forgetting", "ForgettingOptions", "StickBreaking"]


@dataclasses.dataclass(frozen=True)
class DataDependent(Scheme):
    """What the three share: hooks in causal self-attention, no positions read."""

    relative: bool = True  # their hooks run inside attention
    shift_invariant: bool = True
    order_blind: bool = True  # an encoder under them has no term: order blind
    data_dependent: bool = True

    def check(self, cfg):
        if cfg.relative_cross:
            raise ValueError(
                f"TransformerConfig: position={self.name!r} acts in causal self-attention "
                "only; relative_cross has no term to add"
            )


@dataclasses.dataclass(frozen=True)
class ForgettingOptions(SchemeOptions):
    """Options of "forgetting".

    Attributes:
      bias_init: the gate bias's initial value b (every head): gates start
        at `σ(b)` (5.0: f ≈ 0.993, almost no forgetting at first).
    """

    bias_init: float = pos_lib.FORGET_BIAS_INIT

    def check(self):
        if isinstance(self.bias_init, bool) or not isinstance(self.bias_init, int | float):
            raise ValueError(f"bias_init must be a number, got {self.bias_init!r}")
        if not math.isfinite(self.bias_init):
            raise ValueError(f"bias_init must be finite, got {self.bias_init!r}")


@dataclasses.dataclass(frozen=True)
class Forgetting(DataDependent):
    """Lin et al.'s Forgetting Transformer: per token and head a forget gate
    `f = σ(w·x + b)` of the layer's input; logit (i, j) gains
    `Σ log f_l` over the tokens of the example between j and i
    (`jattn.positions.forgetting`), softmax attention otherwise."""

    Options = ForgettingOptions
    options_key = "forgetting"

    def forget_gates(self, module, cfg, site, x):
        if not site.causal or site.cross:
            return None
        specs = pos_lib.forget_gate_param_specs(
            cfg.d_model, cfg.num_heads, float(self.options(cfg).bias_init)
        )
        params = SchemeParams(specs, cfg.params_dtype, name="forget_gate")()
        return pos_lib.log_forget_gates(params, x)  # [B, T, N]


@dataclasses.dataclass(frozen=True)
class Form(DataDependent):
    """A scheme that replaces softmax attention by a function of its own.

    `materialised_up_to`: the largest T·S at which the default
    (`attention_impl=None`) runs the materialised form."""

    materialised_up_to: ClassVar[int] = ONE_TILE

    def check(self, cfg):
        super().check(cfg)
        if cfg.attention_impl == "pallas":
            raise ValueError(
                f"TransformerConfig: position={self.name!r} runs in 'xla' or 'chunked'; "
                "the Pallas kernels have no reverse scan: attention_impl='pallas'"
            )
        if cfg.attention_dropout_rate:
            raise ValueError(
                f"TransformerConfig: position={self.name!r} has no attention-weight dropout; "
                f"attention_dropout_rate must be 0, got {cfg.attention_dropout_rate}"
            )
        if cfg.capture_attention:
            raise ValueError(
                f"TransformerConfig: position={self.name!r}: capture_attention cannot sow "
                "its weights (they are not a softmax of score-modded logits)"
            )

    def form(self, cfg, tiled, materialised, *args):
        """The layer's attention, `args` after q, k and v: `materialised` for
        `attention_impl="xla"`, and by default (None) up to T·S =
        `materialised_up_to`; `tiled` otherwise."""

        def attend(q, k, v, **visibility):
            small = q.shape[1] * k.shape[1] <= self.materialised_up_to
            impl = cfg.attention_impl
            fn = materialised if impl == "xla" or (impl is None and small) else tiled
            return fn(q, k, v, *args, **visibility)

        return attend


@dataclasses.dataclass(frozen=True)
class CopeOptions(SchemeOptions):
    """Options of "cope".

    Attributes:
      npos_max: the embedding table's length P; counts clip at `P - 1`, so a
        key more than P - 1 open gates away reads the last embedding.
    """

    npos_max: int = 64

    def check(self):
        positive_int("npos_max", self.npos_max)


@dataclasses.dataclass(frozen=True)
class Cope(Form):
    """Golovneva et al.'s contextual positions: query i's gate on key k is
    `σ(s_ik)`, key j's position the sum of the gates from j to i, and the
    logit gains `q_i·e[p_ij]` interpolated between the embeddings at ⌊p⌋ and
    ⌈p⌉; one table `e` `[P, H]` a layer, shared by its heads, starting at 0
    (the term is 0 at initialisation)."""

    Options = CopeOptions
    options_key = "cope"
    materialised_up_to: ClassVar[int] = COPE_MATERIALISED_UP_TO

    def attention_form(self, module, cfg, site):
        if not site.causal or site.cross:
            return None
        zeros = jax.nn.initializers.zeros
        shape = (self.options(cfg).npos_max, cfg.head_dim)
        table = SchemeParams(
            ((("table", zeros, shape, (None, "kv"))),), cfg.params_dtype, name="cope"
        )()
        tiled = functools.partial(cope_attention, block_q=COPE_BLOCK_Q)
        return self.form(cfg, tiled, cope_attention_xla, table["table"])


@dataclasses.dataclass(frozen=True)
class StickBreaking(Form):
    """Tan et al.'s stick-breaking attention: `w_ij = β_ij Π_{j<k≤i} (1 − β_ik)`,
    `β = σ(logit)`, no softmax and no positions; no parameters."""

    def attention_form(self, module, cfg, site):
        if not site.causal or site.cross:
            return None
        return self.form(cfg, stick_breaking_attention, stick_breaking_attention_xla)
