"""The Transformer's attention layer, `Attention`: self, cross or cached, GQA, the scheme's terms.

The layer owns the projections and the KV cache and calls the core
(`jattn.dot_product_attention`); the arithmetic lives there. Positional
terms are the scheme's (`jattn.models.schemes`): the layer calls its hooks
and never looks at its name. The probe seam (`Attention._probe`) is where
`jattn.analysis.probe`'s interventions act. Parameters and activations carry
logical axis names (`jattn.models.axes`).

Shapes: the letters of `jattn.attention.legend` (D model width, L cache
length in target positions).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jattn import positions as pos_lib
from jattn.attention import dot_product_attention
from jattn.models.attention_weights import materialised_weights
from jattn.models.axes import constrain, param
from jattn.models.config import TransformerConfig
from jattn.models.layer_call import LayerCall
from jattn.models.schemes import Site
from jattn.visibility import Visibility

Array = jax.Array

__all__ = ["MODES", "Attention", "attention_rule"]

_xavier = jax.nn.initializers.xavier_uniform


def attention_rule(
    probe_mask: Array | None, visible: Array | None, vis: Visibility, causal: bool
) -> tuple[Array | None, Visibility]:
    """The mask and visibility a layer attends under: a caller's `visible`
    (bool, broadcastable to `[B, 1, T, S]`: a prefix LM's rule) joins the
    probe's `key_visible` mask `[B, 1, 1, S]` and replaces a causal layer's
    causal rule; without it a causal layer adds `is_causal` to `vis`."""
    if visible is not None:
        return (visible if probe_mask is None else probe_mask & visible), vis
    return probe_mask, (vis & Visibility(is_causal=True) if causal else vis)


# Attention call modes (see `Attention`).
MODES = ("full", "step", "prefill")

_HEADS = ("batch", "length", "heads", "kv")  # logical names of `[B, L, heads, H]`


class Attention(nn.Module):
    """Multi-head attention with GQA/MQA, relative positions and a KV cache.

    The kind is fixed at construction: encoder self-attention (default),
    decoder self-attention (`causal=True`), or encoder–decoder attention
    (`cross=True`: keys/values from the encoder and no positional term, as
    in Shaw et al., unless `relative_cross`). `decode=True` (the flag of Flax's WMT example) gives a
    causal or cross layer a "cache" collection ("cached_key",
    "cached_value", `[B, L, K, H]` for self-attention over L target
    positions, `[B, S, K, H]` for the encoder's keys/values); it is created,
    as zeros, by the "full" call at `init`, which sizes it from its keys.

    Each call names its mode:

      "full"     attend from `x` `[B, T, D]` to `kv` `[B, S, D]` (`kv` is `x`
                 for self-attention). A cache is neither read nor written.
      "step"     decode=True, one token `x` `[B, 1, D]` at `cache_index`.
                 Causal self-attention (`kv` is `x`) writes the token's key
                 and value into slot `cache_index` and attends over the whole
                 cache; causal masking over the slot positions `arange(L)`
                 hides the slots not yet written. Cross-attention (`kv` None)
                 attends over the prefilled encoder keys/values and never
                 reads its "k"/"v" weights.
      "prefill"  decode=True cross-attention: store the projections of `kv`
                 (the encoder output `[B, S, D]`, `x` None); returns None.
                 They depend only on the source, so projecting them once a
                 decode call replaces `2 · B·S·D·K·H` multiply-adds a layer
                 and a step by a read.

    Probing interventions (`jattn.analysis.probe`) are read from the
    "interventions" collection when the caller passes one: "value_where"
    `[B, S]` with "value_replacement" `[B, S, K, H]`, "key_visible" `[B, S]`
    and "head_gate" `[N]`. The cross-attention cache holds the plain
    projections; interventions act on what is read from it, as on fresh
    projections.
    """

    config: TransformerConfig
    causal: bool = False
    cross: bool = False
    decode: bool = False

    @nn.compact
    def __call__(
        self,
        x: Array | None,
        kv: Array | None = None,
        *,
        call: LayerCall | None = None,
        visibility: Visibility | None = None,
    ) -> Array | None:
        """Attend from `x` to `kv` in the call's mode (see the class docstring).

        Args:
          x: the queries' inputs `[B, T, D]` (T = 1 in a "step"); None to "prefill".
          kv: the keys' and values' inputs `[B, S, D]`: `x` itself for
            self-attention, the encoder output for cross-attention; None in a
            cross-attention "step", which reads the cache.
          call: how the layer runs (`jattn.models.layer_call.LayerCall`): its
            mode ("full", "step" or "prefill"), attention dropout at
            `config.attention_dropout_rate` when `train`, the scheme's stack
            state, the slot `cache_index` a causal "step" writes, a caller's
            `visible` rule, the `cache_slot`. None: a "full" call, no dropout.
          visibility: the segment ids and positions of the call
            (`jattn.visibility.Visibility`; the layer adds its causal rule): the
            query side `x`'s `[B, T]` (a step's: at `cache_index`), the key
            side `kv`'s `[B, S]`, or in a causal "step" the cache slots'
            `[B, L]` (with them a step may write a block of T tokens at
            `cache_index`: a decoder-only prompt's prefill; without them the
            slots are at `arange(L)`, no segments). None: no segments,
            positions `arange`.

        Returns:
          `[B, T, D]` in the compute dtype; None for "prefill".
        """
        call = LayerCall() if call is None else call
        mode, slot = call.mode, call.cache_slot
        self._check_call(mode, x, kv, call.cache_index)
        vis = Visibility() if visibility is None else visibility
        step = self.causal and mode == "step"  # writes its keys into the cache, reads it all
        reads_cache = self.cross and mode == "step"
        w = self._weights(queries=mode != "prefill", keys=not reads_cache)
        if mode == "prefill":
            return self._write_cross_cache(*self._project_kv(kv, w), slot)  # None
        q = constrain(self._project_q(x, w), _HEADS)  # [B, T, N, H]
        key, value = self._keys_values(kv, w, reads_cache, vis, slot)  # [B, S, K, H]
        site = self._site(step, call.train, vis, slot)
        q, key = self._rotate(q, key, vis, step, site)
        value = self._probe("values", value)
        if self.decode and self.is_initializing():
            self._create_cache(key, value, slot)
        if step:  # [B, L, K, H], every slot; at positions arange(L) unless given
            key, value, vis = self._write_step(key, value, call.cache_index, vis, slot)
        terms = self._scheme_terms(site, call, x, vis.q_segment_ids)
        mask, vis = attention_rule(self._probe("mask", None), call.visible, vis, self.causal)
        out = self._attend(q, key, value, terms, mask=mask, visibility=vis, train=call.train)
        return self._project_out(out, w)  # [B, T, D]

    # -- checks --------------------------------------------------------------

    def _check_call(self, mode: str, x, kv, cache_index) -> None:
        """Fail clearly on a mode this layer does not have or missing inputs."""
        if mode not in MODES:
            raise ValueError(f"Attention: mode must be one of {MODES}, got {mode!r}")
        if self.decode and not (self.causal or self.cross):
            raise ValueError("Attention: decode=True is for causal self- or cross-attention")
        if mode != "full" and not self.decode:
            raise ValueError(f"Attention: mode={mode!r} needs decode=True")
        if mode == "prefill" and not self.cross:
            raise ValueError("Attention: mode='prefill' is for cross-attention")
        wants_x = mode != "prefill"
        wants_kv = not (self.cross and mode == "step")
        if (x is None) == wants_x or (kv is None) == wants_kv:
            raise ValueError(
                f"Attention(mode={mode!r}, cross={self.cross}): x "
                f"{'required' if wants_x else 'must be None'}, kv "
                f"{'required' if wants_kv else 'must be None (the cache is read)'}"
            )
        if mode == "step" and self.causal and cache_index is None:
            raise ValueError("Attention(decode=True): cache_index is required when decoding")

    @property
    def _relative(self) -> bool:
        """Whether the scheme's relative terms act in this layer: always in
        self-attention, in cross-attention only with `relative_cross`
        (Ontañón et al.'s "rel2")."""
        return self.config.scheme.relative and (not self.cross or self.config.relative_cross)

    def _site(self, step: bool, train: bool, vis: Visibility, slot: str) -> Site:
        """Where the scheme's hooks are called: this layer's kind, and a causal
        step's cache slot positions (`_slot_positions`)."""
        return Site(
            causal=self.causal and not self.config.prefix_lm,
            cross=self.cross,
            train=train,
            cache_positions=self._slot_positions(step, vis.kv_positions, slot),
        )

    def _rotate(self, q: Array, key: Array, vis: Visibility, step: bool, site: Site):
        """The scheme's rotation of `q` `[B, T, N, H]` and `key` `[B, S, K, H]`,
        then its shift of the queries, where its relative terms act (`_relative`);
        a step's new keys are at its queries' positions."""
        if not self._relative:
            return q, key
        cfg = self.config
        kv_pos = vis.q_positions if step else vis.kv_positions
        q, key = cfg.scheme.rotate(cfg, q, key, vis.q_positions, kv_pos, site)
        return cfg.scheme.shift_queries(self, cfg, site, q), key  # [B, T, N, H], [B, S, K, H]

    # -- projections ---------------------------------------------------------

    def _weights(self, *, queries: bool, keys: bool) -> dict[str, Array]:
        """The projections `q` `[D, N, H]`, `k`, `v` `[D, K, H]`, `o` `[N, H, D]`
        and, with `attention_bias`, `q_bias` `[N, H]`, `k_bias`, `v_bias` `[K, H]`.

        Declared in this order (q, k, v, o, then the biases): init draws each
        parameter's rng from a per-module counter, so the order fixes the
        initial values. A cached cross-attention step declares no k/v (it
        never reads them), a prefill no q/o.
        """
        cfg = self.config
        n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_model
        pdt, names = cfg.params_dtype, ("embed", "heads", "kv")
        qkv_init = _xavier(in_axis=0, out_axis=(1, 2))
        w = {}
        if queries:
            w["q"] = param(self, "q", qkv_init, (d, n, h), names, pdt)
        if keys:
            w["k"] = param(self, "k", qkv_init, (d, k, h), names, pdt)
            w["v"] = param(self, "v", qkv_init, (d, k, h), names, pdt)
        if queries:
            out_init = _xavier(in_axis=(0, 1), out_axis=2)
            w["o"] = param(self, "o", out_init, (n, h, d), ("heads", "kv", "embed"), pdt)
        if cfg.attention_bias:
            zeros = nn.initializers.zeros
            if queries:
                w["q_bias"] = param(self, "q_bias", zeros, (n, h), ("heads", "kv"), pdt)
            if keys:
                w["k_bias"] = param(self, "k_bias", zeros, (k, h), ("heads", "kv"), pdt)
                w["v_bias"] = param(self, "v_bias", zeros, (k, h), ("heads", "kv"), pdt)
        return w

    def _project_q(self, x: Array, w: dict[str, Array]) -> Array:
        """Queries `[B, T, N, H]` of `x` `[B, T, D]`."""
        c = self.config.compute_dtype
        q = jnp.einsum("BTD,DNH->BTNH", x, w["q"].astype(c))  # [B, T, N, H]
        return q + w["q_bias"].astype(c)[None, None] if "q_bias" in w else q  # [B, T, N, H]

    def _project_kv(self, kv: Array, w: dict[str, Array]) -> tuple[Array, Array]:
        """Keys and values `[B, S, K, H]` of `kv` `[B, S, D]`."""
        c = self.config.compute_dtype
        key = jnp.einsum("BSD,DKH->BSKH", kv, w["k"].astype(c))  # [B, S, K, H]
        value = jnp.einsum("BSD,DKH->BSKH", kv, w["v"].astype(c))  # [B, S, K, H]
        if "k_bias" in w:
            key = key + w["k_bias"].astype(c)[None, None]  # [B, S, K, H]
            value = value + w["v_bias"].astype(c)[None, None]
        return key, value

    def _keys_values(self, kv, w, reads_cache: bool, vis: Visibility, slot: str):
        """Keys and values `[B, S, K, H]`: the projections of `kv`, or in a
        cross-attention step the prefilled cache's."""
        if reads_cache:
            key, value = self._read_cross_cache(vis.kv_segment_ids, slot)
        else:
            key, value = self._project_kv(kv, w)
        return constrain(key, _HEADS), constrain(value, _HEADS)

    def _project_out(self, out: Array, w: dict[str, Array]) -> Array:
        """`[B, T, N, H]` -> `[B, T, D]`; the probe's head gate acts first."""
        cfg = self.config
        c = cfg.compute_dtype
        out = constrain(self._probe("heads", out), _HEADS)
        y = jnp.einsum("BTNH,NHD->BTD", out, w["o"].astype(c))  # [B, T, D]
        if cfg.attention_bias:
            zeros = nn.initializers.zeros
            o_bias = param(self, "o_bias", zeros, (cfg.d_model,), ("embed",), cfg.params_dtype)
            y = y + o_bias.astype(c)[None, None]  # [B, T, D]
        return constrain(y, ("batch", "length", "embed"))

    # -- attention -----------------------------------------------------------

    def _attend(self, q, key, value, terms: dict, *, mask, visibility: Visibility, train: bool):
        """`jattn.dot_product_attention` `[B, T, N, H]` under `mask` and
        `visibility`, with the scheme's `terms` (`_scheme_terms`: score mod,
        forget-gate terms) and Shaw tables, attention dropout in training,
        and the weights sown when configured; or the scheme's attention form
        where it has one."""
        mod, row_col, form = terms["mod"], terms["row_col"], terms["form"]
        if form is not None:  # causal in the positions, as its site is
            if mask is not None:
                raise ValueError(
                    f"Attention: position={self.config.position!r} takes no attention mask "
                    "(a probe's key_visible intervention)"
                )
            vis = visibility  # a form's own signature: its positions and segment ids
            return form(
                q,
                key,
                value,
                q_positions=vis.q_positions,
                kv_positions=vis.kv_positions,
                q_segment_ids=vis.q_segment_ids,
                kv_segment_ids=vis.kv_segment_ids,
            )  # [B, T, N, H]
        cfg = self.config
        shaw = cfg.scheme.shaw(self, cfg) if self._relative else None
        rate = cfg.attention_dropout_rate if train else 0.0
        out = dot_product_attention(
            q,
            key,
            value,
            mask=mask,
            visibility=visibility,
            relative=shaw,
            score_mod=mod,
            row_col_bias=row_col,
            implementation=cfg.attention_impl,
            dropout_rate=rate,
            dropout_rng=self.make_rng("dropout") if rate > 0 else None,
            # Training steps only: evaluation and decoding keep the guard, and
            # with it the programs (and the rounding) they always had.
            assume_finite=cfg.attention_assume_finite and train,
        )  # [B, T, N, H]
        if cfg.capture_attention:
            self._probe("weights", (q, key, mod, shaw, row_col, mask, visibility))
        return out

    # -- the probe seam ------------------------------------------------------

    def _probe(self, stage: str, x: Any) -> Any:
        """Every probe acts here (`jattn.analysis.probe`), at one of four stages:

        - "values": `x` the values `[B, S, K, H]`; `interventions/value_where`
          `[B, S]` replaces them with `value_replacement` `[B, S, K, H]`.
        - "mask": `x` None; returns `interventions/key_visible` `[B, S]` as an
          attention mask `[B, 1, 1, S]`, or None.
        - "heads": `x` the heads' outputs `[B, T, N, H]`, scaled by
          `interventions/head_gate` `[N]`.
        - "weights": `x` `(q, key, mod, shaw, row_col, mask, visibility)`; sows the
          attention weights `[B, N, T, S]` into "intermediates" (the
          materialising pass of `capture_attention`; returns None).

        Without an "interventions" collection (training, decoding) every stage
        returns `x` unchanged (None for "mask").
        """
        has, get = self.has_variable, self.get_variable
        if stage == "values":
            if not has("interventions", "value_where"):
                return x
            where = get("interventions", "value_where")
            replacement = get("interventions", "value_replacement").astype(x.dtype)
            return jnp.where(where[:, :, None, None], replacement, x)
        if stage == "mask":
            if not has("interventions", "key_visible"):
                return None
            visible = get("interventions", "key_visible")
            return jnp.asarray(visible, bool)[:, None, None, :]
        if stage == "heads":
            if not has("interventions", "head_gate"):
                return x
            gate = get("interventions", "head_gate")  # [N]
            return x * gate.astype(x.dtype)[None, None, :, None]
        if stage == "weights":
            weights = materialised_weights(*x)  # [B, N, T, S]
            self.sow("intermediates", "attention_weights", weights)
            return None
        raise ValueError(f"Attention._probe: unknown stage {stage!r}")

    # -- cache read and write ------------------------------------------------

    def _scheme_terms(self, site: Site, call: LayerCall, x: Array, segment_ids):
        """The scheme's terms in this layer, each None where it has none (all
        of them where its relative terms do not act, `_relative`): "mod" its
        score mod, "row_col" its forget gates' row and column terms, "form"
        the attention function replacing softmax. Called before `_attend`:
        the score mod's parameters are declared before Shaw's tables."""
        if not self._relative:
            return dict(mod=None, row_col=None, form=None)
        scheme, cfg = self.config.scheme, self.config
        mod = scheme.score_mod(self, cfg, site, call.scheme_state)
        gates = scheme.forget_gates(self, cfg, site, x)  # [B, T, N]
        row_col = None
        if gates is not None:
            row_col = self._forget_terms(gates, call, segment_ids)
        return dict(mod=mod, row_col=row_col, form=scheme.attention_form(self, cfg, site))

    def _forget_terms(self, gates: Array, call: LayerCall, segment_ids):
        """The forget gates' `row_col_bias` `(c [B, N, T], −c [B, N, S])`, `c`
        the cumulative sum of the log gates `[B, T, N]`: per segment in a full
        pass; in decoding carried in the cache ("cached_gate", `[B, L, N]`,
        each slot's sum since the start of the row), the step's block summed
        on from the slot before it. Within a segment only differences of `c`
        reach the logits, so both give the same attention."""
        index, slot = call.cache_index, call.cache_slot
        if call.mode != "step":
            c = pos_lib.segment_cumsum(gates, segment_ids)  # [B, T, N]
            if self.decode and self.is_initializing():  # the cache's slots: S = T here
                self.variable("cache", "cached_gate" + slot, jnp.zeros, c.shape, jnp.float32)
            return pos_lib.forget_row_col(c, c)
        if segment_ids is not None:  # a prompt's padding slots (segment 0) add nothing
            gates = jnp.where((segment_ids != 0)[..., None], gates, jnp.zeros_like(gates))
        cached = self.variable("cache", "cached_gate" + slot)
        start = jnp.maximum(index - 1, 0)
        prev = lax.dynamic_slice_in_dim(cached.value, start, 1, axis=1)  # [B, 1, N]
        prev = jnp.where(index > 0, prev, jnp.zeros_like(prev))
        c = prev + jnp.cumsum(gates, axis=1)  # [B, T, N]
        cached.value = lax.dynamic_update_slice_in_dim(cached.value, c, index, axis=1)
        return pos_lib.forget_row_col(c, cached.value)

    def _create_cache(self, key: Array, value: Array, slot: str) -> None:
        """At init: zero "cached_key"/"cached_value" (+ `slot`) shaped like
        `key`/`value` (`[B, L, K, H]` for causal self-attention, `[B, S, K, H]`
        for cross)."""
        self.variable("cache", "cached_key" + slot, jnp.zeros, key.shape, key.dtype)
        self.variable("cache", "cached_value" + slot, jnp.zeros, value.shape, value.dtype)

    def _cache(self, what: str, slot: str) -> tuple[nn.Variable, nn.Variable]:
        """The cache's key and value variables; fails clearly if there is none."""
        if not self.has_variable("cache", "cached_key" + slot):
            raise ValueError(
                f"Attention: no cache to {what}; start from jattn.models.decoding.init_cache "
                "(or prefill, which fills the cross-attention entries)"
            )
        return (
            self.variable("cache", "cached_key" + slot),
            self.variable("cache", "cached_value" + slot),
        )

    def _write_cross_cache(self, key: Array, value: Array, slot: str) -> None:
        """Prefill: store the encoder's keys/values `[B, S, K, H]`; returns None."""
        cached_key, cached_value = self._cache("prefill", slot)
        if cached_key.value.shape != key.shape:
            raise ValueError(
                f"Attention: cross-attention keys {list(key.shape)} do not fit the cache "
                f"{list(cached_key.value.shape)}: init_cache for the source's batch and length"
            )
        cached_key.value, cached_value.value = key, value

    def _read_cross_cache(self, kv_segment_ids: Array | None, slot: str) -> tuple[Array, Array]:
        """A cross-attention step: the prefilled keys/values `[B, S, K, H]`."""
        cached_key, cached_value = self._cache("read", slot)
        key, value = cached_key.value, cached_value.value
        if kv_segment_ids is not None and kv_segment_ids.shape[1] != key.shape[1]:
            raise ValueError(
                f"Attention: the cached keys cover {key.shape[1]} source positions, "
                f"the source has {kv_segment_ids.shape[1]}"
            )
        return key, value

    def _write_step(
        self, key: Array, value: Array, index: Array, vis: Visibility, slot: str
    ) -> tuple[Array, Array, Visibility]:
        """A causal step: write `key`/`value` `[B, 1, K, H]` at slot `index`
        (a block `[B, T, K, H]` at slots `index...` when `vis` gives the
        slots' positions, `kv_positions`).

        Returns:
          The whole cache's keys and values `[B, L, K, H]`, and `vis` with
          the slots at `arange(L)` where it gave no key positions.
        """
        cached_key, cached_value = self._cache("step", slot)
        b, t = key.shape[:2]
        if t != 1 and vis.kv_positions is None:
            raise ValueError(f"Attention(decode=True): one token a step, got length {t}")
        start = (0, index, 0, 0)
        cached_key.value = lax.dynamic_update_slice(cached_key.value, key, start)
        cached_value.value = lax.dynamic_update_slice(cached_value.value, value, start)
        if vis.kv_positions is None:
            length = cached_key.value.shape[1]
            slots = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
            vis = vis.replace(kv_positions=slots)
        return cached_key.value, cached_value.value, vis

    def _slot_positions(self, step: bool, slots: Array | None, slot: str) -> Array | None:
        """`Site.cache_positions`: a causal step's cache slot positions `[B, L]`
        (`slots`, or `_write_step`'s `arange(L)`); None in any other call, and
        at init (no cache yet)."""
        if not step:
            return None
        if slots is not None or not self.has_variable("cache", "cached_key" + slot):
            return slots
        b, length = self.get_variable("cache", "cached_key" + slot).shape[:2]
        return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
