"""The architecture registry: `TransformerConfig.architecture` -> one model.

As `jattn.models.schemes.SCHEMES` maps a positional scheme's name to the one
component that implements it, `ARCHITECTURES` maps an architecture's name to
an `Architecture`: the model class (a subclass of
`jattn.models.Transformer`, registered by its own module) and the
properties the rest of the code asks about instead of comparing names
(whether inputs and targets form one stream, whether there is
cross-attention, whether the model decodes token by token, ...).

    encoder_decoder  Vaswani et al.: an encoder over the inputs, a causal
                     decoder with cross-attention over the targets.
    decoder_only     one causal stack over inputs, a separator, then targets
                     (Kazemnejad et al.); `prefix_lm` for a bidirectional prefix.
    encoder_only     one bidirectional stack over inputs and an output tape of
                     blank cells, every target predicted at once (Delétang et al.).

This module imports no model code (the config checks read it); each model
module registers its class with `register`, and `jattn.models` imports them
all, so the registry is complete once `jattn.models` is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["ARCHITECTURES", "Architecture", "get_architecture", "register"]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One architecture: its model class and what callers may ask of it.

    Attributes:
      name: the `TransformerConfig.architecture` value.
      joined: an example's inputs and targets are one stream `[inputs |
        target side]` read by one stack (one segment per example: random
        positions draw one sample of `n + m` for it, and the row lengths
        that must fit `max_len` are `S + T`).
      cross: targets read the inputs through cross-attention (so
        `relative_cross` means something).
      causal: the stack over the inputs is causal (schemes that are
        causal-only fit; `prefix_lm` makes the input side bidirectional).
      prefix_lm: `prefix_lm=True` is allowed.
      autoregressive: decoding runs one token a step over a KV cache;
        otherwise one call predicts every target at once (an output tape).
      stacks: how the layers are counted, "n+n" (an encoder and a decoder
        of `num_layers` each), "2n" (one stack of `2 * num_layers`, as deep
        as both) or "n" (one stack of `num_layers`: the encoder alone, as
        Delétang et al.'s 5-layer encoder).
      model: the `jattn.models.Transformer` subclass (set by `register`).
    """

    name: str
    joined: bool
    cross: bool
    causal: bool
    prefix_lm: bool
    autoregressive: bool
    stacks: str
    model: Any = None

    def layers(self, num_layers: int) -> str:
        """The layer count as the start-up line prints it: "2+2 layers", "4 layers",
        "1 layer"."""
        if self.stacks == "n+n":
            return f"{num_layers}+{num_layers} layers"
        depth = self.depth(num_layers)
        return f"{depth} layer" + ("s" if depth != 1 else "")

    def depth(self, num_layers: int) -> int:
        """Blocks of the (largest) stack for `num_layers`."""
        return 2 * num_layers if self.stacks == "2n" else num_layers


# name -> Architecture; the model classes fill in `model` when their module is imported.
ARCHITECTURES: dict[str, Architecture] = {
    "encoder_decoder": Architecture(
        "encoder_decoder",
        joined=False,
        cross=True,
        causal=False,
        prefix_lm=False,
        autoregressive=True,
        stacks="n+n",
    ),
    "decoder_only": Architecture(
        "decoder_only",
        joined=True,
        cross=False,
        causal=True,
        prefix_lm=True,
        autoregressive=True,
        stacks="2n",
    ),
    "encoder_only": Architecture(
        "encoder_only",
        joined=True,
        cross=False,
        causal=False,
        prefix_lm=False,
        autoregressive=False,
        stacks="n",
    ),
}


def get_architecture(name: str) -> Architecture:
    """The registered `Architecture` of `name`; an unknown name lists the registered ones."""
    try:
        return ARCHITECTURES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"TransformerConfig.architecture={name!r}; choose one of {sorted(ARCHITECTURES)}"
        ) from None


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make `cls` the model of architecture `name`."""

    def decorate(cls: type) -> type:
        arch = get_architecture(name)
        ARCHITECTURES[name] = dataclasses.replace(arch, model=cls)
        cls.architecture = ARCHITECTURES[name]
        return cls

    return decorate
