"""`jattn decode --workdir DIR [--decode greedy|beam] TEXT [TEXT ...]`.

Decodes each TEXT with the trained run in DIR (`jattn.train.load_run`: its
config, parameters and own tokenizer) and prints one output a line. The
run's decoding settings apply (`decode`, `beam_size`, `beam_alpha`,
`decode_max_len` or `eval_max_len`); flags override them:

    jattn decode --workdir runs/numbers "342"
    jattn decode --workdir runs/numbers --decode beam --beam-size 8 "342" "17"
    jattn decode --workdir runs/rope --rope-scaling yarn --rope-scaling-factor 2 "0123..."

`--rope-scaling` (pi, ntk, yarn) with `--rope-scaling-factor` extends a run
trained with plain RoPE to longer inputs (`model.position_options.rope.scaling`).

An encoder-only model (`model.architecture=encoder_only`) predicts a tape of
cells at once and is told its length: `--max-len`, or for Delétang et al.'s
tasks the task's target length at each text's length (`tape_lengths`).

Characters (or words) outside the run's vocabulary are decoded as the
unknown token, and each text with some gets a warning line on stderr naming
them. A damaged newest checkpoint is passed over for the newest intact one,
with a warning (`load_run`).

Exit status: 0 done, 2 bad input (no run, no intact checkpoint, bad flag), in one line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jattn.cli.common import fail, normalize_flags

__all__ = ["decode_command", "tape_lengths", "unknown_input_lines"]

PROG = "jattn decode"


def make_parser() -> argparse.ArgumentParser:
    """The command's argument parser (the tests read every flag and its help)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Decode text with a trained run (its own tokenizer and settings)."
    )
    parser.add_argument("--workdir", required=True, help="a `jattn train` workdir")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument(
        "--decode", choices=("greedy", "beam"), default=None, help="default: the run's `decode`"
    )
    parser.add_argument("--beam-size", type=int, default=None, help="default: the run's")
    parser.add_argument("--beam-alpha", type=float, default=None, help="default: the run's")
    parser.add_argument(
        "--max-len", type=int, default=None, help="output tokens (default: the run's decode length)"
    )
    parser.add_argument(
        "--rope-scaling", choices=("none", "pi", "ntk", "yarn"), default=None,
        help="extend the run's RoPE to longer inputs (default: the run's rope.scaling)",
    )  # fmt: skip
    parser.add_argument(
        "--rope-scaling-factor", type=float, default=None,
        help="the extension factor of --rope-scaling (default: the run's)",
    )  # fmt: skip
    parser.add_argument("texts", nargs="+", metavar="TEXT", help="inputs to decode")
    return parser


def decode_texts(run, texts: Sequence[str], *, method=None, beam_size=None, beam_alpha=None,
                 max_len=None) -> list[str]:  # fmt: skip
    """Decodes `texts` with `run` (a `TrainedRun`); None settings take the run's config's."""
    import numpy as np  # noqa: PLC0415

    from jattn.models import decoding  # noqa: PLC0415
    from jattn.train.evaluation import ids_to_text  # noqa: PLC0415

    c = run.config
    method = method or c.get("decode", "greedy")
    max_length = max_len or c.get("decode_max_len") or c.eval_max_len
    encoded = [run.tokenizer.encode(t) for t in texts]
    for line in unknown_input_lines(run.tokenizer, texts, encoded):
        print(line, file=sys.stderr)
    inputs = np.zeros((len(encoded), max(len(e) for e in encoded)), np.int32)  # [B, S]
    for i, ids in enumerate(encoded):
        inputs[i, : len(ids)] = ids
    tapes = None
    if not run.model.architecture.autoregressive:
        tapes = np.asarray(tape_lengths(c.dataset, texts, max_len), np.int32)  # [B]
        max_length = int(tapes.max())
    if method == "beam":
        out = decoding.beam_search(
            run.model, run.params, inputs, max_length=max_length,
            beam_size=beam_size or c.get("beam_size", 4),
            alpha=c.get("beam_alpha", 0.6) if beam_alpha is None else beam_alpha,
            tape_lengths=tapes,
        )  # fmt: skip
    else:
        out = decoding.greedy(
            run.model, run.params, inputs, max_length=max_length, tape_lengths=tapes
        )
    return [ids_to_text(run.tokenizer, row) for row in np.asarray(out)]


