"""Flax layers of the Transformer: embeddings, absolute positions, attention, MLP.

Each module owns parameters and calls core functions (`jattn.dot_product_attention`,
`jattn.positions.*`); the arithmetic lives there. Every parameter carries
logical axis names and the main activations are constrained by name, so a
training loop shards them with `flax.linen` logical axis rules:

    batch   the batch axis B
    length  sequence axes T and S (also the learned position table's rows)
    embed   the model width D
    heads   attention heads, query (N) and key/value (K) alike
    kv      the head dim H
    mlp     the MLP hidden width F
    vocab   the vocabulary V

Shapes: B batch, T query length, S key length, D model width, N query heads,
K key/value heads, H head dim, F MLP width, V vocabulary, R = 2k+1 Shaw distances.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jattn import positions as pos_lib
from jattn.attention import attention_weights, dot_product_attention
from jattn.models.config import TransformerConfig
from jattn.positions import ShawRelative

Array = jax.Array

__all__ = ["AbsolutePositions", "Attention", "Embed", "MLP", "T5RelativeBias", "layer_norm"]

_xavier = jax.nn.initializers.xavier_uniform


def _param(module: nn.Module, name: str, init, shape, names, dtype):
    """A parameter with logical axis names (one per axis)."""
    assert len(names) == len(shape), (name, shape, names)
    return module.param(name, nn.with_logical_partitioning(init, names), shape, dtype)


def constrain(x: Array, names: tuple[str | None, ...]) -> Array:
    """`nn.with_logical_constraint`, a no-op outside a mesh with rules."""
    return nn.with_logical_constraint(x, names)


def layer_norm(config: TransformerConfig, name: str) -> nn.LayerNorm:
    """A LayerNorm whose scale and bias are named ("embed",)."""
    return nn.LayerNorm(
        epsilon=config.layer_norm_epsilon,
        dtype=config.compute_dtype,
        param_dtype=config.params_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        name=name,
    )


class Embed(nn.Module):
    """Token embedding `[V, D]`, optionally reused as the output projection."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.embedding = _param(
            self,
            "embedding",
            nn.initializers.normal(stddev=cfg.d_model**-0.5),
            (cfg.vocab_size, cfg.d_model),
            ("vocab", "embed"),
            cfg.params_dtype,
        )

    def __call__(self, tokens: Array) -> Array:
        """int `[B, T]` -> `[B, T, D]`, scaled by sqrt(D) when configured."""
        cfg = self.config
        x = jnp.take(self.embedding, tokens, axis=0).astype(cfg.compute_dtype)  # [B, T, D]
        if cfg.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(cfg.d_model), cfg.compute_dtype)
        return constrain(x, ("batch", "length", "embed"))

    def attend(self, x: Array) -> Array:
        """Output logits through the embedding: `[B, T, D] -> [B, T, V]`."""
        emb = self.embedding.astype(self.config.compute_dtype)
        return jnp.einsum("BTD,VD->BTV", x, emb)


class AbsolutePositions(nn.Module):
    """Adds a sinusoidal or learned position vector to every embedding."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array, positions: Array) -> Array:
        """`[B, T, D]` plus the vector of each int position `[B, T]`."""
        cfg = self.config
        kind = cfg.absolute_position
        if kind == "sinusoidal":
            pe = pos_lib.sinusoidal(positions, cfg.d_model)  # [B, T, D]
        elif kind == "learned":
            table = _param(
                self,
                "table",
                nn.initializers.normal(stddev=cfg.d_model**-0.5),
                (cfg.max_len, cfg.d_model),
                ("length", "embed"),
                cfg.params_dtype,
            )
            pe = jnp.take(table, positions, axis=0, mode="clip")  # [B, T, D]
        else:
            raise ValueError(f"AbsolutePositions: no absolute scheme in {cfg.position!r}")
        return x + pe.astype(x.dtype)


class T5RelativeBias(nn.Module):
    """The learned T5 bias table `[num_buckets, N]` (one per stack or per layer)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self) -> Array:
        cfg = self.config
        return _param(
            self,
            "table",
            nn.initializers.normal(stddev=0.5),
            (cfg.t5_num_buckets, cfg.num_heads),
            (None, "heads"),
            cfg.params_dtype,
        )


