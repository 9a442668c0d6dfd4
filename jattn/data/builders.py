"""Local tfds builders for the small algorithmic tasks.

- ``numbers``: digits to number words ("342" -> "dreihundertzweiundvierzig");
- ``copy`` and ``reverse``: random strings of letters;
- ``reverse_digits`` and ``duplicate_digits``: the reversing and duplication
  tasks of Ontañón et al., "Making Transformers Solve Compositional Tasks"
  (ACL 2022): digit strings of 1-16 digits in training, 17-24 in ``test_longer``.

Every builder is a real `tfds.core.GeneratorBasedBuilder`: versioned, with
`BuilderConfig`s that fix language, sizes and seed, generated locally (nothing is
downloaded) and written as array_record so it is read back with
`builder.as_data_source()`; TensorFlow is not needed.

Each example is `{"inputs": str, "targets": str}`. Every task has three splits:

- ``train`` and ``validation``: disjoint, drawn from the short regime (numbers of
  1 to 5 digits; strings of ``train_lengths``);
- ``test_longer``: only longer examples (numbers of 6 digits; strings of
  ``test_lengths``), none of which appears in training, for length generalisation.

Every ``test_longer`` split of the default configs can be produced from what
training shows: each of its target characters occurs in some training target
(`jattn.data.producibility` checks this whenever a run prepares data). The
old ``numbers`` split (1-6 digits, test 7-8) is ``numbers/de_7to8``: its test
targets need "Million", which training never shows.

Generation is a pure function of the config (its ``seed`` included): the same
config gives byte-identical splits.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np
import tensorflow_datasets as tfds
from num2words import num2words

_FEATURES = lambda: tfds.features.FeaturesDict(
    {"inputs": tfds.features.Text(), "targets": tfds.features.Text()}
)

# ---------------------------------------------------------------------------
# Sampling helpers (pure numpy, deterministic given the generator).
# ---------------------------------------------------------------------------


def even_allocation(total: int, capacities: list[int]) -> list[int]:
    """Splits `total` into per-bucket counts as evenly as capacities allow.

    Buckets whose capacity is smaller than their fair share are filled, and the
    remainder is spread over the others (water filling), so the result sums to
    `total` exactly.

    Raises:
      ValueError: if `total` exceeds the summed capacity.
    """
    if total > sum(capacities):
        raise ValueError(f"cannot draw {total} distinct items from {sum(capacities)} candidates")
    counts = [0] * len(capacities)
    open_buckets = list(range(len(capacities)))
    remaining = total
    while remaining > 0:
        share, extra = divmod(remaining, len(open_buckets))
        still_open = []
        for rank, b in enumerate(open_buckets):
            want = share + (1 if rank < extra else 0)
            take = min(want, capacities[b] - counts[b])
            counts[b] += take
            remaining -= take
            if counts[b] < capacities[b]:
                still_open.append(b)
        open_buckets = still_open
    return counts


def _distinct_integers(rng: np.random.Generator, low: int, high: int, count: int) -> np.ndarray:
    """`count` distinct integers drawn uniformly from [low, high), in random order."""
    size = high - low
    if count > size:
        raise ValueError(f"cannot draw {count} distinct integers from [{low}, {high})")
    if count * 4 >= size:  # dense: a permutation is cheap enough
        return low + rng.permutation(size)[:count]
    chosen: dict[int, None] = {}  # insertion-ordered set
    while len(chosen) < count:
        for x in rng.integers(low, high, size=2 * (count - len(chosen))).tolist():
            chosen.setdefault(x, None)
            if len(chosen) == count:
                break
    return np.fromiter(chosen, dtype=np.int64, count=count)


def _digit_range(digits: int) -> tuple[int, int]:
    """Integers with exactly `digits` decimal digits (0 counts as one digit)."""
    return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits


def sample_numbers(
    rng: np.random.Generator, total: int, digit_counts: tuple[int, ...]
) -> np.ndarray:
    """`total` distinct integers, spread evenly over the given digit counts."""
    ranges = [_digit_range(d) for d in digit_counts]
    counts = even_allocation(total, [hi - lo for lo, hi in ranges])
    parts = [_distinct_integers(rng, lo, hi, c) for (lo, hi), c in zip(ranges, counts, strict=True)]
    return rng.permutation(np.concatenate(parts)) if parts else np.zeros([0], np.int64)


def sample_strings(
    rng: np.random.Generator,
    total: int,
    lengths: tuple[int, int],
    alphabet: str,
) -> list[str]:
    """`total` distinct random strings over `alphabet`, lengths uniform in [lo, hi]."""
    lo, hi = lengths
    k = len(alphabet)
    capacities = [k**n for n in range(lo, hi + 1)]
    counts = even_allocation(total, capacities)
    letters = np.array(list(alphabet))
    out: list[str] = []
    for n, c in zip(range(lo, hi + 1), counts, strict=True):
        codes = _distinct_integers(rng, 0, k**n, c) if k**n < 2**62 else None
        if codes is None:  # too many strings to index with int64: draw and dedupe
            seen: dict[str, None] = {}
            while len(seen) < c:
                seen.setdefault("".join(letters[rng.integers(0, k, size=n)]), None)
            out.extend(seen)
            continue
        for code in codes.tolist():
            chars = []
            for _ in range(n):
                code, r = divmod(code, k)
                chars.append(letters[r])
            out.append("".join(chars))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


class LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base of builders that generate everything locally (no download, no checksums).

    tfds 4.9.10 looks up a checksums file next to the builder's code through
    `importlib_resources`, which it only installs for Python < 3.9, so
    `download_and_prepare` of a builder living in a package fails without it.
    A local builder downloads nothing, so it has no code path to look in.
    """

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        return None


