"""Pallas kernels, each beside the plain-JAX reference it is tested against.

- `flash_attention`: the public entry of `implementation="pallas"` (padding,
  block map, Shaw tables, custom VJP).
- `flash_pallas` (forward) and `flash_bwd` (dq, dk/dv): the GPU (Triton)
  kernels, also what runs in interpret mode on the CPU.
- `flash_mosaic` (forward) and `flash_mosaic_bwd` (dq, dk/dv): the same
  kernels in the TPU's style (grid-axis loops, VMEM scratch,
  scalar-prefetched block map).
- `flash_blockmap`: which tile pairs to compute (skip / general / fast) and
  the loop bounds, built in XLA from per-tile min/max.
- `flash_tiles`: the math of one tile, shared by every kernel.
- `flash_reference`: dense plain-JAX reference of the kernel's contract.

Modules are imported on demand (`jattn.attention` resolves "pallas" lazily),
so `import jattn` does not import Pallas.
"""