def unknown_input_lines(tokenizer, texts: Sequence[str], encoded) -> list[str]:
    """A warning line for each text with pieces outside the run's vocabulary.

    The tokenizer maps them to its unknown id, which the model never saw in
    training and which decodes to ``⁇``: the output is then about another
    input than the one typed, and nothing said so.
    """
    from jattn.data.tokenizers import UNK_ID, UNK_TEXT  # noqa: PLC0415

    lines = []
    for i, (text, ids) in enumerate(zip(texts, encoded, strict=True), start=1):
        count = sum(1 for t in ids if t == UNK_ID)
        if not count:
            continue
        if hasattr(tokenizer, "chars"):
            known, pieces, what = set(tokenizer.chars), list(text), "characters"
        elif hasattr(tokenizer, "words"):
            known, pieces, what = set(tokenizer.words), text.split(" "), "words"
        else:
            known, pieces, what = None, [], "pieces"
        unknown = sorted({p for p in pieces if p and p not in known}) if known else []
        named = f": {', '.join(map(repr, unknown))}" if unknown else ""
        lines.append(
            f"warning: input {i} ({text!r}) has {count} {what} outside the run's vocabulary"
            f"{named}; they are read as the unknown token ({UNK_TEXT})"
        )
    return lines


def tape_lengths(dataset: str, texts: Sequence[str], max_len: int | None) -> list[int]:
    """Each text's output tape for a model told its output length (encoder-only).

    `--max-len` when given (every row); else the task's own rule where it has
    one (Delétang et al.'s tasks: `jattn.data.chomsky_tasks.target_tokens` of
    the text's length), which is the tape evaluation gives an example of
    that length. Without either, the output length is unknown: a one-line
    error rather than a tape of the run's longest evaluation target.
    """
    if max_len is not None:
        return [max_len] * len(texts)
    from jattn.data import chomsky_tasks  # noqa: PLC0415

    task = dataset.split("/")[0]
    if task not in chomsky_tasks.GENERATORS:
        raise ValueError(
            f"an encoder-only model is told each output's length: give --max-len (the tape's "
            f"tokens, EOS included); data set {dataset!r} has no length rule to read it from"
        )
    return [chomsky_tasks.target_tokens(task, len(text)) for text in texts]


def decode_command(argv: Sequence[str]) -> int:
    """`jattn decode`: prints one decoded text a line; returns the exit status."""
    args = make_parser().parse_args(normalize_flags(argv))  # --beam_size: --beam-size
    for name in ("beam_size", "max_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return fail(PROG, f"--{name.replace('_', '-')} must be >= 1, got {value}")

    from jattn.train.load import load_run  # noqa: PLC0415

    try:
        run = load_run(args.workdir, args.step)
    except (FileNotFoundError, ValueError) as e:
        return fail(PROG, str(e))
    scaling = {
        key: value
        for key, value in (("scaling", args.rope_scaling),
                           ("scaling_factor", args.rope_scaling_factor))
        if value is not None
    }  # fmt: skip
    if scaling:  # an evaluation-time model setting: the parameters are unchanged
        from jattn.models import Transformer  # noqa: PLC0415

        try:
            run.model = Transformer(run.model.config.replace(position_options={"rope": scaling}))
        except ValueError as e:
            return fail(PROG, str(e))
    try:
        outputs = decode_texts(
            run, args.texts, method=args.decode, beam_size=args.beam_size,
            beam_alpha=args.beam_alpha, max_len=args.max_len,
        )  # fmt: skip
    except ValueError as e:
        return fail(PROG, str(e))
    for text in outputs:
        print(text)
    return 0
