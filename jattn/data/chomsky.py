"""Delétang et al. (2023)'s 15 tasks as local tfds builders.

The tasks (`jattn.data.chomsky_tasks`, one generator each) of "Neural
Networks and the Chomsky Hierarchy" (ICLR 2023), which Ruoss et al. (2023)
reuse for randomised positions:

- regular: ``even_pairs``, ``modular_arithmetic``, ``parity_check``,
  ``cycle_navigation``;
- deterministic context-free: ``stack_manipulation``, ``reverse_string``,
  ``modular_arithmetic_brackets``, ``solve_equation``;
- context-sensitive: ``duplicate_string``, ``missing_duplicate_string``,
  ``odds_first``, ``binary_addition``, ``binary_multiplication``,
  ``compute_sqrt``, ``bucket_sort``.

`jattn.data.load("parity_check")` prepares one. Lengths are the paper's:
``train`` and ``validation`` draw input lengths 1-40, ``test_longer`` 41-500,
each length equally often (as their uniform curriculum and their per-length
evaluation), examples i.i.d. within a length: the paper samples fresh
batches, so short lengths repeat (there are two strings of one bit) and
validation shares examples with training there; every ``test_longer``
example is longer than any training one. Configs:

- ``default``: 100,000 training examples, 1,000 validation (25 a length),
  1,380 ``test_longer`` (3 for each length 41-500);
- ``test100``: the same training set, ``test_longer`` 41-100 (1,200, 20 a
  length) for a budget that cannot run lengths up to 500;
- ``tiny``: 600 / 50 / 50, ``test_longer`` 41-60, for tests.

The paper trains an encoder-only model that reads the input, then a tape of
``len(targets)`` blank tokens, and predicts every target token at once; the
targets here are what that tape holds (a single token for the classification
tasks). Its metric is per-token accuracy, averaged over the lengths of
41-500; `chomsky_tasks.scored_length` gives the tokens of a padded target
it counts.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import tensorflow_datasets as tfds

from jattn.data.builders import GeneratedBuilder, even_allocation
from jattn.data.chomsky_tasks import GENERATORS, LEVELS

__all__ = ["BUILDERS", "CONFIGS", "ChomskyConfig", "TASKS", "chomsky_splits", "LEVELS"]

TASKS = tuple(GENERATORS)  # the 15 task names, in the paper's order
TRAIN_LENGTHS = (1, 40)
TEST_LENGTHS = (41, 500)


@dataclasses.dataclass(eq=False)
class ChomskyConfig(tfds.core.BuilderConfig):
    """Config of a Delétang et al. task.

    Attributes:
      train_lengths: (min, max) input length of train and validation, inclusive.
      test_lengths: (min, max) input length of ``test_longer``, inclusive; above
        `train_lengths`.
      num_train, num_validation, num_test_longer: split sizes, spread evenly over
        the lengths of the split (the first lengths get one more when they do
        not divide).
      seed: seed of the generator; the data is a pure function of the task,
        the config and the seed, and each split has its own stream (changing
        the test lengths leaves training alone).
    """

    train_lengths: tuple[int, int] = TRAIN_LENGTHS
    test_lengths: tuple[int, int] = TEST_LENGTHS
    num_train: int = 100_000
    num_validation: int = 1_000
    num_test_longer: int = 1_380
    seed: int = 0


CONFIGS = [
    ChomskyConfig(
        name="default",
        description="The paper's lengths: train 1-40, test_longer 41-500 (3 a length).",
    ),
    ChomskyConfig(
        name="test100",
        test_lengths=(41, 100),
        num_test_longer=1_200,
        description="Train 1-40, test_longer 41-100 (20 a length): for smaller budgets.",
    ),
    ChomskyConfig(
        name="tiny",
        test_lengths=(41, 60),
        num_train=600,
        num_validation=50,
        num_test_longer=50,
        description="Tiny: for tests and smoke runs.",
    ),
]

_SPLITS = ("train", "validation", "test_longer")


def split_lengths(rng: np.random.Generator, total: int, lengths: tuple[int, int]) -> np.ndarray:
    """`total` input lengths, each of [lo, hi] equally often (as far as `total`
    allows), in random order, int `[total]`."""
    lo, hi = lengths
    counts = even_allocation(total, [total] * (hi - lo + 1))
    return rng.permutation(np.repeat(np.arange(lo, hi + 1), counts))


def chomsky_splits(task: str, config: ChomskyConfig) -> dict[str, list]:
    """The examples of every split of `task`, as (key, example) pairs.

    Raises:
      ValueError: an unknown task, or lengths that are not 1 <= train < test.
    """
    if task not in GENERATORS:
        raise ValueError(f"unknown Chomsky task {task!r}; tasks: {sorted(GENERATORS)}")
    lo, hi = config.train_lengths
    tlo, thi = config.test_lengths
    if not 1 <= lo <= hi < tlo <= thi:
        raise ValueError(
            f"need 1 <= train_lengths < test_lengths, got {config.train_lengths} and "
            f"{config.test_lengths}"
        )
    generate = GENERATORS[task]
    sizes = (config.num_train, config.num_validation, config.num_test_longer)
    ranges = (config.train_lengths, config.train_lengths, config.test_lengths)
    out = {}
    for index, (split, size, lengths) in enumerate(zip(_SPLITS, sizes, ranges, strict=True)):
        rng = np.random.default_rng([config.seed, zlib.crc32(task.encode()), index])
        examples = []
        for key, length in enumerate(split_lengths(rng, size, lengths).tolist()):
            inputs, targets = generate(rng, length)
            examples.append((key, {"inputs": inputs, "targets": targets}))
        out[split] = examples
    return out


class _ChomskyBuilder(GeneratedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = CONFIGS
    _TASK = ""

    def _splits(self):
        return chomsky_splits(self._TASK, self.builder_config)


def _builder(task: str) -> type[_ChomskyBuilder]:
    """The builder class of one task: `JattnChomsky<Task>`, documented by its generator."""
    level = {"regular": "regular", "dcf": "deterministic context-free", "cs": "context-sensitive"}
    doc = (
        f"{task} (Delétang et al. 2023, {level[LEVELS[task]]}): train 1-40, test_longer "
        f"41-500.\n\n    {GENERATORS[task].__doc__.strip()}\n"
    )
    name = "JattnChomsky" + "".join(part.title() for part in task.split("_"))
    return type(name, (_ChomskyBuilder,), {"_TASK": task, "__doc__": doc, "__module__": __name__})


# The task names `jattn.data.load` knows from this module, with the default config.
BUILDERS = {task: (_builder(task), "default") for task in TASKS}
