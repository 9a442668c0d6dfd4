"""Flax encoder–decoder and decoder-only Transformers built on jattn's core functions.

    from jattn.models import Transformer, TransformerConfig, decoding
    model = Transformer(TransformerConfig.base(vocab_size=37_000))
    logits = model.apply({"params": params}, inputs, targets)  # [B, T, V]
    tokens = decoding.greedy(model, params, inputs, max_length=64)  # [B, 64]

`jattn.models.decoding` is also `jattn.decoding`. `SCHEMES` maps every
`TransformerConfig.position` to its component (`jattn.models.schemes`).

Needs flax (the `train` extra); `import jattn` alone does not import this.
"""

from jattn.models import decoding
from jattn.models.config import TransformerConfig
from jattn.models.decoder_only import DecoderOnly, DecoderOnlyLayer
from jattn.models.schemes import SCHEMES, Scheme
from jattn.models.summary import (
    abstract_params,
    architecture_counts,
    architecture_line,
    count_params,
    param_counts,
    summary,
)
from jattn.models.transformer import (
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    Transformer,
    positions_from_segments,
    shift_right,
)

__all__ = [
    "SCHEMES",
    "Scheme",
    "Decoder",
    "DecoderLayer",
    "DecoderOnly",
    "DecoderOnlyLayer",
    "Encoder",
    "EncoderLayer",
    "Transformer",
    "TransformerConfig",
    "abstract_params",
    "architecture_counts",
    "architecture_line",
    "count_params",
    "decoding",
    "param_counts",
    "positions_from_segments",
    "shift_right",
    "summary",
]
