"""The shape legend: one letter per dimension, in every einsum string and
shape comment of `jattn.attention` (xla, chunked, pallas and their references)
and `jattn.models`.

Einsum strings take one character per axis, so the letter of a dimension is
written once here and nowhere else; modules point to this legend instead of
listing their own. `tests/test_structure.py` reads every `einsum("...")`
literal of those packages from the source and fails on a letter missing from
`EINSUM_LETTERS`.

Upper case is a whole dimension; lower case is a tile of one (a query tile of
`t` rows out of `T`) or a count of tiles. docs/design.md names the value head dim
`Hv`; shape comments and docstrings keep that name (`[B, S, K, Hv]`), and
einsum strings, which cannot spell two letters for one axis, write it `E`.
The value head dim and the vocabulary are different dimensions: `E` and `V`.

Names that appear only in shape comments, never in einsums: `Hv` (= `E`),
`Tp` / `Sp` / `Hvp` (the padded T, S, Hv of the kernels), `nq` / `nk` (query /
key tile counts, `n` in einsums), `bq` / `bk` (the kernels' block sizes, the
tile lengths `t` / `s`), `W` (beam width), `L` (decoded or cached length).
"""

from __future__ import annotations

# letter -> the dimension it names, in every einsum of jattn.attention and jattn.models.
EINSUM_LETTERS: dict[str, str] = {
    "B": "batch",
    "T": "query length",
    "S": "key / value length",
    "N": "query heads",
    "K": "key / value heads (K divides N: MHA, GQA, MQA)",
    "G": "query heads per key / value head, N = K * G",
    "H": "query / key head dim",
    "E": "value head dim (Hv in shape comments and docs/design.md)",
    "R": "Shaw relative ids, 2k + 1 for clip distance k",
    "P": "CoPE's position embeddings (npos_max)",
    "D": "model width (d_model)",
    "F": "MLP hidden width (d_ff)",
    "V": "vocabulary size",
    "t": "query tile length (block_q, bq in the kernels)",
    "s": "key tile length (block_k, bk in the kernels)",
    "n": "number of tiles (nq or nk)",
}
