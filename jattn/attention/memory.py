"""Closed-form byte counts of what attention keeps in memory: its logits and the KV cache.

They size a config before anything compiles (count the representation you
are materialising), and `xla_attention_temp_bytes` checks them against XLA's
own figure for the compiled program (`memory_analysis()`).

- Logits: the xla path holds the `[B, N, T, S]` float32 scores and the
  weights: 2 arrays of `B·N·T·S·4` bytes at once in the forward pass (the
  mask is applied inside the fused exponential, so masking adds none). The chunked
  path holds the same arrays for one `[block_q, block_k]` tile at a time; the
  Pallas kernel holds a tile in on-chip memory (SRAM/VMEM) and nothing of
  size `T·S` in device memory.
- What the logits count predicts, per compiler: `total` (2 arrays) is what
  the xla path's program holds when XLA keeps the scores and the weights
  apart, and an upper bound: XLA may write the softmax over the scores'
  buffer, leaving one array (`per_array`) and query-sized arrays. Which it
  does is the compiler's choice (measured below), so only the bounds hold
  everywhere.
- KV cache for decoding: `layers × 2 (K and V) × kv heads × (context +
  source) × head dim × bytes` per sequence. Each decoder layer caches its
  self-attention keys/values for the `context` target positions and its
  cross-attention keys/values for the `source` encoder positions (projected
  once per decode call instead of at every step). MHA (kv heads = heads),
  GQA and MQA (kv heads = 1) differ only in the kv-head count.

The compilers measured with `xla_attention_temp_bytes` (B·N = 8, H = 64,
float32, T = S = 512 / 1024 / 2048, compiled temp over `total`): XLA:CPU of
jaxlib 0.10.2 and 0.11.2 keeps both arrays, causal or not (1.06 / 1.03 /
1.02); XLA:CPU of jaxlib 0.12.0.1 keeps both under a causal mask (the same
ratios) and, without a mask, one on this machine (0.63 / 0.56 / 0.53:
`per_array` plus `B·N·T·(2H+1)` floats) but both at T = 512 on CI's
(17.8 MB, 1.06). XLA:GPU: not measured yet. tests/test_memory.py holds each
compiler to its figure, or to the bounds where it varies.

Pure python and jax; no flax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = [
    "LogitsMemory",
    "attention_logits_bytes",
    "kv_cache_bytes",
    "xla_attention_temp_bytes",
]


@dataclasses.dataclass(frozen=True)
class LogitsMemory:
    """Bytes of score-shaped arrays one attention call keeps at once."""

    implementation: str
    per_array: int  # one [B, N, T, S] (or one tile) float32 array
    arrays: int  # how many such arrays are live together
    where: str  # "device memory" or "on-chip"

    @property
    def total(self) -> int:
        return self.per_array * self.arrays


def attention_logits_bytes(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    *,
    implementation: str,
    block_q: int = 512,
    block_k: int = 512,
) -> LogitsMemory:
    """Score-shaped bytes of one forward attention call.

    Args:
      batch, heads, q_len, kv_len: B, N, T, S.
      implementation: "xla", "chunked" or "pallas".
      block_q, block_k: tile sizes of the chunked and Pallas paths.

    Returns:
      A `LogitsMemory`; logits are float32 (4 bytes) in every implementation.
    """
    arrays = 2  # scores and weights
    if implementation == "xla":
        return LogitsMemory("xla", 4 * batch * heads * q_len * kv_len, arrays, "device memory")
    tile = 4 * batch * heads * min(block_q, q_len) * min(block_k, kv_len)
    if implementation == "chunked":
        return LogitsMemory("chunked", tile, arrays, "device memory")
    if implementation == "pallas":
        # One program owns one (batch, head, query tile); its scores never
        # leave on-chip memory.
        per_program = 4 * min(block_q, q_len) * min(block_k, kv_len)
        return LogitsMemory("pallas", per_program, arrays, "on-chip")
    raise ValueError(f"attention_logits_bytes: unknown implementation {implementation!r}")


def kv_cache_bytes(
    *,
    num_layers: int,
    num_kv_heads: int,
    context: int,
    head_dim: int,
    dtype=jnp.float32,
    batch: int = 1,
    source_length: int | None = None,
) -> int:
    """Decoder KV cache: layers × 2 × K × (context + source) × H × bytes × B.

    Args:
      num_layers: decoder layers.
      num_kv_heads: K.
      context: target positions L (self-attention keys/values `[B, L, K, H]`).
      head_dim: H.
      dtype: the cache's dtype (the model's compute dtype).
      batch: rows B (B·W for beam search, which keeps both per beam).
      source_length: encoder positions S (cross-attention keys/values
        `[B, S, K, H]`); default `context`, as `jattn.decoding.init_cache`
        assumes; 0 counts self-attention only.

    Returns:
      Bytes of every cached key and value (the 4-byte index not counted).
    """
    source = context if source_length is None else source_length
    itemsize = jnp.dtype(dtype).itemsize
    return num_layers * 2 * num_kv_heads * (context + source) * head_dim * itemsize * batch


def xla_attention_temp_bytes(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    *,
    kv_heads: int | None = None,
    is_causal: bool = False,
    implementation: str = "xla",
) -> int:
    """XLA's compiled temporary memory for one forward attention call.

    Compiles (does not run) `jattn.dot_product_attention` on abstract inputs
    and reads `memory_analysis().temp_size_in_bytes`.
    """
    from jattn.attention import dot_product_attention

    kv_heads = kv_heads or heads
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, head_dim), jnp.float32)
    fn = jax.jit(
        lambda q, k, v: dot_product_attention(
            q, k, v, is_causal=is_causal, implementation=implementation
        )
    )
    analysis = fn.lower(q, kv, kv).compile().memory_analysis()
    if analysis is None:
        raise RuntimeError("this backend reports no memory analysis")
    return int(analysis.temp_size_in_bytes)