class MLP(nn.Module):
    """Position-wise feed-forward: `relu(x W1 + b1) W2 + b2`."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        d, f, dt = cfg.d_model, cfg.d_ff, cfg.params_dtype
        w1 = _param(self, "wi", _xavier(), (d, f), ("embed", "mlp"), dt)
        b1 = _param(self, "bi", nn.initializers.zeros, (f,), ("mlp",), dt)
        w2 = _param(self, "wo", _xavier(), (f, d), ("mlp", "embed"), dt)
        b2 = _param(self, "bo", nn.initializers.zeros, (d,), ("embed",), dt)
        c = cfg.compute_dtype
        h = jnp.einsum("BTD,DF->BTF", x, w1.astype(c)) + b1.astype(c)  # [B, T, F]
        h = constrain(jax.nn.relu(h), ("batch", "length", "mlp"))
        y = jnp.einsum("BTF,FD->BTD", h, w2.astype(c)) + b2.astype(c)  # [B, T, D]
        return constrain(y, ("batch", "length", "embed"))


class Attention(nn.Module):
    """Multi-head attention with GQA/MQA, relative positions and a KV cache.

    Attributes:
      config: the model config.
      causal: decoder self-attention (causal over positions).
      cross: encoder–decoder attention: keys/values from the encoder and no
        positional term (as in Shaw et al.).
      decode: keep keys/values in the "cache" collection ("cached_key",
        "cached_value", both `[B, L, K, H]` or `[B, S, K, H]`). The first
        call (at `init`) only sizes the cache, from the shape of its keys.

    Causal self-attention in decode mode writes one new key/value a step at
    `cache_index` and attends over the whole cache `[B, L, K, H]`.

    Cross-attention in decode mode caches the encoder's keys/values
    `[B, S, K, H]`: they depend only on the encoder output, not on the step,
    so projecting them once per decode call replaces `2 · B·S·D·K·H`
    multiply-adds a layer and a step by a read. Its calls, once the cache
    exists:

      `x=None, kv=encoded`   prefill: project `kv`, store, return None;
      `kv=None`              a decoding step: attend over the stored
                             keys/values; the "k"/"v" weights are not read;
      `kv=encoded`           recompute (the path before the cache, kept for
                             comparison): project `kv`, leave the cache as is.

    The cache holds the plain projections; interventions ("value_where",
    "key_visible") act on what is read from it, as on fresh projections.
    """

    config: TransformerConfig
    causal: bool = False
    cross: bool = False
    decode: bool = False

    @nn.compact
    def __call__(
        self,
        x: Array | None,
        kv: Array | None,
        *,
        q_segment_ids: Array | None,
        kv_segment_ids: Array | None,
        q_positions: Array | None,
        kv_positions: Array | None,
        t5_table: Array | None = None,
        cache_index: Array | None = None,
    ) -> Array | None:
        """Attend from `x` `[B, T, D]` to `kv` `[B, S, D]`; returns `[B, T, D]`.

        Args:
          x: queries' inputs; None only to prefill a cross-attention cache.
          kv: keys' and values' inputs (`x` itself for self-attention); None
            for a cross-attention step over the cached keys/values.
          q_segment_ids, kv_segment_ids: int `[B, T]`, `[B, S]` or both None.
          q_positions, kv_positions: int `[B, T]`, `[B, S]`.
          t5_table: the stack's shared T5 table `[buckets, N]` (when T5 is
            per stack), else None.
          cache_index: int scalar, where the new key/value goes in the cache
            (causal self-attention in decode mode, after init).
        """
        cfg = self.config
        n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_model
        c, pdt = cfg.compute_dtype, cfg.params_dtype
        if self.decode and not (self.causal or self.cross):
            raise ValueError("Attention: decode=True is for causal self- or cross-attention")
        if (x is None or kv is None) and not (self.cross and self.decode):
            raise ValueError(
                "Attention: x=None (prefill) and kv=None (cached keys/values) need "
                "cross=True and decode=True"
            )
        project = kv is not None  # else keys/values come from the cross-attention cache
        # Init draws each parameter's rng from a per-module counter, so the
        # declaration order (q, k, v, o) fixes the initial values; a cached
        # cross-attention step declares no k/v because it never reads them.
        qkv_init = _xavier(in_axis=0, out_axis=(1, 2))
        wq = _param(self, "q", qkv_init, (d, n, h), ("embed", "heads", "kv"), pdt)
        if project:
            wk = _param(self, "k", qkv_init, (d, k, h), ("embed", "heads", "kv"), pdt)
            wv = _param(self, "v", qkv_init, (d, k, h), ("embed", "heads", "kv"), pdt)
        wo = _param(self, "o", _xavier(in_axis=(0, 1), out_axis=2), (n, h, d),
                    ("heads", "kv", "embed"), pdt)  # fmt: skip
        q = key = value = None
        if x is not None:
            q = jnp.einsum("BTD,DNH->BTNH", x, wq.astype(c))  # [B, T, N, H]
        if project:
            key = jnp.einsum("BSD,DKH->BSKH", kv, wk.astype(c))  # [B, S, K, H]
            value = jnp.einsum("BSD,DKH->BSKH", kv, wv.astype(c))  # [B, S, K, H]
        if cfg.attention_bias:
            zeros = nn.initializers.zeros
            q_bias = _param(self, "q_bias", zeros, (n, h), ("heads", "kv"), pdt)
            if q is not None:
                q = q + q_bias.astype(c)
            if project:
                k_bias = _param(self, "k_bias", zeros, (k, h), ("heads", "kv"), pdt)
                v_bias = _param(self, "v_bias", zeros, (k, h), ("heads", "kv"), pdt)
                key, value = key + k_bias.astype(c), value + v_bias.astype(c)

        if self.cross and self.decode:
            key, value = self._cross_cache(key, value, store=x is None)
            if x is None:
                return None  # prefill: the cache is the result
            if kv_segment_ids is not None and kv_segment_ids.shape[1] != key.shape[1]:
                raise ValueError(
                    f"Attention: the cached keys cover {key.shape[1]} source positions, "
                    f"the source has {kv_segment_ids.shape[1]}"
                )
        q = constrain(q, ("batch", "length", "heads", "kv"))
        key = constrain(key, ("batch", "length", "heads", "kv"))
        value = constrain(value, ("batch", "length", "heads", "kv"))

        relative = None if self.cross else cfg.relative_position
        if relative == "rope":
            q = pos_lib.rope(q, q_positions, max_timescale=cfg.rope_max_timescale)
            key = pos_lib.rope(key, kv_positions, max_timescale=cfg.rope_max_timescale)

        # Probing interventions (jattn.probe): read from the "interventions"
        # collection when the caller passes one; absent, nothing changes.
        value = self._replace_values(value)
        key_mask = self._key_mask()  # [B, 1, 1, S] or None

        if self.decode and not self.cross:
            key, value, kv_positions, q_segment_ids, kv_segment_ids = self._update_cache(
                key, value, kv_positions, q_segment_ids, kv_segment_ids, cache_index
            )

        shaw = None
        if relative == "shaw":
            r, init = 2 * cfg.max_relative_distance + 1, _xavier()
            shaw = ShawRelative(
                key=_param(self, "rel_key", init, (r, h), (None, "kv"), pdt).astype(c),
                value=(
                    _param(self, "rel_value", init, (r, h), (None, "kv"), pdt).astype(c)
                    if cfg.shaw_values
                    else None
                ),
                max_distance=cfg.max_relative_distance,
            )
        bias = None
        if relative == "alibi":
            bias = pos_lib.alibi_bias(pos_lib.alibi_slopes(n), q_positions, kv_positions)
        elif relative == "t5":
            if cfg.t5_per_layer:
                t5_table = T5RelativeBias(cfg, name="t5_bias")()
            if t5_table is None:
                raise ValueError("Attention: position 't5' needs the stack's t5_table")
            buckets = pos_lib.t5_buckets(
                q_positions,
                kv_positions,
                num_buckets=cfg.t5_num_buckets,
                max_distance=cfg.t5_max_distance,
                bidirectional=not self.causal,
            )  # [B, T, S]
            bias = pos_lib.t5_bias(t5_table.astype(jnp.float32), buckets)  # [B, N, T, S]

        args = dict(
            bias=bias,
            mask=key_mask,
            is_causal=self.causal,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            q_positions=q_positions,
            kv_positions=kv_positions,
        )
        out = dot_product_attention(
            q, key, value, relative=shaw, implementation=cfg.attention_impl, **args
        )  # [B, T, N, H]
        if cfg.capture_attention:
            weights = attention_weights(q, key, relative=shaw, **args)  # [B, N, T, S]
            self.sow("intermediates", "attention_weights", weights)
        if self.has_variable("interventions", "head_gate"):
            gate = self.get_variable("interventions", "head_gate")  # [N]
            out = out * gate.astype(out.dtype)[None, None, :, None]
        out = constrain(out, ("batch", "length", "heads", "kv"))
        y = jnp.einsum("BTNH,NHD->BTD", out, wo.astype(c))  # [B, T, D]
        if cfg.attention_bias:
            y = y + _param(self, "o_bias", nn.initializers.zeros, (d,), ("embed",), pdt).astype(c)
        return constrain(y, ("batch", "length", "embed"))

    def _key_mask(self) -> Array | None:
        """`interventions/key_visible` `[B, S]` as an attention mask `[B, 1, 1, S]`."""
        if not self.has_variable("interventions", "key_visible"):
            return None
        visible = self.get_variable("interventions", "key_visible")
        return jnp.asarray(visible, bool)[:, None, None, :]

    def _replace_values(self, value: Array) -> Array:
        """`interventions/value_where` `[B, S]` -> `value_replacement` `[B, S, K, H]`."""
        if not self.has_variable("interventions", "value_where"):
            return value
        where = self.get_variable("interventions", "value_where")
        replacement = self.get_variable("interventions", "value_replacement")
        return jnp.where(where[:, :, None, None], replacement.astype(value.dtype), value)

    def _cross_cache(self, key: Array | None, value: Array | None, *, store: bool):
        """The cross-attention cache: encoder keys/values `[B, S, K, H]`.

        At init (no cache yet) the entries are created with the shape of the
        projected `key` and the projections are used as they are. Afterwards
        `key=None` reads the stored pair, `store=True` (prefill) overwrites it
        with `key`/`value`, and otherwise (recompute) the fresh projections
        are used and the cache is left alone.
        """
        initialised = self.has_variable("cache", "cached_key")
        if key is None:
            if not initialised:
                raise ValueError(
                    "Attention: no cached cross-attention keys/values; prefill the cache "
                    "(jattn.decoding.prefill) before stepping without the encoder output"
                )
            return self.get_variable("cache", "cached_key"), self.get_variable(
                "cache", "cached_value"
            )
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        if initialised and store:
            if cached_key.value.shape != key.shape:
                raise ValueError(
                    f"Attention: cross-attention keys {list(key.shape)} do not fit the cache "
                    f"{list(cached_key.value.shape)}: init_cache for the source's batch and length"
                )
            cached_key.value, cached_value.value = key, value
        return key, value

    def _update_cache(self, key, value, kv_positions, q_segment_ids, kv_segment_ids, index):
        """Write this step's key/value at `index`; attend over the whole cache.

        At init (no cache yet) the cache is created with the shape of `key`
        (the full target length) and the call attends normally. Afterwards the
        query is one token at position `index`; causal masking over the cache
        positions `arange(L)` hides the slots not yet written.
        """
        initialised = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        if not initialised:
            return key, value, kv_positions, q_segment_ids, kv_segment_ids
        b, t = key.shape[:2]
        if t != 1:
            raise ValueError(f"Attention(decode=True): one token a step, got length {t}")
        if index is None:
            raise ValueError("Attention(decode=True): cache_index is required when decoding")
        start = (0, index, 0, 0)
        cached_key.value = lax.dynamic_update_slice(cached_key.value, key, start)
        cached_value.value = lax.dynamic_update_slice(cached_value.value, value, start)
        length = cached_key.value.shape[1]
        kv_positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
        return cached_key.value, cached_value.value, kv_positions, None, None
