"""The copy, reverse and addition tasks with the lengths of Kazemnejad et al. (2023).

Kazemnejad et al., "The Impact of Positional Encoding on Length
Generalization in Transformers" (NeurIPS 2023), train decoder-only models on
instances of length up to L = 20 and test them on longer ones, up to 2L = 40,
scoring sequence exact match by length. Here:

- ``kz_copy``: "abc" -> "abc"; ``kz_reverse``: "abc" -> "cba": random strings
  over the first `alphabet_size` lowercase letters (16), one letter a token;
- ``kz_addition``: "0123+4567" -> "04690": two operands of n digits each
  (leading zeros allowed, so every n-digit string is an operand) and their
  sum written with n + 1 digits; the length is n.

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
import string

import numpy as np
import tensorflow_datasets as tfds

from jattn.data.builders import GeneratedBuilder, length_splits

__all__ = ["BUILDERS", "KazemnejadConfig", "addition_splits", "string_splits"]

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


# The task names `jattn.data.load` knows from this module, with the default config.
BUILDERS = {
    "kz_copy": (JattnKzCopy, "default"),
    "kz_reverse": (JattnKzReverse, "default"),
    "kz_addition": (JattnKzAddition, "default"),
}
