"""Pallas kernels, each beside the plain-JAX reference it is tested against.

- `flash_attention`: the public entry of `implementation="pallas"` (padding,
  block map, Shaw tables, dropout seed, custom VJP).
- `config`: `KernelConfig`, the static description of one call, and each
  backend's compiler parameters (shared by both kernel families).
- `triton_forward` (forward) and `triton_backward` (dq, dk/dv): the GPU
  (Triton) kernels, also what runs in interpret mode on the CPU.
- `mosaic_forward` (forward) and `mosaic_backward` (dq, dk/dv): the same
  kernels in the TPU's style (grid-axis loops, VMEM scratch,
  scalar-prefetched block map).
- `blockmap`: which tile pairs to compute (`jattn.attention.tiles`' SKIP / PARTIAL /
  FULL_LEFT / FULL_RIGHT) and the loop bounds, built in XLA from per-tile
  min/max.
- `tile_math`: the math of one tile, shared by every kernel (named so, not
  `tiles`, to keep it apart from `jattn.attention.tiles`, the tile classes of every
  tiled implementation).
- `reference`: dense plain-JAX reference of the kernel's contract.

- `backend`: which backend runs them, chosen loudly (Triton on a GPU or a
  `PallasBackendError`, never Mosaic GPU by default), and `kernel_report` /
  `describe_backend`, what a call would run (re-exported here).
- `fused_backward`: dq, dk and dv in one kernel (`backward="fused"`).

Modules are imported on demand (`jattn.attention` resolves "pallas" lazily),
so `import jattn` does not import Pallas (nor does `backend`).
"""

from jattn.attention.pallas.backend import PallasBackendError, describe_backend, kernel_report

__all__ = ["PallasBackendError", "describe_backend", "kernel_report"]
