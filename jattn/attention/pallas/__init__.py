"""The Pallas flash-attention kernels (`implementation="pallas"`), one module a concern.

- `flash_attention`: the public entry of `implementation="pallas"` and the
  kernels' custom VJP (bias and score-mod gradients reduced after them).
- `preparation`: everything before the kernels: tile sizes and warps
  (`config.BackwardTiles` resolved), padding, the Shaw key-term table, block
  maps, the static configs (`prepare`).
- `config`: `KernelConfig`, the static description of one call,
  `BackwardTiles`, the kernels' inputs, and each backend's compiler
  parameters (shared by both kernel families).
- `backend`: which backend runs them, chosen loudly (Triton on a GPU or a
  `PallasBackendError`, never Mosaic GPU by default), the default tiles and
  warps, and `kernel_report` / `describe_backend`, what a call would run
  (re-exported here).
- `triton_forward` (the forward kernel and the helpers the Triton kernels
  share), `triton_backward` (dq, dk/dv), `fused_backward` (dq, dk and dv
  in one kernel, `backward="fused"`) and `atomic_backward` (the dk/dv
  kernel adding dq by atomic adds, `backward="atomic"`): the GPU (Triton)
  kernels, also what runs in interpret mode on the CPU.
- `mosaic_forward` (forward) and `mosaic_backward` (dq, dk/dv): the same
  kernels in the TPU's style (grid-axis loops, VMEM scratch,
  scalar-prefetched block map).
- `mosaic_gpu_attention` (`flash_attention(backend="mosaic_gpu")`: the plain
  case only, every other feature refused; its tiles and custom VJP),
  `mosaic_gpu_forward`, `mosaic_gpu_backward` (dq, dk/dv) and
  `mosaic_gpu_stream` (the TMA ring a memory warpgroup fills): Mosaic GPU
  kernels for Hopper (wgmma, TMA, warpgroups), chosen only by name.
- `blockmap`: which tile pairs to compute (`jattn.attention.tiles`' SKIP / PARTIAL /
  FULL_LEFT / FULL_RIGHT) and the loop bounds, built in XLA from per-tile
  min/max.
- `tile_math`: the math of one tile, shared by every kernel (named so, not
  `tiles`, to keep it apart from `jattn.attention.tiles`, the tile classes of every
  tiled implementation); `tile_dot`: how two tiles multiply (the float32
  precisions, the TF32 split).
- `score_mod_tiles`: a `jattn.ScoreMod` rewritten into what the kernels
  lower, applied per tile, forward and backward; `score_mod_checks`:
  whether it lowers on a backend, and what its tile backward costs.
- `distance_tiles`: a distance-table score mod read as Toeplitz tiles;
  `triton_distance_grad` and `mosaic_distance_grad`: those tiles' gradient.

The kernels' plain-JAX reference is tests/kernel_oracle.py, outside the
package: the tests compare every kernel with it.

Modules are imported on demand (`jattn.attention` resolves "pallas" lazily),
so `import jattn` does not import Pallas (nor does `backend`).
"""

from jattn.attention.pallas.backend import PallasBackendError, describe_backend, kernel_report

__all__ = ["PallasBackendError", "describe_backend", "kernel_report"]
