"""`TransformerConfig`: every hyperparameter of the models, checked once.

A frozen dataclass so it can be a static argument of `jax.jit` and a field of
a flax module. Experiment configs build one from a dict
(`TransformerConfig.from_dict(config.model)` or `TransformerConfig(**d)`);
every check runs in `__post_init__`, before anything is traced or compiled.
A positional scheme's own options are not fields here: they live in the
scheme's component (`jattn.models.schemes`, `Scheme.Options`) and sit in
`position_options` by the scheme's options key.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from jattn.attention import IMPLEMENTATIONS
from jattn.models.architectures import ARCHITECTURES, Architecture, get_architecture
from jattn.models.schemes import (
    PositionOptions,
    Scheme,
    default_position_options,
    get_scheme,
)

__all__ = ["ARCHITECTURES", "RENAMED", "TransformerConfig", "renamed_key", "upgrade_saved"]


# The flat fields of one scheme that TransformerConfig had before the schemes
# carried their options, and where each now lives in `position_options` (RoPE's
# base wavelength was xPos's too). Configs saved before the move (a workdir's
# `model_config.json` and `config.json`) are read through it (`upgrade_saved`);
# a new config or override with an old name is an error naming the new key.
RENAMED: dict[str, tuple[str, ...]] = {
    "max_relative_distance": ("shaw.max_distance",),
    "shaw_terms": ("shaw.terms",),
    "rope_max_timescale": ("rope.max_timescale", "xpos.max_timescale"),
    "rope_scaling": ("rope.scaling",),
    "rope_scaling_factor": ("rope.scaling_factor",),
    "rope_original_length": ("rope.original_length",),
    "rope_yarn_convention": ("rope.yarn.convention",),
    "rope_yarn_beta_fast": ("rope.yarn.beta_fast",),
    "rope_yarn_beta_slow": ("rope.yarn.beta_slow",),
    "rope_yarn_mscale": ("rope.yarn.mscale",),
    "rope_yarn_mscale_all_dim": ("rope.yarn.mscale_all_dim",),
    "t5_num_buckets": ("t5.num_buckets",),
    "t5_max_distance": ("t5.max_distance",),
    "t5_per_layer": ("t5.per_layer",),
    "xpos_scale_base": ("xpos.scale_base",),
    "alibi_mode": ("alibi.mode",),
    "fire_hidden": ("fire.hidden",),
    "xl_max_distance": ("transformer_xl.max_distance",),
}


def renamed_key(name: str) -> str | None:
    """Where the old model field `name` now lives (``"position_options.rope.scaling"``;
    two places joined by " and "), or None for a name that never moved."""
    if name == "shaw_values":
        return "position_options.shaw.terms"
    if name not in RENAMED:
        return None
    return " and ".join(f"position_options.{path}" for path in RENAMED[name])


def upgrade_saved(model: Mapping[str, Any]) -> dict[str, Any]:
    """A model config saved before the schemes carried their options, in
    today's spelling: its flat scheme fields moved into `position_options`
    (`RENAMED`), and the older ``shaw_values`` (before ``shaw_terms``) read as
    "key+value" (True) or "key" (False). A config in today's spelling is
    returned as it is (a copy)."""
    d = copy.deepcopy(dict(model))
    if "shaw_values" in d and "shaw_terms" not in d:
        d["shaw_terms"] = "key+value" if d.pop("shaw_values") else "key"
    options = d.get("position_options") or {}
    for old in [k for k in d if k in RENAMED]:
        value = d.pop(old)
        for path in RENAMED[old]:
            node = options
            *groups, leaf = path.split(".")
            for group in groups:
                node = node.setdefault(group, {})
            node[leaf] = value
    if options:
        d["position_options"] = options
    return d


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
      position_options: every scheme's own options, by its options key
        (`jattn.models.scheme.PositionOptions`; the fields, defaults and
        checks are the scheme's `Options` class): e.g. `{"rope": {"scaling":
        "yarn", "scaling_factor": 2.0}, "t5": {"num_buckets": 64}}`. Given
        as a mapping of some keys and fields (or options instances); the rest
        keep their defaults. Configs spell them
        `model.position_options.rope.scaling`; docs/schemes.md lists them.
      relative_cross: the relative scheme also in decoder-to-encoder attention,
        on decoder position t and encoder position s (Ontañón et al.'s "rel2";
        for "t5" each cross-attention layer has its own bidirectional table).
      attention_impl: `implementation` passed to `jattn.dot_product_attention`
        (None: `jattn.attention.rule`'s choice for each call and backend).
      attention_assume_finite: training steps call attention with
        `assume_finite=True`, skipping its guard against non-finite hidden
        keys: the model's keys and values are its own projections, finite
        unless the run has diverged (which the train step's NaN check
        catches). Saves 3-4% of the main job's CPU train step. Equal results
        to float32 rounding; bit-identical or not depends on XLA's fusion of
        the step (the main job's config: bit-identical, checked with `jattn
        bench variants`, now the arms of `python benchmarks/train.py`), so it
        is off unless a config turns it on.
        Evaluation and decoding keep the guard (without it their programs
        round the eval loss otherwise in the 7th digit). A resumed run may
        change it (`jattn.train.resume_keys.MODEL_RESUME_SAFE_KEYS`).
      pre_norm: pre-layer-norm residual blocks (plus a final norm per stack)
        instead of the paper's post-layer-norm.
      share_embeddings: one table for source, target and output projection
        (the paper); otherwise separate tables and an output dense layer.
      scale_embeddings: multiply embeddings by sqrt(d_model) (the paper).
      attention_bias: biases in the q/k/v/output projections.
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
    position_options: Mapping[str, Any] = dataclasses.field(
        default_factory=default_position_options
    )
    attention_impl: str | None = None
    attention_assume_finite: bool = False
    pre_norm: bool = False
    share_embeddings: bool = True
    scale_embeddings: bool = True
    attention_bias: bool = False
    relative_cross: bool = False
    random_positions: int = 0
    random_positions_eval: bool = False
    layer_norm_epsilon: float = 1e-6
    dtype: str = "float32"
    param_dtype: str = "float32"
    capture_attention: bool = False
    architecture: str = "encoder_decoder"
    prefix_lm: bool = False
    shared_layers: bool = False

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
        if not isinstance(self.position_options, PositionOptions):
            object.__setattr__(self, "position_options", PositionOptions(self.position_options))
        if self.attention_impl is not None and self.attention_impl not in IMPLEMENTATIONS:
            raise ValueError(
                f"TransformerConfig.attention_impl={self.attention_impl!r}; choose one of "
                f"{sorted(IMPLEMENTATIONS)} or None"
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
        value = self.random_positions
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"TransformerConfig.random_positions must be an int >= 0, got {value!r}"
            )
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

        Unknown keys are an error naming them and the valid fields. A config
        saved before the schemes carried their options (a workdir's
        `model_config.json`, with flat fields such as ``rope_scaling``) is read
        through `upgrade_saved`, with a DeprecationWarning naming the new keys:
        old workdirs still decode and resume.
        """
        if hasattr(d, "to_dict"):
            d = d.to_dict()
        d = dict(d)
        old = sorted(k for k in d if renamed_key(k))
        if old:
            warnings.warn(
                "TransformerConfig.from_dict: read the old keys "
                + ", ".join(f"{k} as {renamed_key(k)}" for k in old),
                DeprecationWarning,
                stacklevel=2,
            )
            d = upgrade_saved(d)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(
                f"TransformerConfig.from_dict: unknown keys {unknown}; valid keys are "
                f"{sorted(fields)}"
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Plain values and nested dicts (`position_options` by key), as
        `from_dict` reads them back."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**d, "position_options": self.position_options.to_dict()}

    def replace(self, **changes) -> TransformerConfig:
        """A copy with `changes`; `position_options` given here are merged
        into this config's, field by field (`PositionOptions.merged`)."""
        if "position_options" in changes:
            changes["position_options"] = self.position_options.merged(changes["position_options"])
        return dataclasses.replace(self, **changes)
