"""SCAN (Lake and Baroni 2018), generated from its published grammar, with its length splits.

SCAN maps navigation commands to action sequences ("jump twice after walk
left" -> "LTURN WALK JUMP JUMP"). The paper's appendix gives the whole task as
a phrase-structure grammar and interpretation rules; this module writes both
down (`commands` enumerates the grammar, `interpret` applies the rules), so
the data set is built here, nothing downloaded. The grammar, with ``x`` one of
``walk look run jump turn`` and ``u`` one of ``walk look run jump``:

    C -> S | S and S | S after S
    S -> V | V twice | V thrice
    V -> u | x left | x right | x opposite left | x opposite right
         | x around left | x around right

(the appendix writes the last rules as ``D[1] opposite D[2]`` over
``D -> U left | U right | turn left | turn right``, the two directions being
the same word; "turn" alone is not a command). Interpretation, with ``T`` the
turn of the direction (LTURN for left, RTURN for right) and ``[[turn]]``
empty: ``[[u]]`` = WALK | LOOK | RUN | JUMP, ``[[x d]]`` = T ``[[x]]``,
``[[x opposite d]]`` = T T ``[[x]]``, ``[[x around d]]`` = (T ``[[x]]``) x 4,
``[[s twice]]`` = ``[[s]]`` x 2, ``[[s thrice]]`` = ``[[s]]`` x 3,
``[[a and b]]`` = ``[[a]] [[b]]``, ``[[a after b]]`` = ``[[b]] [[a]]``.
That gives 34 V, 102 S and 102 + 2 * 102**2 = 20,910 commands, the size of
the paper's full set; actions sequences have 1 to 48 actions.

Splits (the builder's configs; `length_splits` computes them):

- ``length``: Lake and Baroni's length split (their experiment 2): ``train``
  is every command whose action sequence has at most 22 actions (16,990),
  ``test_longer`` every longer one (3,920, with 24 to 48 actions: no command
  has 23). The paper has no held-out in-distribution split, so
  ``validation`` is a fixed sample of 1,000 *training* commands (it tells
  whether training fitted, not whether it generalised).
- ``length_cutoff26``: Csordás et al. 2021 ("The Devil is in the Detail")'s
  re-split with cutoff 26, as their released code defines it
  (``dataset/scan_length_resplit.py`` and
  ``tasks/scan_resplit_transformer.py`` of RobertCsordas/
  transformer_generalization; the paper runs cutoffs 22 to 40): the 18,286
  commands with at most 26 actions are split at random 90% ``train`` / 10%
  ``validation`` (their "iid" set: 16,458 / 1,828), and ``test_longer``
  (their "val") is every command with more than 26 actions (2,624, with 27
  to 48). Their draw uses their own random generator over the file order of
  the released ``tasks.txt``; this one draws with numpy from the grammar's
  order, so the sizes match theirs but not the members.

Metric: sequence exact match (``exact_match``), which both papers report, on
every example of ``test_longer``. Inputs and targets are words separated by
single spaces: use ``tokenizer="word"`` (one id per word; PAD, EOS and UNK
plus 13 command words and 6 actions). Every ``test_longer`` target is made
of the six actions, all of which training targets show.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import tensorflow_datasets as tfds

from jattn.data.builders import GeneratedBuilder

__all__ = [
    "ACTIONS",
    "BUILDERS",
    "CUTOFF26_SIZES",
    "LENGTH_SPLIT_SIZES",
    "JattnScan",
    "ScanConfig",
    "commands",
    "interpret",
    "length_splits",
]

PRIMITIVES = {"walk": "WALK", "look": "LOOK", "run": "RUN", "jump": "JUMP"}
TURNS = {"left": "LTURN", "right": "RTURN"}
ACTIONS = ("WALK", "LOOK", "RUN", "JUMP", "LTURN", "RTURN")
NUM_COMMANDS = 20_910  # the paper's full set
LENGTH_SPLIT_SIZES = {"train": 16_990, "test_longer": 3_920}  # Lake and Baroni, experiment 2
CUTOFF26_SIZES = {"train": 16_458, "validation": 1_828, "test_longer": 2_624}  # counted here


def _verb_phrases() -> list[str]:
    """The 34 V of the grammar."""
    out = list(PRIMITIVES)
    for x in (*PRIMITIVES, "turn"):
        for d in TURNS:
            out += [f"{x} {d}", f"{x} opposite {d}", f"{x} around {d}"]
    return out


def commands() -> list[str]:
    """Every SCAN command (20,910), in the grammar's order (C -> S, S and S, S after S)."""
    phrases = [f"{v}{rep}" for v in _verb_phrases() for rep in ("", " twice", " thrice")]
    out = list(phrases)
    for conj in ("and", "after"):
        out += [f"{a} {conj} {b}" for a, b in itertools.product(phrases, phrases)]
    return out