class GeneratedBuilder(LocalBuilder, skip_registration=True):
    """A local builder of `{"inputs": str, "targets": str}` examples whose splits
    are a pure function of its config (`_splits`)."""

    def _splits(self) -> dict[str, list]:
        raise NotImplementedError

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.__doc__,
            features=_FEATURES(),
            supervised_keys=("inputs", "targets"),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        return {name: self._generate_examples(ex) for name, ex in self._splits().items()}

    def _generate_examples(self, examples):
        yield from examples


# ---------------------------------------------------------------------------
# numbers: digits -> words
# ---------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class NumbersConfig(tfds.core.BuilderConfig):
    """Config of the numbers task.

    Attributes:
      language: num2words language code ("de", "en", "fr", ...).
      num_train: training examples (distinct numbers of `train_digits` digits).
      num_validation: validation examples, disjoint from train.
      num_test_longer: examples of `test_digits` digits, never in training.
      train_digits: digit counts of train and validation numbers.
      test_digits: digit counts of the `test_longer` numbers.
      train_extra: numbers added to train (beyond `num_train`) and kept out of the
        other splits, whatever their digit count (e.g. ROUND_MILLIONS).
      seed: seed of the generator; the data is a pure function of the config.
    """

    language: str = "de"
    num_train: int = 20_000
    num_validation: int = 1_000
    num_test_longer: int = 1_000
    train_digits: tuple[int, ...] = (1, 2, 3, 4, 5)
    test_digits: tuple[int, ...] = (6,)
    train_extra: tuple[int, ...] = ()
    seed: int = 0


# 1, 2, ..., 99 million: with these in training, the words of 7 and 8 digit numbers
# ("Million", "Millionen") are all seen, and `test_longer` tests composing them.
ROUND_MILLIONS = tuple(k * 10**6 for k in range(1, 100))


def numbers_splits(config: NumbersConfig) -> dict[str, list[tuple[int, dict[str, str]]]]:
    """The examples of every split of the numbers task, as (key, example) pairs."""
    if set(config.train_digits) & set(config.test_digits):
        raise ValueError(
            f"train_digits {config.train_digits} and test_digits {config.test_digits} overlap"
        )
    rng = np.random.default_rng(config.seed)
    short = sample_numbers(rng, config.num_train + config.num_validation, config.train_digits)
    extra = np.asarray(sorted(set(config.train_extra)), np.int64)
    longer = sample_numbers(rng, config.num_test_longer + len(extra), config.test_digits)
    longer = longer[~np.isin(longer, extra)][: config.num_test_longer]
    short_extra = np.isin(short, extra)
    short = np.concatenate([short[~short_extra], short[short_extra]])  # extras last: not in val
    parts = {
        "train": np.concatenate([short[config.num_validation :], extra[~np.isin(extra, short)]]),
        "validation": short[: config.num_validation],
        "test_longer": longer,
    }
    return {
        split: [
            (i, {"inputs": str(n), "targets": num2words(n, lang=config.language)})
            for i, n in enumerate(numbers.tolist())
        ]
        for split, numbers in parts.items()
    }


