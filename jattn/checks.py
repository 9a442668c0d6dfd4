"""Argument checks at the public boundary: chex assertions with one-line errors.

docs/design.md promises that bad input fails early, with shapes and dtypes
checked by chex where it enters (`jattn.dot_product_attention`,
`jattn.normalise`, `jattn.visibility.Visibility`), and that the error is one line
naming the argument. Each function here runs one chex assertion and, when it
fails, raises `ValueError` (rank, shape) or `TypeError` (dtype) whose one
line is chex's finding followed by the caller's message in brackets:

    [Chex] Error in type compatibility check: input 0 has type float32 but
    expected <class 'int'>. [dot_product_attention: q_positions must be an
    integer array, got dtype float32]

The checks read static shapes and dtypes only, so they also run on traced
values (under `jit`, `custom_vjp`, a Pallas kernel's trace) and cost nothing
once compiled. `chex.disable_asserts()` turns them off like any chex
assertion.
"""

from __future__ import annotations

from typing import Any

import chex

__all__ = ["dtype_kind", "rank", "shape"]

# Python types chex reads as dtype kinds: any integer, any floating, boolean.
_KINDS = {"integer": int, "floating": float, "boolean": bool}


def _assert(assertion, *args: Any, message: str, error: type[Exception]) -> None:
    assertion(*args, custom_message=message, include_default_message=False, exception_type=error)


def rank(x: Any, ranks: int | set[int], message: str) -> None:
    """`ValueError(message)` unless `x` has one of `ranks` axes."""
    _assert(chex.assert_rank, x, ranks, message=message, error=ValueError)


def shape(x: Any, expected: tuple[int, ...], message: str) -> None:
    """`ValueError(message)` unless `x` has shape `expected`."""
    _assert(chex.assert_shape, x, expected, message=message, error=ValueError)


def dtype_kind(x: Any, kind: str, message: str) -> None:
    """`TypeError(message)` unless `x`'s dtype is of `kind`: "integer",
    "floating" or "boolean"."""
    _assert(chex.assert_type, x, _KINDS[kind], message=message, error=TypeError)