def _interpret_verb(words: list[str]) -> list[str]:
    if len(words) == 1 and words[0] in PRIMITIVES:
        return [PRIMITIVES[words[0]]]
    x, *rest = words
    if x not in PRIMITIVES and x != "turn" or not rest or rest[-1] not in TURNS:
        raise ValueError(f"not a SCAN verb phrase: {' '.join(words)!r}")
    act = [] if x == "turn" else [PRIMITIVES[x]]
    turn = TURNS[rest[-1]]
    modifier = rest[:-1]
    if modifier == []:
        return [turn, *act]
    if modifier == ["opposite"]:
        return [turn, turn, *act]
    if modifier == ["around"]:
        return [turn, *act] * 4
    raise ValueError(f"not a SCAN verb phrase: {' '.join(words)!r}")


def _interpret_phrase(words: list[str]) -> list[str]:
    repeat = {"twice": 2, "thrice": 3}.get(words[-1]) if words else None
    if repeat:
        return _interpret_verb(words[:-1]) * repeat
    return _interpret_verb(words)


def interpret(command: str) -> str:
    """The action sequence of a SCAN command, by the paper's interpretation rules.

    Raises:
      ValueError: `command` is not in the grammar.
    """
    words = command.split(" ")
    for conj in ("and", "after"):
        if conj in words:
            i = words.index(conj)
            first, second = _interpret_phrase(words[:i]), _interpret_phrase(words[i + 1 :])
            return " ".join(first + second if conj == "and" else second + first)
    if not command:
        raise ValueError("not a SCAN command: ''")
    return " ".join(_interpret_phrase(words))


@dataclasses.dataclass(eq=False)
class ScanConfig(tfds.core.BuilderConfig):
    """Config of a SCAN length split.

    Attributes:
      cutoff: training commands have action sequences of at most `cutoff`
        actions; ``test_longer`` holds every longer one.
      validation: "train_sample" (a sample of `num_validation` training
        commands, Lake and Baroni's split having none held out) or
        "held_out" (Csordás et al.: a random share of the commands up to
        `cutoff`, removed from training).
      num_validation: size of the "train_sample" validation split.
      train_share: share of the short commands kept for training ("held_out");
        the rest, ``int(n * (1 - train_share))`` of them as in Csordás et al.'s
        code, is validation.
      max_examples: keep at most this many examples a split (0: all); for
        tests and smoke runs.
      seed: seed of the sampling; the data is a pure function of the config.
    """

    cutoff: int = 22
    validation: str = "train_sample"
    num_validation: int = 1_000
    train_share: float = 0.9
    max_examples: int = 0
    seed: int = 0


def length_splits(config: ScanConfig) -> dict[str, list[tuple[int, dict[str, str]]]]:
    """The examples of every split of a SCAN length split, as (key, example) pairs."""
    if config.validation not in ("train_sample", "held_out"):
        raise ValueError(
            f"validation must be 'train_sample' or 'held_out', got {config.validation!r}"
        )
    rng = np.random.default_rng(config.seed)
    pairs = [(c, interpret(c)) for c in commands()]
    short = [p for p in pairs if len(p[1].split(" ")) <= config.cutoff]
    longer = [p for p in pairs if len(p[1].split(" ")) > config.cutoff]
    if not short or not longer:
        raise ValueError(f"cutoff {config.cutoff} leaves an empty split (actions: 1-48)")
    if config.validation == "held_out":
        order = rng.permutation(len(short))
        held = int(len(short) * (1 - config.train_share))
        parts = {
            "train": [short[i] for i in sorted(order[held:])],
            "validation": [short[i] for i in sorted(order[:held])],
        }
    else:
        chosen = np.sort(rng.choice(len(short), size=config.num_validation, replace=False))
        parts = {"train": short, "validation": [short[i] for i in chosen]}
    parts["test_longer"] = longer
    out = {}
    for split, examples in parts.items():
        if config.max_examples:
            keep = np.sort(rng.permutation(len(examples))[: config.max_examples])
            examples = [examples[i] for i in keep]
        out[split] = [(i, {"inputs": c, "targets": a}) for i, (c, a) in enumerate(examples)]
    return out


class JattnScan(GeneratedBuilder):
    """SCAN commands to actions: "jump twice after walk left" -> "LTURN WALK JUMP JUMP".

    Configs: ``length`` (train <= 22 actions, ``test_longer`` 24-48: 3,920
    commands), ``length_cutoff26`` (train <= 26, ``test_longer`` 27-48:
    2,624), ``tiny``. Metric: sequence exact match. Tokenizer: "word".
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release: generated from the paper's grammar."}
    BUILDER_CONFIGS = [
        ScanConfig(
            name="length",
            description="Lake and Baroni's length split: train <= 22 actions (16,990), "
            "test_longer 24-48 actions (3,920); validation: 1,000 training commands.",
        ),
        ScanConfig(
            name="length_cutoff26",
            cutoff=26,
            validation="held_out",
            description="Csordás et al.'s cutoff 26: 90%/10% train/validation of the commands "
            "<= 26 actions (16,458/1,828), test_longer every longer one (27-48, 2,624).",
        ),
        ScanConfig(
            name="tiny",
            cutoff=26,
            validation="held_out",
            max_examples=300,
            description="Cutoff 26, at most 300 examples a split: for tests and smoke runs.",
        ),
    ]

    def _splits(self):
        return length_splits(self.builder_config)


# The task names `jattn.data.load` knows from this module, with the default config.
BUILDERS = {"scan": (JattnScan, "length_cutoff26")}