# The split of version 1.0.0: 1-6 digits in training, 7-8 in test_longer.
_DIGITS_7TO8 = dict(train_digits=(1, 2, 3, 4, 5, 6), test_digits=(7, 8))


class JattnNumbers(GeneratedBuilder):
    """Digits to words (num2words): "342" -> "dreihundertzweiundvierzig" (German)."""

    VERSION = tfds.core.Version("2.0.0")
    RELEASE_NOTES = {
        "1.0.0": "Initial release.",
        "2.0.0": "Default split 1-5 digits / test_longer 6 digits, producible from training; "
        "the 1.0.0 split is the config de_7to8.",
    }
    BUILDER_CONFIGS = [
        NumbersConfig(name="de", language="de", description="German (default)."),
        NumbersConfig(name="en", language="en", description="English."),
        NumbersConfig(name="fr", language="fr", description="French."),
        NumbersConfig(
            name="de_7to8",
            language="de",
            **_DIGITS_7TO8,
            description="German, 1-6 digits, test 7-8: test targets need unseen words "
            "('Million'), so no model can produce them.",
        ),
        NumbersConfig(
            name="de_millions",
            language="de",
            train_extra=ROUND_MILLIONS,
            **_DIGITS_7TO8,
            description="German, 1-6 digits plus 1..99 million in train, test 7-8.",
        ),
        NumbersConfig(
            name="de_tiny",
            language="de",
            num_train=600,
            num_validation=50,
            num_test_longer=50,
            description="German, tiny: for tests and smoke runs.",
        ),
    ]

    def _splits(self):
        return numbers_splits(self.builder_config)


# ---------------------------------------------------------------------------
# copy and reverse of random strings
# ---------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class StringsConfig(tfds.core.BuilderConfig):
    """Config of the copy / reverse tasks.

    Attributes:
      alphabet_size: the strings use the first `alphabet_size` lowercase letters.
      train_lengths: (min, max) string length of train and validation, inclusive.
      test_lengths: (min, max) string length of `test_longer`, inclusive.
      num_train, num_validation, num_test_longer: split sizes (distinct strings).
      seed: seed of the generator.
    """

    alphabet_size: int = 16
    train_lengths: tuple[int, int] = (1, 15)
    test_lengths: tuple[int, int] = (16, 30)
    num_train: int = 20_000
    num_validation: int = 1_000
    num_test_longer: int = 1_000
    seed: int = 0


_STRINGS_CONFIGS = [
    StringsConfig(name="default", description="Strings of 1-15 letters, test 16-30."),
    StringsConfig(
        name="tiny",
        num_train=600,
        num_validation=50,
        num_test_longer=50,
        description="Tiny: for tests and smoke runs.",
    ),
]


def length_splits(config, alphabet: str, target) -> dict[str, list]:
    """Splits of a string task whose `test_longer` lengths lie above training's.

    Args:
      config: has `train_lengths`, `test_lengths` ((min, max), inclusive),
        `num_train`, `num_validation`, `num_test_longer` and `seed`.
      alphabet: the characters of the input strings.
      target: input string -> target string.

    Returns:
      ``{"train", "validation", "test_longer"}`` -> (key, example) pairs; train
      and validation are disjoint draws from the training lengths.
    """
    lo, hi = config.train_lengths
    tlo, thi = config.test_lengths
    if not 1 <= lo <= hi < tlo <= thi:
        raise ValueError(
            f"need 1 <= train_lengths <= test_lengths disjoint, got {config.train_lengths} "
            f"and {config.test_lengths}"
        )
    rng = np.random.default_rng(config.seed)
    short = sample_strings(
        rng, config.num_train + config.num_validation, config.train_lengths, alphabet
    )
    longer = sample_strings(rng, config.num_test_longer, config.test_lengths, alphabet)
    parts = {
        "train": short[config.num_validation :],
        "validation": short[: config.num_validation],
        "test_longer": longer,
    }
    return {
        split: [(i, {"inputs": s, "targets": target(s)}) for i, s in enumerate(strings)]
        for split, strings in parts.items()
    }


