"""Static configuration of one flash call, shared by both kernel families.

`KernelConfig` is what `flash_attention.prepare` decides once per call (tile
sizes, which optional inputs exist, the visibility and dropout rules) and
what every kernel reads; it is hashable, so it keys compilation. The
compiler parameters of each backend are built from it here, so the Mosaic
(TPU) kernels do not depend on the Triton (GPU) modules, nor the other way.
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

__all__ = ["SQ", "KernelConfig", "dbias_kind", "mosaic_params", "triton_params"]

# A squeezed block dimension: `pl.squeezed` on recent jax, None before.
SQ = getattr(pl, "squeezed", None)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static description of one flash call (hashable: it keys compilation).

    `bias_dims` / `mask_dims` say which of the axes `(B, N, T, S)` the bias /
    mask has in full (the others are 1), or are None when absent.
    """

    block_q: int
    block_k: int
    seq_k: int  # true key length; keys at or after it are padding
    num_heads: int
    num_kv_heads: int
    scale: float
    causal: bool
    max_distance: int
    use_pos: bool
    use_seg: bool
    use_qr: bool
    use_pr: bool
    bias_dims: tuple[bool, bool, bool, bool] | None
    mask_dims: tuple[bool, bool, bool, bool] | None
    map_per_head: bool
    num_rel: int  # width of the relative tables (2k+1, padded on the GPU)
    backend: str  # "interpret" | "gpu" | "tpu" | "tpu_interpret"
    num_warps: int | None = None
    num_stages: int | None = None
    bias_grad: bool = True  # backward: compute the bias gradient at all
    window: tuple[int, int] | None = None  # (left, right), see `jattn.masks.visible`
    dropout_rate: float = 0.0  # attention-weight dropout (0 = off)
    dropout_broadcast_batch: bool = False  # one keep mask for every batch row

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def far_right(self) -> int:
        return 2 * self.max_distance

    @property
    def use_dropout(self) -> bool:
        return self.dropout_rate > 0.0


def dbias_kind(cfg: KernelConfig) -> str | None:
    """Where the bias gradient is reduced: "full" (dq kernel writes dS tiles),
    "rows" (dq kernel sums over keys), "cols" (dk/dv kernel sums over queries)."""
    if cfg.bias_dims is None or not cfg.bias_grad:
        return None
    _, _, full_t, full_s = cfg.bias_dims
    if not full_s:
        return "rows"
    return "full" if full_t else "cols"


def triton_params(cfg: KernelConfig):
    """Triton compiler parameters (warps, pipeline stages) on the GPU, else None."""
    if cfg.backend != "gpu":
        return None
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError:  # pragma: no cover - depends on the jax build
        return None
    params = getattr(pltriton, "CompilerParams", None)
    if params is None:  # pragma: no cover
        return None
    return params(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def mosaic_params(cfg: KernelConfig, semantics: tuple[str, ...]):
    """Mosaic compiler parameters (grid axis semantics) on the TPU, else None."""
    if cfg.backend != "tpu":
        return None
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics)
