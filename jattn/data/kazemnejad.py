"""The copy, reverse and addition tasks with the lengths of Kazemnejad et al. (2023).

Kazemnejad et al., "The Impact of Positional Encoding on Length
Generalization in Transformers" (NeurIPS 2023), train decoder-only models on
instances of length up to L = 20 and test them on longer ones, up to 2L = 40,
scoring sequence exact match by length. Here:

- ``kz_copy``: "abc" -> "abc"; ``kz_reverse``: "abc" -> "cba": random strings
  over the first `alphabet_size` lowercase letters (16), one letter a token;
- ``kz_addition``: "0123+4567" -> "04690": two operands of n digits each
  (leading zeros allowed, so every n-digit string is an operand) and their
  sum written with n + 1 digits; the length is n;
- their copy variants with repeated tokens (`repeat_splits`, the
  ``copy_task_type``s of their ``scripts/dataset_builders/make_copy_dataset.py``,
  the splits ``rsc``, ``rsc2x``, ``rdc`` of their ``results/sanity_check.jsonl``):
  ``kz_copy_rsc`` "aaa" -> "aaa" (one token repeated n times, copied),
  ``kz_copy_rsc2x`` "aaa" -> "aaaaaa" (copied twice), ``kz_copy_rdc``
  "a>b:aaa" -> "bbb" (their prompt "Replace a with b in a a a": every a
  replaced by b; the length is n, the repeats).

Lengths: ``train`` and ``validation`` draw lengths uniformly from 1-20 (as
evenly as the distinct strings of each length allow: there are only 16
strings of one letter), disjoint; ``test_longer`` draws uniformly from 21-40,
every example longer than any in training. 100,000 training examples, 1,000
in each evaluation split. Metrics: exact match (sequence) and chrF, as every
character task of jattn (`jattn.data.tasks.TASK_METRICS`); the anchors'
report (`jattn.analysis.anchors`) adds exact match by length bucket and
teacher-forced token accuracy beyond the training lengths.

What is not the paper's: the token vocabulary (letters here), the prompt
format (no instruction words, no scratchpad) and the number of training
examples; the lengths and the metric are. Every ``test_longer`` target is
made of tokens that training targets show (all letters, all digits), which
the run's data check verifies.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import string

import numpy as np
import tensorflow_datasets as tfds

from jattn.data.builders import GeneratedBuilder, even_allocation, length_splits

__all__ = [
    "BUILDERS",
    "KazemnejadConfig",
    "REPEAT_CONFIGS",
    "REPEAT_TASKS",
    "RepeatConfig",
    "addition_splits",
    "repeat_alphabet",
    "repeat_splits",
    "string_splits",
]

TRAIN_LENGTHS = (1, 20)  # L = 20
TEST_LENGTHS = (21, 40)  # up to 2L


@dataclasses.dataclass(eq=False)
class KazemnejadConfig(tfds.core.BuilderConfig):
    """Config of a Kazemnejad et al. length task.

    Attributes:
      alphabet_size: copy and reverse use the first `alphabet_size` lowercase
        letters (addition always uses the ten digits).
      train_lengths: (min, max) length of train and validation, inclusive.
      test_lengths: (min, max) length of ``test_longer``, inclusive.
      num_train, num_validation, num_test_longer: split sizes (distinct
        strings; for addition, distinct first operands).
      seed: seed of the generator; the data is a pure function of the config.
    """

    alphabet_size: int = 16
    train_lengths: tuple[int, int] = TRAIN_LENGTHS
    test_lengths: tuple[int, int] = TEST_LENGTHS
    num_train: int = 100_000
    num_validation: int = 1_000
    num_test_longer: int = 1_000
    seed: int = 0


_CONFIGS = [
    KazemnejadConfig(
        name="default",
        description="Kazemnejad et al.'s lengths: train 1-20, test_longer 21-40 (1,000).",
    ),
    KazemnejadConfig(
        name="tiny",
        num_train=600,
        num_validation=50,
        num_test_longer=50,
        description="Tiny: for tests and smoke runs.",
    ),
]


def string_splits(config: KazemnejadConfig, reverse: bool) -> dict[str, list]:
    """The examples of copy (or reverse) of every split, as (key, example) pairs."""
    if not 1 <= config.alphabet_size <= 26:
        raise ValueError(f"alphabet_size must be in [1, 26], got {config.alphabet_size}")
    alphabet = string.ascii_lowercase[: config.alphabet_size]
    return length_splits(config, alphabet, (lambda s: s[::-1]) if reverse else (lambda s: s))


def _addition(rng: np.random.Generator, first: list[str]) -> list[dict[str, str]]:
    """ "a+b" -> the sum in len(a) + 1 digits, b a random digit string as long as a."""
    out = []
    for a in first:
        b = "".join(rng.choice(list(string.digits), size=len(a)).tolist())
        out.append({"inputs": f"{a}+{b}", "targets": str(int(a) + int(b)).zfill(len(a) + 1)})
    return out


def addition_splits(config: KazemnejadConfig) -> dict[str, list]:
    """The examples of addition of every split, as (key, example) pairs.

    The first operands of a split are distinct digit strings drawn as copy's
    strings are (`length_splits`), so train and validation are disjoint; the
    second operands are uniform digit strings of the same length.
    """
    firsts = length_splits(config, string.digits, lambda s: s)
    rng = np.random.default_rng([config.seed, 1])  # the second operands' own stream
    return {
        split: list(enumerate(_addition(rng, [ex["inputs"] for _, ex in examples])))
        for split, examples in firsts.items()
    }


class _KazemnejadBuilder(GeneratedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = _CONFIGS
    _TASK = ""

    def _splits(self):
        if self._TASK == "addition":
            return addition_splits(self.builder_config)
        return string_splits(self.builder_config, reverse=self._TASK == "reverse")


class JattnKzCopy(_KazemnejadBuilder):
    """Copy a string of 1-20 letters, test 21-40 (Kazemnejad et al. 2023): "abc" -> "abc".

    Lengths: train and validation 1-20, ``test_longer`` 21-40 (1,000
    examples). Metrics: sequence exact match (the paper's) and chrF.
    """

    _TASK = "copy"


class JattnKzReverse(_KazemnejadBuilder):
    """Reverse a string of 1-20 letters, test 21-40 (Kazemnejad et al. 2023): "abc" -> "cba".

    Lengths: train and validation 1-20, ``test_longer`` 21-40 (1,000
    examples). Metrics: sequence exact match (the paper's) and chrF.
    """

    _TASK = "reverse"


class JattnKzAddition(_KazemnejadBuilder):
    """Add two n-digit numbers, n 1-20, test 21-40 (Kazemnejad et al. 2023): "12+34" -> "046".

    Lengths (n, the digits of each operand): train and validation 1-20,
    ``test_longer`` 21-40 (1,000 examples). Metrics: sequence exact match
    (the paper's) and chrF.
    """

    _TASK = "addition"


# -- copy with repeated tokens ----------------------------------------------------------


@dataclasses.dataclass(eq=False)
class RepeatConfig(tfds.core.BuilderConfig):
    """Config of a copy variant with repeated tokens (Kazemnejad et al.'s data script).

    Attributes:
      examples_per_length: their ``num_examples_per_bin``: how many examples
        of each length their script generates for train and validation
        together. ``rsc``/``rsc2x`` use that many tokens, one example each
        (capped by the alphabet); ``rdc`` uses the k tokens with
        k = int((1 + sqrt(1 + 4 n)) / 2) and all their k (k - 1) ordered pairs.
      train_lengths: (min, max) repeats n of train and validation, inclusive.
      test_lengths: (min, max) repeats n of ``test_longer``, inclusive.
      num_validation: examples of train and validation's pool held out for
        validation (the rest is train).
      num_test_longer: examples of ``test_longer``, the same number from every
        length (their ``num_test``), drawn from the same tokens (or pairs).
      seed: seed of the generator; the data is a pure function of the config.
    """

    examples_per_length: int = 500
    train_lengths: tuple[int, int] = TRAIN_LENGTHS
    test_lengths: tuple[int, int] = TEST_LENGTHS
    num_validation: int = 1_000
    num_test_longer: int = 1_000
    seed: int = 0


REPEAT_CONFIGS = [
    RepeatConfig(
        name="default",
        description="Lengths 1-20, test_longer 21-40 (1,000); 500 examples a length "
        "(rsc: 500 tokens, rdc: all ordered pairs of 22).",
    ),
    RepeatConfig(
        name="tiny",
        examples_per_length=30,
        num_validation=50,
        num_test_longer=40,
        description="Tiny: for tests and smoke runs.",
    ),
]

# Tokens of the repeated variants: one character each, not the separators ">" ":".
_REPEAT_CJK = 0x4E00  # after 0-9a-zA-Z: CJK ideographs, printable and one character each


def repeat_alphabet(size: int) -> str:
    """The first `size` tokens: the 62 digits and letters, then CJK ideographs
    (Kazemnejad et al. use T5 pieces that are one token each, digits and letters first)."""
    base = string.digits + string.ascii_lowercase + string.ascii_uppercase
    return (base + "".join(chr(_REPEAT_CJK + i) for i in range(max(0, size - len(base)))))[:size]


def _repeat_pool(task: str, n: int, per_length: int) -> list[tuple[str, dict[str, str]]]:
    """Every example their script makes at length `n`: (token, example) pairs."""
    if task == "rdc":
        k = int((1 + math.sqrt(1 + 4 * per_length)) / 2)
        tokens = repeat_alphabet(k)
        return [
            (a + b, {"inputs": f"{a}>{b}:{a * n}", "targets": b * n})
            for a, b in itertools.permutations(tokens, 2)
        ]
    factor = 2 if task == "rsc2x" else 1
    return [
        (t, {"inputs": t * n, "targets": t * (factor * n)}) for t in repeat_alphabet(per_length)
    ]


def repeat_splits(config: RepeatConfig, task: str) -> dict[str, list]:
    """The examples of every split of a repeated-token copy variant.

    As their script: train and validation are every example of each training
    length (`_repeat_pool`), shuffled and split (``num_validation`` held
    out); ``test_longer`` samples ``num_test_longer / len(test lengths)``
    examples of each test length from its pool, without replacement.

    Raises:
      ValueError: an unknown variant, lengths that are not 1 <= train < test,
        or more examples asked of a split than its pool holds.
    """
    if task not in REPEAT_TASKS:
        raise ValueError(f"unknown repeated-token variant {task!r}; variants: {REPEAT_TASKS}")
    lo, hi = config.train_lengths
    tlo, thi = config.test_lengths
    if not 1 <= lo <= hi < tlo <= thi:
        raise ValueError(
            f"need 1 <= train_lengths < test_lengths, got {config.train_lengths} and "
            f"{config.test_lengths}"
        )
    rng = np.random.default_rng(config.seed)
    short = [
        ex for n in range(lo, hi + 1) for _, ex in _repeat_pool(task, n, config.examples_per_length)
    ]
    if config.num_validation >= len(short):
        raise ValueError(
            f"num_validation {config.num_validation} leaves no training example of the "
            f"{len(short)} of {task!r}"
        )
    short = [short[i] for i in rng.permutation(len(short))]
    lengths = range(tlo, thi + 1)
    per_length = even_allocation(config.num_test_longer, [config.num_test_longer] * len(lengths))
    longer = []
    for n, count in zip(lengths, per_length, strict=True):
        pool = _repeat_pool(task, n, config.examples_per_length)
        if count > len(pool):
            raise ValueError(f"{count} examples of length {n} asked of {len(pool)} for {task!r}")
        longer.extend(pool[i][1] for i in rng.choice(len(pool), size=count, replace=False))
    longer = [longer[i] for i in rng.permutation(len(longer))]
    parts = {
        "train": short[config.num_validation :],
        "validation": short[: config.num_validation],
        "test_longer": longer,
    }
    return {split: list(enumerate(examples)) for split, examples in parts.items()}


REPEAT_TASKS = ("rsc", "rsc2x", "rdc")


class _RepeatBuilder(GeneratedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = REPEAT_CONFIGS
    _TASK = ""

    def _splits(self):
        return repeat_splits(self.builder_config, self._TASK)


class JattnKzCopyRsc(_RepeatBuilder):
    """Copy one token repeated n times, n 1-20, test 21-40 (``rsc``): "aaa" -> "aaa".

    Lengths: train and validation 1-20, ``test_longer`` 21-40 (1,000
    examples, 50 a length). Tokens: 500, one example of each at every length.
    """

    _TASK = "rsc"


class JattnKzCopyRsc2x(_RepeatBuilder):
    """Copy one token repeated n times twice, n 1-20, test 21-40 (``rsc2x``): "aa" -> "aaaa".

    Lengths: train and validation 1-20, ``test_longer`` 21-40 (1,000
    examples, 50 a length). Tokens: 500, one example of each at every length.
    """

    _TASK = "rsc2x"


class JattnKzCopyRdc(_RepeatBuilder):
    """Replace a repeated token by another, n 1-20, test 21-40 (``rdc``): "a>b:aaa" -> "bbb".

    Lengths (n, the repeats): train and validation 1-20, ``test_longer`` 21-40
    (1,000 examples, 50 a length). Tokens: 22, every ordered pair at every length.
    """

    _TASK = "rdc"


# The task names `jattn.data.load` knows from this module, with the default config.
BUILDERS = {
    "kz_copy": (JattnKzCopy, "default"),
    "kz_reverse": (JattnKzReverse, "default"),
    "kz_addition": (JattnKzAddition, "default"),
    "kz_copy_rsc": (JattnKzCopyRsc, "default"),
    "kz_copy_rsc2x": (JattnKzCopyRsc2x, "default"),
    "kz_copy_rdc": (JattnKzCopyRdc, "default"),
}