def strings_splits(config: StringsConfig, reverse: bool) -> dict[str, list]:
    """The examples of every split of copy (or reverse), as (key, example) pairs."""
    if not 1 <= config.alphabet_size <= 26:
        raise ValueError(f"alphabet_size must be in [1, 26], got {config.alphabet_size}")
    alphabet = string.ascii_lowercase[: config.alphabet_size]
    return length_splits(config, alphabet, (lambda s: s[::-1]) if reverse else (lambda s: s))


class _StringsBuilder(GeneratedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = _STRINGS_CONFIGS
    _REVERSE = False

    def _splits(self):
        return strings_splits(self.builder_config, reverse=self._REVERSE)


class JattnCopy(_StringsBuilder):
    """Copy a random string of letters: "abc" -> "abc"."""

    _REVERSE = False


class JattnReverse(_StringsBuilder):
    """Reverse a random string of letters: "abc" -> "cba"."""

    _REVERSE = True


# ---------------------------------------------------------------------------
# reversing and duplication of digit strings (Ontañón et al. 2022)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class DigitsConfig(tfds.core.BuilderConfig):
    """Config of the digit-string tasks of Ontañón et al. (2022).

    Their recipe: digits 0-9, training lengths 1-16, `test_longer` lengths
    17-24, 200k training examples, an explicit end token (jattn's EOS), and
    sequence exact match on 1,024 test examples. Validation (1,024 here) is
    drawn with training from lengths 1-16 and is disjoint from it.

    Attributes:
      train_lengths: (min, max) digits of train and validation, inclusive.
      test_lengths: (min, max) digits of `test_longer`, inclusive.
      num_train, num_validation, num_test_longer: split sizes (distinct strings;
        short lengths hold fewer distinct strings, and the others make up for them).
      seed: seed of the generator; the data is a pure function of the config.
    """

    train_lengths: tuple[int, int] = (1, 16)
    test_lengths: tuple[int, int] = (17, 24)
    num_train: int = 200_000
    num_validation: int = 1_024
    num_test_longer: int = 1_024
    seed: int = 0


DIGITS_CONFIGS = [
    DigitsConfig(name="default", description="Ontañón et al.: 1-16 digits, test 17-24."),
    DigitsConfig(
        name="small",
        num_train=50_000,
        description="1-16 digits, test 17-24, 50k training examples (quick experiments).",
    ),
    DigitsConfig(
        name="tiny",
        num_train=600,
        num_validation=50,
        num_test_longer=50,
        description="Tiny: for tests and smoke runs.",
    ),
]

# task -> the target of a digit string
DIGIT_TASKS = {
    "reverse_digits": lambda s: s[::-1],
    "duplicate_digits": lambda s: s + s,
}


def digits_splits(config: DigitsConfig, task: str) -> dict[str, list]:
    """The examples of every split of a digit task, as (key, example) pairs."""
    return length_splits(config, string.digits, DIGIT_TASKS[task])


class _DigitsBuilder(GeneratedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = DIGITS_CONFIGS
    _TASK = ""

    def _splits(self):
        return digits_splits(self.builder_config, self._TASK)


class JattnReverseDigits(_DigitsBuilder):
    """Reverse a string of digits: "0123" -> "3210" (Ontañón et al.'s reversing)."""

    _TASK = "reverse_digits"


class JattnDuplicateDigits(_DigitsBuilder):
    """Repeat a string of digits: "012" -> "012012" (Ontañón et al.'s duplication)."""

    _TASK = "duplicate_digits"


# This module's tasks, with their builder and default config (every task
# `jattn.data.load` knows, these and those of their own modules, is in
# `jattn.data.registry.BUILDERS`).
BUILDERS: dict[str, tuple[type[tfds.core.GeneratorBasedBuilder], str]] = {
    "numbers": (JattnNumbers, "de"),
    "copy": (JattnCopy, "default"),
    "reverse": (JattnReverse, "default"),
    "reverse_digits": (JattnReverseDigits, "default"),
    "duplicate_digits": (JattnDuplicateDigits, "default"),
}
