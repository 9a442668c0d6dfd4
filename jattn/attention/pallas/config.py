"""What the flash kernels are given, shared by both kernel families.

`KernelConfig` is what `preparation.prepare` decides once per call (tile
sizes, which optional inputs exist, the visibility and dropout rules) and
what every kernel reads; it is hashable, so it keys compilation. The
compiler parameters of each backend are built from it here, so the Mosaic
(TPU) kernels do not depend on the Triton (GPU) modules, nor the other way.

`KernelInputs` names every array a kernel may read (None where absent); the
kernels' BlockSpecs come in the same NamedTuple, so a kernel reads
`refs.query`, `refs.tile_classes`, ... `TileMaps` is one tiling's block map
and loop bounds, `FixedInputs` what gets no gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jattn.attention.pallas.tile_dot import TRITON_X3, TRITON_X3_INTERPRET
from jattn.visibility import Visibility

Array = jax.Array

__all__ = [
    "COL_DIMS",
    "ROW_DIMS",
    "SQ",
    "BackwardTiles",
    "FixedInputs",
    "KernelConfig",
    "KernelInputs",
    "TileMaps",
    "dbias_kind",
    "dkv_config",
    "mod_grad_shapes",
    "mosaic_params",
    "col_sums",
    "only_specified",
    "row_sums",
    "triton_params",
]

# A squeezed block dimension: `pl.squeezed` on recent jax, None before.
SQ = getattr(pl, "squeezed", None)

# The row and column terms (`row_col_bias`) as the kernels read them: a row
# term `[B, N, Tp, 1]` and a column term `[B, N, 1, Sp]` are biases with
# these `bias_dims` (which of `(B, N, T, S)` they have in full), so every
# kernel loads their tiles with its bias BlockSpecs and loaders.
ROW_DIMS = (True, True, True, False)
COL_DIMS = (True, True, False, True)


@dataclasses.dataclass(frozen=True)
class BackwardTiles:
    """The split backward's tiles and Triton warps, per kernel: `(block_q,
    block_k)` and warps of the dq kernel and of the dk/dv kernel, each None
    for what `flash_attention`'s `backward_blocks` / `backward_warps` (or
    the defaults) give both. The two kernels loop over different axes (dq
    over key tiles, dk/dv over query tiles and the G heads of a kv head)
    and hold different accumulators, so their best tiles need not agree
    (docs/gpu.md: the sweep times them apart). `backward="fused"` runs one
    tiling and takes only tiles that agree; `backward="atomic"` runs the
    dk/dv kernel alone and refuses the dq kernel's fields."""

    dq_blocks: tuple[int, int] | None = None
    dkv_blocks: tuple[int, int] | None = None
    dq_warps: int | None = None
    dkv_warps: int | None = None


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static description of one flash call (hashable: it keys compilation).

    `bias_dims` / `mask_dims` say which of the axes `(B, N, T, S)` the bias /
    mask has in full (the others are 1), or are None when absent. `row_col`:
    row and column terms are added to the logits (`KernelInputs.row_bias`,
    `col_bias`).
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
    row_col: bool = False  # row and column terms in the logits (`ROW_DIMS`, `COL_DIMS`)
    row_col_grad: bool = True  # backward: their gradients, dS summed over keys and over queries
    window: tuple[int, int] | None = None  # (left, right), see `jattn.masks.visible`
    dropout_rate: float = 0.0  # attention-weight dropout (0 = off)
    dropout_broadcast_batch: bool = False  # one keep mask for every batch row
    # "split" (dq and dk/dv kernels) | "fused" (one kernel) | "atomic" (dk/dv adds dq)
    backward: str = "split"
    score_mod: Any = None  # score_mod_tiles.ModSpec or None (its `grad`: params' gradient)
    precision: str = "tf32x3"  # float32 dots of the Triton kernels: tile_dot.PRECISIONS
    # Tp (the padded query length) when the Triton kernels add a distance mod's
    # Toeplitz tiles (`distance_tiles`, input `KernelInputs.distance_tiles`), else 0.
    distance_tiles: int = 0
    # The split backward's dk/dv kernel on its own tiling: (block_q, block_k,
    # warps), read through `dkv_config`; None when it shares this config's.
    # This config (block sizes, warps) is then the dq kernel's.
    dkv_tiling: tuple[int, int, int | None] | None = None
    # The kernel's key and value inputs arrive halved (`halve_kv`); its
    # logits, dP and dq take the factor 2 back (`kv_unscale`).
    kv_halved: bool = False

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def far_right(self) -> int:
        return 2 * self.max_distance

    @property
    def use_dropout(self) -> bool:
        return self.dropout_rate > 0.0

    @property
    def mod_grad(self) -> bool:
        """The backward computes the score mod's params gradient."""
        return self.score_mod is not None and self.score_mod.grad

    @property
    def kv_unscale(self) -> float:
        """What undoes `halve_kv` in a product with a key or value input: 2 or 1."""
        return 2.0 if self.kv_halved else 1.0

    @property
    def qk_scale(self) -> float:
        """The logits' factor on `q · k` of the kernel's key input: the softmax
        scale, times `kv_unscale` (a power of two: the same float32 logits)."""
        return self.scale * self.kv_unscale

    def tile_visibility(self, q_pos, kv_pos, q_seg, kv_seg) -> Visibility:
        """A PARTIAL tile's `jattn.visibility.Visibility` (`tile_math.tile_scores`):
        the call's rules (causal, window) on the tile's query and key
        positions and segment ids (vectors, or None where unused)."""
        return Visibility(
            is_causal=self.causal,
            local_window_size=self.window,
            q_positions=q_pos,
            kv_positions=kv_pos,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
        )


class TileMaps(NamedTuple):
    """One tiling's block map and loop bounds (see `blockmap.tiling`)."""

    classes: Array  # int32 [B, N|1, nT, nS]: jattn.attention.tiles' SKIP / PARTIAL / FULL_*
    row_bounds: Array  # int32 [B, N|1, 4, nT]: (lo, flo, fhi, hi) per query tile
    col_bounds: Array  # int32 [B, N|1, 4, nS]: the same per key tile


class FixedInputs(NamedTuple):
    """Padded kernel inputs that get no gradient."""

    q_positions: Array | None  # int32 [B, Tp] (with causal, a window or Shaw terms)
    kv_positions: Array | None  # int32 [B, Sp]
    q_segments: Array | None  # int32 [B, Tp]
    kv_segments: Array | None  # int32 [B, Sp]
    mask: Array | None  # int8 (Triton) / int32 (Mosaic) [B|1, N|1, Tp|1, Sp|1]
    dropout_seed: Array | None  # int32 [2]
    forward_maps: TileMaps
    backward_maps: TileMaps  # the backward's (the dq kernel's) tiling
    # [B, Sp, K, 1] in the key dtype: NaN at keys whose key or value had a
    # non-finite entry (zeroed in `key` / `value`), else 0; added to the keys
    # the forward kernel reads (see `flash_attention._forward_keys`).
    key_poison: Array | None = None
    # The dk/dv kernel's tiling when it has its own (`KernelConfig.dkv_tiling`), else None.
    dkv_maps: TileMaps | None = None


class KernelInputs(NamedTuple):
    """Every array a kernel may read, in the Triton layout (see
    `triton_forward.flash_forward`); None where absent or unused. The same
    NamedTuple carries a kernel's BlockSpecs and, inside it, its refs."""

    query: Array  # [B, Tp, N, H]
    key: Array  # [B, Sp, K, H]
    value: Array  # [B, Sp, K, Hv]
    key_term: Array | None = None  # float32 [B, Tp, N, Rp]: scale * q @ Shaw key tableᵀ
    bias: Array | None = None  # [B|1, N|1, Tp|1, Sp|1]
    row_bias: Array | None = None  # float32 [B, N, Tp, 1]: the row term, added per query
    col_bias: Array | None = None  # float32 [B, N, 1, Sp]: the column term, added per key
    q_positions: Array | None = None
    kv_positions: Array | None = None
    q_segments: Array | None = None
    kv_segments: Array | None = None
    mask: Array | None = None
    dropout_seed: Array | None = None
    tile_classes: Array | None = None
    row_bounds: Array | None = None
    col_bounds: Array | None = None
    d_out: Array | None = None  # backward: [B, Tp, N, Hv] cotangent of the output
    lse: Array | None = None  # backward: float32 [B, N, Tp]
    delta: Array | None = None  # backward: float32 [B, N, Tp], rowsum(dO * O) + pr · dpr
    d_value_mass: Array | None = None  # backward: float32 [B, Tp, N, Rp], cotangent of pr
    mod_params: tuple[Array, ...] | None = None  # the score mod's leaves (kernel shapes), whole
    distance_tiles: Array | None = None  # float32 [N, nd*bq, bk]: see `distance_tiles`, whole


def only_specified(inputs: KernelInputs, specs: KernelInputs) -> KernelInputs:
    """`inputs` with None wherever `specs` has no BlockSpec (pallas_call wants
    the arguments and their specs in the same structure)."""
    return inputs._replace(
        **{f: None for f, spec in zip(specs._fields, specs) if spec is None}  # noqa: B905
    )


def mod_grad_shapes(cfg: KernelConfig) -> tuple[tuple[int, ...], ...]:
    """Kernel shapes of the score-mod leaves that get a gradient (none
    unless `cfg.mod_grad`): one params partial-sum output of the dq kernels each."""
    if not cfg.mod_grad:
        return ()
    spec = cfg.score_mod
    pairs = zip(spec.kernel_shapes, spec.differentiable, strict=True)
    return tuple(shape for shape, d in pairs if d)


def dbias_kind(cfg: KernelConfig) -> str | None:
    """Where the bias gradient is reduced: "full" (dq kernel writes dS tiles),
    "rows" (dq kernel sums over keys), "cols" (dk/dv kernel sums over queries)."""
    if cfg.bias_dims is None or not cfg.bias_grad:
        return None
    _, _, full_t, full_s = cfg.bias_dims
    if not full_s:
        return "rows"
    return "full" if full_t else "cols"


def row_sums(cfg: KernelConfig) -> bool:
    """The dq kernel returns dS summed over keys, `[B, N, Tp]`: the gradient of
    a bias of kind "rows" and of the row term (one sum serves both)."""
    return dbias_kind(cfg) == "rows" or (cfg.row_col and cfg.row_col_grad)


def col_sums(cfg: KernelConfig) -> bool:
    """The dk/dv kernel returns dS summed over queries, `[B, N, Sp]`: the
    gradient of a bias of kind "cols" and of the column term."""
    return dbias_kind(cfg) == "cols" or (cfg.row_col and cfg.row_col_grad)


def dkv_config(cfg: KernelConfig) -> KernelConfig:
    """The config of the split backward's dk/dv kernel: `cfg` on the tiling
    of `cfg.dkv_tiling` when it has one, else `cfg` itself."""
    if cfg.dkv_tiling is None:
        return cfg
    block_q, block_k, warps = cfg.dkv_tiling
    return dataclasses.replace(
        cfg, block_q=block_q, block_k=block_k, num_warps=warps, dkv_tiling=None
    )


def triton_params(cfg: KernelConfig):
    """Triton compiler parameters (warps, pipeline stages) on the GPU, else
    None (interpret mode). On the GPU they are never None: they are what
    selects the Triton lowering, and a missing Triton backend raises
    `backend.PallasBackendError` instead of falling through to Mosaic GPU."""
    if cfg.backend != "gpu":
        return None
    from jattn.attention.pallas.backend import triton_compiler_params

    return triton_compiler_params(cfg.num_warps, cfg.num_stages)


def mosaic_params(cfg: KernelConfig, semantics: tuple[str, ...]):
    """Mosaic compiler parameters (grid axis semantics) on the TPU, else None."""
    if cfg.backend != "tpu":
        return None
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics)


def _takes_triton_x3(cfg: KernelConfig) -> bool:
    return cfg.backend in ("gpu", "interpret") and cfg.precision == "tf32x3"


def with_triton_x3(cfg: KernelConfig) -> KernelConfig:
    """`cfg` with its "tf32x3" dots done by Triton (`tile_dot.TRITON_X3`)
    when it compiles for a GPU, and by Triton's split done by hand
    (`TRITON_X3_INTERPRET`) when the same kernels are interpreted; unchanged
    otherwise. For the code whose float32 head-dim-128 builds spill with the
    hand split and not with Triton's: the split dq kernel, the fused
    kernel's dq half and the distance tiles' gradient (docs/gpu.md); the
    forward and dk/dv tiles keep the hand split, which spills less there.
    Those kernels take their keys and values through `halve_kv`."""
    if not _takes_triton_x3(cfg):
        return cfg
    x3 = TRITON_X3 if cfg.backend == "gpu" else TRITON_X3_INTERPRET
    return dataclasses.replace(cfg, precision=x3)


def halve_kv(cfg: KernelConfig, ins: KernelInputs) -> tuple[KernelConfig, KernelInputs]:
    """`(cfg, ins)` for a kernel whose dots `with_triton_x3` gives to
    Triton's TF32x3, at float32: keys and values halved in XLA and
    `cfg.kv_halved` set; else unchanged.

    Triton rounds each float32 operand to a TF32 head with `cvt.rna`, which
    carries |x| >= 3.40199e38 into ±Inf; a 0 weight (a masked key's dS)
    times Inf is NaN, and a nonzero one gives ±Inf where the product is
    finite. Halved, no finite key or value comes near: the kernels multiply
    the 2 back (`qk_scale` on the logits, `kv_unscale` on dP and dq), and
    since a power of two commutes with the rounding the results are
    bit-identical to the unhalved ones short of subnormal inputs. Queries
    and the output cotangent are left as they are: at such magnitudes their
    logits and dP overflow in every implementation. The cost is one float32
    copy of the keys and values per backward, made in XLA."""
    if not _takes_triton_x3(cfg) or ins.key.dtype != jnp.float32:
        return cfg, ins
    half = jnp.float32(0.5)
    return dataclasses.replace(cfg, kv_halved=True), ins._replace(
        key=ins.key * half, value=ins.value * half
    )
