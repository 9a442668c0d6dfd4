"""`TransformerConfig`: every hyperparameter of the encoder–decoder, checked once.

A frozen dataclass so it can be a static argument of `jax.jit` and a field of
a flax module. Experiment configs build one from a dict
(`TransformerConfig.from_dict(config.model)` or `TransformerConfig(**d)`);
every check runs in `__post_init__`, before anything is traced or compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from jattn.attention import IMPLEMENTATIONS
from jattn.models.architectures import ARCHITECTURES, Architecture, get_architecture
from jattn.models.schemes import Scheme, get_scheme
from jattn.positions import ROPE_SCALINGS, YARN_CONVENTIONS

__all__ = ["ARCHITECTURES", "SHAW_TERMS", "TransformerConfig"]


# The terms of Shaw's relative attention a model can have (`shaw_terms`, "+"-joined):
# "key": a^K, a learned vector per clipped distance added to the keys (Shaw et al.);
# "value": a^V, the same for the values (Shaw et al.);
# "bias": a learned scalar per clipped distance and head added to the logits
#   (Ontañón et al. 2022's "rel-b"; with "key" their "rel-eb").
SHAW_TERMS = ("key", "value", "bias")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"TransformerConfig.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters of `jattn.models.Transformer`.

    Attributes:
      vocab_size: shared vocabulary size V (token 0 = padding and decoder
        start, token 1 = end of sequence).
      d_model: model width D.
      num_heads: query heads N; `d_model / num_heads` is the head dim H.
      num_kv_heads: key/value heads K (N = MHA, 1 < K < N = GQA, 1 = MQA);
        None means `num_heads`.
      num_layers: layers per stack (encoder and decoder each; an encoder-only
        model's one stack has `num_layers`); a decoder-only
        model's one stack has `2 * num_layers` (as many as encoder plus
        decoder, so switching `architecture` keeps the depth and, but for
        the cross-attention, the parameter count).
      d_ff: hidden width of the position-wise MLP.
      dropout_rate: dropout on embeddings and on every sub-layer output.
      attention_dropout_rate: dropout on the attention weights of every
        attention layer in training (0 in the paper; Flax's WMT example uses
        0.1), through `jattn.dot_product_attention`'s `dropout_rate`.
      max_len: longest sequence (learned position table size; decoding's
        `max_length` may not exceed it for "learned").
      position: positional scheme of the whole model, a name registered in
        `jattn.models.SCHEMES`. Relative schemes act in encoder and decoder
        self-attention, and also in encoder-decoder attention with
        `relative_cross`.
      max_relative_distance: Shaw's clip distance k.
      shaw_terms: which of Shaw's terms the "shaw" schemes have, "+"-joined
        from `SHAW_TERMS`: "key+value" (Shaw et al.), "key" (Ontañón et
        al.'s rel-e), "bias" (rel-b), "key+bias" (rel-eb), ...
      relative_cross: the relative scheme also in decoder-to-encoder attention,
        on decoder position t and encoder position s (Ontañón et al.'s "rel2";
        for "t5" each cross-attention layer has its own bidirectional table).
      attention_impl: `implementation` passed to `jattn.dot_product_attention`
        (None picks the best for the backend and shapes).
      attention_assume_finite: training steps call attention with
        `assume_finite=True`, skipping its guard against non-finite hidden
        keys: the model's keys and values are its own projections, finite
        unless the run has diverged (which the train step's NaN check
        catches). Saves 3-4% of the main job's CPU train step. Equal results
        to float32 rounding; bit-identical or not depends on XLA's fusion of
        the step (the main job's config: bit-identical, checked with `jattn
        bench variants`), so it is off unless a config turns it on.
        Evaluation and decoding keep the guard (without it their programs
        round the eval loss otherwise in the 7th digit). A resumed run may
        change it (`jattn.train.resume_keys.MODEL_RESUME_SAFE_KEYS`).
      pre_norm: pre-layer-norm residual blocks (plus a final norm per stack)
        instead of the paper's post-layer-norm.
      share_embeddings: one table for source, target and output projection
        (the paper); otherwise separate tables and an output dense layer.
      scale_embeddings: multiply embeddings by sqrt(d_model) (the paper).
      attention_bias: biases in the q/k/v/output projections.
      t5_num_buckets: T5 relative buckets.
      t5_max_distance: distance at which T5 buckets saturate.
      t5_per_layer: a T5 bias table per layer instead of one per stack.
      rope_max_timescale: RoPE base wavelength (also xPos's).
      rope_scaling: RoPE's extension to longer inputs, one of
        `jattn.positions.ROPE_SCALINGS` ("none", "pi", "ntk", "yarn"); it acts
        at evaluation and decoding only (`train=False`), so a run trained
        without it is evaluated with it by setting it (training ignores it).
      rope_scaling_factor: the extension factor s >= 1 of `rope_scaling`.
      rope_original_length: the training length YaRN keeps the short
        wavelengths of (0: `max_len`).
      rope_yarn_convention: where YaRN's ramp runs, "paper" (linear in the
        turns over the training length, Peng et al.; the default) or "hf"
        (linear in the pair index between rounded bounds, as Hugging Face
        transformers' `rope_type="yarn"`); `jattn.positions.YarnOptions`.
      rope_yarn_beta_fast, rope_yarn_beta_slow: YaRN's band: pairs turning
        more than beta_fast times over the training length keep their
        frequency, fewer than beta_slow are interpolated (32 and 1).
      rope_yarn_mscale, rope_yarn_mscale_all_dim: YaRN's attention factor as
        HF configures it: both nonzero, `(0.1 mscale ln s + 1) / (0.1
        mscale_all_dim ln s + 1)`; else (0, the default) `0.1 ln s + 1`.
      xpos_scale_base: xPos's decay length scale (Sun et al.'s 512).
      alibi_mode: ALiBi in bidirectional layers (the encoder; cross-attention
        with `relative_cross`): "symmetric" (`-m|i - j|`, blind to the order
        of its inputs) or "offset" (the order-aware form: keys after the
        query pay a per-head offset of one slope, so left and right differ).
        Causal layers use the paper's `-m (i - j)`.
      fire_hidden: hidden units of FIRE's MLP (Li et al. use 32).
      random_positions: Ruoss et al.'s randomised positions: 0 (off), or M:
        in training each segment's positions are a sorted random sample of
        `[0, M)` (M >= every training segment's length), for every scheme.
      random_positions_eval: evaluate with random positions too (as Ruoss et
        al. do), where `random_positions` = M > 0 (without M it changes
        nothing): the teacher-forced metrics draw each segment's positions
        as in training, and greedy and beam decoding (the exact-match
        metrics, `jattn decode`) draw theirs up front per row
        (`jattn.models.decoding.decoding_positions`), shared by a row's
        beams; evaluation draws from the fixed key 0. False (the default):
        evaluation and decoding use plain positions.
      layer_norm_epsilon: epsilon of every layer norm.
      dtype: compute dtype of activations ("float32", "bfloat16", ...).
      param_dtype: dtype of parameters.
      architecture: a name registered in `jattn.models.ARCHITECTURES`:
        "encoder_decoder" (default); "decoder_only": one causal stack over
        `inputs`, a separator (the start symbol 0) and `targets`, returning
        logits for the targets only (`jattn.models.decoder_only` documents
        the layout and positions); "encoder_only": one bidirectional stack
        over `inputs` and an output tape of blank cells, every target
        predicted at once (`jattn.models.encoder_only`).
      xl_max_distance: "transformer_xl"'s clip distance of `i - j` (0: the
        longest row the config allows, `max(max_len, random_positions) - 1`,
        so unclipped there).
      shared_layers: one layer's parameters used at every layer of a stack
        (Dehghani et al.'s Universal Transformer; Csordás et al. and
        Ontañón et al. compare it); the depth stays `num_layers` per stack.
      prefix_lm: decoder-only: attention over the inputs is bidirectional
        (each input token sees every input token of its example), the
        separator and targets stay causal.
      capture_attention: sow the attention weights `[B, N, T, S]` of every
        attention layer into the "intermediates" collection under
        "attention_weights" (computed with an extra materialising pass).
    """

    vocab_size: int
    d_model: int = 512
    num_heads: int = 8
    num_kv_heads: int | None = None
    num_layers: int = 6
    d_ff: int = 2048
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    max_len: int = 256
    position: str = "sinusoidal"
    max_relative_distance: int = 16
    attention_impl: str | None = None
    attention_assume_finite: bool = False
    pre_norm: bool = False
    share_embeddings: bool = True
    scale_embeddings: bool = True
    attention_bias: bool = False
    shaw_terms: str = "key+value"
    relative_cross: bool = False
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    t5_per_layer: bool = False
    rope_max_timescale: float = 10_000.0
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    rope_original_length: int = 0
    rope_yarn_convention: str = "paper"
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 0.0
    rope_yarn_mscale_all_dim: float = 0.0
    xpos_scale_base: float = 512.0
    alibi_mode: str = "symmetric"
    fire_hidden: int = 32
    random_positions: int = 0
    random_positions_eval: bool = False
    layer_norm_epsilon: float = 1e-6
    dtype: str = "float32"
    param_dtype: str = "float32"
    capture_attention: bool = False
    architecture: str = "encoder_decoder"
    prefix_lm: bool = False
    shared_layers: bool = False
    xl_max_distance: int = 0

    def __post_init__(self):
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        for name in ("vocab_size", "d_model", "num_heads", "num_kv_heads", "num_layers", "d_ff"):
            _positive_int(name, getattr(self, name))
        _positive_int("max_len", self.max_len)
        if self.vocab_size < 2:
            raise ValueError(
                f"TransformerConfig.vocab_size must be >= 2 (0 = padding/start, 1 = EOS), "
                f"got {self.vocab_size}"
            )
        if self.d_model % self.num_heads:
            raise ValueError(
                f"TransformerConfig.d_model={self.d_model} must be divisible by "
                f"num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TransformerConfig.num_kv_heads={self.num_kv_heads} must divide "
                f"num_heads={self.num_heads} (MHA: equal, GQA: a divisor, MQA: 1)"
            )
        for name in ("dropout_rate", "attention_dropout_rate"):
            if not 0.0 <= float(getattr(self, name)) < 1.0:
                raise ValueError(
                    f"TransformerConfig.{name} must be in [0, 1), got {getattr(self, name)!r}"
                )
        scheme = get_scheme(self.position)
        if self.attention_impl is not None and self.attention_impl not in IMPLEMENTATIONS:
            raise ValueError(
                f"TransformerConfig.attention_impl={self.attention_impl!r}; choose one of "
                f"{sorted(IMPLEMENTATIONS)} or None"
            )
        terms = str(self.shaw_terms).split("+")
        if not terms or len(set(terms)) != len(terms) or not set(terms) <= set(SHAW_TERMS):
            raise ValueError(
                f"TransformerConfig.shaw_terms={self.shaw_terms!r} must join distinct terms "
                f"of {SHAW_TERMS} with '+', e.g. 'key+value', 'key', 'bias', 'key+bias'"
            )
        if self.relative_cross and not scheme.relative:
            raise ValueError(
                f"TransformerConfig.relative_cross=True needs a relative scheme; position="
                f"{self.position!r} has none"
            )
        arch = get_architecture(self.architecture)
        if scheme.causal_only and not arch.causal:  # (prefix_lm: `_check_architecture`)
            raise ValueError(
                f"TransformerConfig.position={self.position!r} is causal-only; the "
                f"{self.architecture} model attends bidirectionally over its inputs"
            )
        self._check_extensions()
        self._check_architecture(scheme)
        scheme.check(self)
        longest = scheme.max_position(self)
        if self.random_positions and longest is not None and self.random_positions > longest:
            raise ValueError(
                f"TransformerConfig.random_positions={self.random_positions} exceeds the "
                f"{longest} positions of position={self.position!r}"
            )
        for name in ("dtype", "param_dtype"):
            try:
                dt = jnp.dtype(getattr(self, name))
            except TypeError as e:
                raise ValueError(
                    f"TransformerConfig.{name}={getattr(self, name)!r} is not a dtype"
                ) from e
            if not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"TransformerConfig.{name} must be floating, got {dt}")

    def _check_extensions(self) -> None:
        """The scheme-independent positional options: RoPE scaling, ALiBi's
        mode, randomised positions."""
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(
                f"TransformerConfig.rope_scaling={self.rope_scaling!r}; choose one of "
                f"{ROPE_SCALINGS}"
            )
        if not float(self.rope_scaling_factor) >= 1.0:
            raise ValueError(
                f"TransformerConfig.rope_scaling_factor must be >= 1, got "
                f"{self.rope_scaling_factor!r}"
            )
        if self.rope_yarn_convention not in YARN_CONVENTIONS:
            raise ValueError(
                f"TransformerConfig.rope_yarn_convention={self.rope_yarn_convention!r}; "
                f"choose one of {YARN_CONVENTIONS}"
            )
        if not 0.0 < float(self.rope_yarn_beta_slow) < float(self.rope_yarn_beta_fast):
            raise ValueError(
                f"TransformerConfig: need 0 < rope_yarn_beta_slow < rope_yarn_beta_fast, got "
                f"{self.rope_yarn_beta_slow!r} and {self.rope_yarn_beta_fast!r}"
            )
        for name in ("rope_yarn_mscale", "rope_yarn_mscale_all_dim"):
            if not float(getattr(self, name)) >= 0.0:
                raise ValueError(
                    f"TransformerConfig.{name} must be >= 0, got {getattr(self, name)!r}"
                )
        if self.alibi_mode not in ("symmetric", "offset"):
            raise ValueError(
                f"TransformerConfig.alibi_mode={self.alibi_mode!r}; choose 'symmetric' or 'offset'"
            )
        for name in ("random_positions", "rope_original_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TransformerConfig.{name} must be an int >= 0, got {value!r}")
        if not float(self.xpos_scale_base) > 0:
            raise ValueError(
                f"TransformerConfig.xpos_scale_base must be > 0, got {self.xpos_scale_base!r}"
            )

    def _check_architecture(self, scheme: Scheme) -> None:
        """`architecture`, `prefix_lm`, `relative_cross` and `shared_layers`,
        by the registered architecture's properties."""
        arch = get_architecture(self.architecture)
        for name in ("prefix_lm", "shared_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"TransformerConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.prefix_lm and not arch.prefix_lm:
            allowed = sorted(a.name for a in ARCHITECTURES.values() if a.prefix_lm)
            raise ValueError(
                f"TransformerConfig.prefix_lm=True needs architecture in {allowed}; "
                f"{self.architecture!r} has no causal prefix to make bidirectional"
            )
        if self.prefix_lm and scheme.causal_only:
            raise ValueError(
                f"TransformerConfig.prefix_lm=True attends bidirectionally over the inputs; "
                f"position={self.position!r} is for causal attention only"
            )
        if self.relative_cross and not arch.cross:
            raise ValueError(
                f"TransformerConfig.relative_cross=True needs cross-attention; the "
                f"{self.architecture!r} model has no cross-attention"
            )

    @property
    def arch(self) -> Architecture:
        """The registered `Architecture` of `architecture` (its model and properties)."""
        return get_architecture(self.architecture)

    @property
    def stack_layers(self) -> int:
        """Layers of the decoder-only stack: `2 * num_layers` (an encoder-only
        stack has `num_layers`, as the encoder–decoder's encoder)."""
        return 2 * self.num_layers

    # -- derived ---------------------------------------------------------------

    @property
    def scheme(self) -> Scheme:
        """The component of `position` in `jattn.models.SCHEMES`."""
        return get_scheme(self.position)

    @property
    def max_position(self) -> int | None:
        """The longest sequence the scheme supports (None: any)."""
        return self.scheme.max_position(self)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def shaw(self) -> frozenset[str]:
        """The Shaw terms of `shaw_terms`, e.g. {"key", "value"}."""
        return frozenset(self.shaw_terms.split("+"))

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    # -- constructors ----------------------------------------------------------

    @classmethod
    def base(cls, vocab_size: int, **overrides) -> TransformerConfig:
        """The paper's base model (Vaswani et al., Table 3): 6+6 layers,
        d_model 512, 8 heads, d_ff 2048, dropout 0.1, post-LN, shared
        embeddings scaled by sqrt(d_model), sinusoidal positions."""
        kw = dict(
            vocab_size=vocab_size,
            d_model=512,
            num_heads=8,
            num_layers=6,
            d_ff=2048,
            dropout_rate=0.1,
            position="sinusoidal",
            pre_norm=False,
            share_embeddings=True,
            scale_embeddings=True,
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def big(cls, vocab_size: int, **overrides) -> TransformerConfig:
        """The paper's big model: d_model 1024, 16 heads, d_ff 4096, dropout 0.3."""
        kw = dict(d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3)
        kw.update(overrides)
        return cls.base(vocab_size, **kw)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TransformerConfig:
        """Build from a mapping (a dict, or an `ml_collections.ConfigDict`).

        Unknown keys are an error naming them and the valid fields. The key
        ``shaw_values`` of runs saved before `shaw_terms` existed is read as
        ``shaw_terms`` "key+value" (True) or "key" (False).
        """
        if hasattr(d, "to_dict"):
            d = d.to_dict()
        d = dict(d)
        if "shaw_values" in d and "shaw_terms" not in d:
            d["shaw_terms"] = "key+value" if d.pop("shaw_values") else "key"
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(
                f"TransformerConfig.from_dict: unknown keys {unknown}; valid keys are "
                f"{sorted(fields)}"
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)
