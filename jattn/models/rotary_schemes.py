"""The rotary schemes, one component each: queries and keys rotated by their positions.

"rope" (Su et al.'s rotary embedding, with its extensions to longer inputs
at evaluation, `RopeOptions.scaling`) and "xpos" (Sun et al.'s RoPE with a
per-frequency decay) act through the `rotate` hook only; the arithmetic is
`jattn.positions.rope` and `jattn.positions.xpos`. Registered in
`jattn.models.schemes`. Shapes: B batch, T queries, S keys, N query heads,
K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses

from jattn import positions as pos_lib
from jattn.models.scheme import Scheme, SchemeOptions, int_at_least_0

__all__ = ["Rope", "RopeOptions", "XPos", "XPosOptions"]


@dataclasses.dataclass(frozen=True)
class RopeOptions(SchemeOptions):
    """Options of "rope".

    Attributes:
      max_timescale: RoPE's base wavelength.
      scaling: RoPE's extension to longer inputs, one of
        `jattn.positions.ROPE_SCALINGS` ("none", "pi", "ntk", "yarn"); it acts
        at evaluation and decoding only (`train=False`), so a run trained
        without it is evaluated with it by setting it (training ignores it).
      scaling_factor: the extension factor s >= 1 of `scaling`.
      original_length: the training length YaRN keeps the short wavelengths
        of (0: `max_len`).
      yarn: YaRN's convention ("paper", the default, or "hf"), its band
        `beta_fast` / `beta_slow` and HF's `mscale` / `mscale_all_dim`
        (`jattn.positions.YarnOptions`, which checks them; docs/schemes.md).
    """

    max_timescale: float = 10_000.0
    scaling: str = "none"
    scaling_factor: float = 1.0
    original_length: int = 0
    yarn: pos_lib.YarnOptions = dataclasses.field(default_factory=pos_lib.YarnOptions)

    def check(self):
        if self.scaling not in pos_lib.ROPE_SCALINGS:
            raise ValueError(f"scaling={self.scaling!r}; choose one of {pos_lib.ROPE_SCALINGS}")
        if not float(self.scaling_factor) >= 1.0:
            raise ValueError(f"scaling_factor must be >= 1, got {self.scaling_factor!r}")
        int_at_least_0("original_length", self.original_length)
        if not float(self.max_timescale) > 1.0:
            raise ValueError(f"max_timescale must be > 1, got {self.max_timescale!r}")


@dataclasses.dataclass(frozen=True)
class Rope(Scheme):
    """Su et al.'s rotary embedding; `RopeOptions.scaling` extends it at evaluation."""

    Options = RopeOptions
    options_key = "rope"

    relative: bool = True
    shift_invariant: bool = True

    def check(self, cfg):
        if cfg.head_dim < 2:
            raise ValueError(
                f"TransformerConfig: {self.name} needs head_dim >= 2, got d_model/num_heads="
                f"{cfg.head_dim}"
            )

    def rotate(self, cfg, q, k, q_pos, kv_pos, site):
        opts = self.options(cfg)
        scaling = dict(max_timescale=opts.max_timescale)
        if not site.train and opts.scaling != "none":
            scaling.update(
                scaling=opts.scaling,
                scaling_factor=opts.scaling_factor,
                original_length=opts.original_length or cfg.max_len,
                yarn=opts.yarn,
            )
        return pos_lib.rope(q, q_pos, **scaling), pos_lib.rope(k, kv_pos, **scaling)


@dataclasses.dataclass(frozen=True)
class XPosOptions(SchemeOptions):
    """Options of "xpos".

    Attributes:
      max_timescale: the base wavelength of its rotation (RoPE's default).
      scale_base: the decay length scale γ (Sun et al.'s 512).
    """

    max_timescale: float = RopeOptions.max_timescale
    scale_base: float = 512.0

    def check(self):
        if not float(self.scale_base) > 0:
            raise ValueError(f"scale_base must be > 0, got {self.scale_base!r}")
        if not float(self.max_timescale) > 1.0:
            raise ValueError(f"max_timescale must be > 1, got {self.max_timescale!r}")


@dataclasses.dataclass(frozen=True)
class XPos(Rope):
    """Sun et al.'s xPos: RoPE with a per-frequency exponential decay.

    Queries and keys are measured from a per-row reference, the centre of the
    row's positions (`jattn.positions.xpos_reference`), which cancels in
    `q·k` and keeps the decay factors finite at any absolute position. In a
    causal decoding step the row is the cache's slots (`Site.cache_positions`),
    so every step and the keys earlier steps cached share one reference; a
    full pass takes its own queries' and keys' positions. The two references
    differ, the logits do not (to float32 rounding). `check` refuses a config
    whose rows can span more than `jattn.positions.xpos_max_span`.
    """

    Options = XPosOptions
    options_key = "xpos"

    def check(self, cfg):
        super().check(cfg)
        scale_base = self.options(cfg).scale_base
        limit = pos_lib.xpos_max_span(float(scale_base))
        span = max(cfg.max_len, cfg.random_positions)  # the widest row the config allows
        if span > limit:
            raise ValueError(
                f"TransformerConfig: xpos keeps rows of at most {limit} positions finite in "
                f"float32 at position_options.xpos.scale_base={scale_base}, got "
                f"max(max_len, random_positions)={span}; raise position_options.xpos.scale_base"
            )

    def rotate(self, cfg, q, k, q_pos, kv_pos, site):
        opts = self.options(cfg)
        row = (q_pos, kv_pos) if site.cache_positions is None else (site.cache_positions,)
        base = dict(
            max_timescale=opts.max_timescale,
            scale_base=opts.scale_base,
            reference=pos_lib.xpos_reference(*row),  # [B, 1]
        )
        return (
            pos_lib.xpos(q, q_pos, key=False, **base),
            pos_lib.xpos(k, kv_pos, key=True, **base),
        )
