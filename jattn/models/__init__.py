"""Flax Transformers built on jattn's core functions, one per architecture.

    from jattn.models import Transformer, TransformerConfig, decoding
    model = Transformer(TransformerConfig.base(vocab_size=37_000))
    logits = model.apply({"params": params}, inputs, targets)  # [B, T, V]
    tokens = decoding.greedy(model, params, inputs, max_length=64)  # [B, 64]

`Transformer(config)` builds the model that `config.architecture` names in
`ARCHITECTURES` (`EncoderDecoder`, `DecoderOnly`, `EncoderOnly`), as
`SCHEMES` maps every `TransformerConfig.position` to its component
(`jattn.models.schemes`). `jattn.models.decoding` is also `jattn.decoding`.

Needs flax (the `train` extra); `import jattn` alone does not import this.
"""

from jattn.models import decoding
from jattn.models.architectures import ARCHITECTURES, Architecture
from jattn.models.blocks import Block, Encoder
from jattn.models.config import TransformerConfig
from jattn.models.decoder_only import DecoderOnly, DecoderOnlyStack
from jattn.models.encoder_decoder import Decoder, EncoderDecoder
from jattn.models.encoder_only import EncoderOnly
from jattn.models.schemes import SCHEMES, Scheme
from jattn.models.summary import (
    abstract_params,
    architecture_counts,
    architecture_line,
    count_params,
    param_counts,
    summary,
)
from jattn.models.transformer import Transformer, positions_from_segments, shift_right

__all__ = [
    "ARCHITECTURES",
    "SCHEMES",
    "Architecture",
    "Block",
    "Decoder",
    "DecoderOnly",
    "DecoderOnlyStack",
    "Encoder",
    "EncoderDecoder",
    "EncoderOnly",
    "Scheme",
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
