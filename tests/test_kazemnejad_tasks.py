"""Copy, reverse and addition with Kazemnejad et al. (2023)'s lengths.

Contracts: training lengths 1-20 and `test_longer` 21-40 (every test example
longer than any training one), 1,000 examples per evaluation split in the
default configs, targets the task's function of the inputs, train and
validation disjoint, and every `test_longer` target producible from what
training shows.
"""

import pathlib
import string

import pytest

from jattn import data
from jattn.data import kazemnejad, producibility

TASKS = ("kz_copy", "kz_reverse", "kz_addition")
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    return {name: data.load(f"{name}/tiny", data_dir=data_dir) for name in TASKS}


def length_of(name: str, inputs: str) -> int:
    return len(inputs.split("+")[0]) if name == "kz_addition" else len(inputs)


def expected_target(name: str, inputs: str) -> str:
    if name == "kz_copy":
        return inputs
    if name == "kz_reverse":
        return inputs[::-1]
    a, b = inputs.split("+")
    return str(int(a) + int(b)).zfill(len(a) + 1)


@pytest.mark.parametrize("name", TASKS)
def test_lengths_targets_and_disjoint_splits(tasks, name):
    task = tasks[name]
    assert task.splits == ("train", "validation", "test_longer")
    assert task.metrics == ("exact_match", "chrf")
    train, val, test = (
        [(ex["inputs"], ex["targets"]) for ex in task.source(s)] for s in task.splits
    )
    assert (len(train), len(val), len(test)) == (600, 50, 50)
    for inputs, target in train + val + test:
        assert target == expected_target(name, inputs)
    assert {length_of(name, i) for i, _ in train + val} <= set(range(1, 21))
    assert {length_of(name, i) for i, _ in test} <= set(range(21, 41))
    assert max(length_of(name, i) for i, _ in train) == 20
    assert not {i for i, _ in train} & {i for i, _ in val}
    alphabet = set(string.digits + "+") if name == "kz_addition" else set("abcdefghijklmnop")
    assert set("".join(i for i, _ in train + test)) <= alphabet


def test_addition_by_hand():
    # 0123 + 4567 = 4690, written with one more digit than the operands.
    assert expected_target("kz_addition", "0123+4567") == "04690"
    config = kazemnejad.KazemnejadConfig(
        name="t", num_train=40, num_validation=5, num_test_longer=5
    )
    splits = kazemnejad.addition_splits(config)
    for _, ex in splits["train"]:
        a, b = ex["inputs"].split("+")
        assert len(a) == len(b) and len(ex["targets"]) == len(a) + 1
        assert int(ex["targets"]) == int(a) + int(b)
    assert kazemnejad.addition_splits(config) == splits  # a pure function of the config


def test_default_configs_have_the_papers_lengths_and_1000_eval_examples():
    for cls, default in kazemnejad.BUILDERS.values():
        (config,) = [c for c in cls.BUILDER_CONFIGS if c.name == default]
        assert config.train_lengths == (1, 20) and config.test_lengths == (21, 40)
        assert config.num_validation >= 1_000 and config.num_test_longer >= 1_000
        # Each builder's docstring states its lengths.
        assert "1-20" in cls.__doc__ and "21-40" in cls.__doc__


@pytest.mark.parametrize("name", TASKS)
def test_test_longer_is_fully_producible_and_longer(tasks, name):
    result = producibility.check(tasks[name], ["validation", "test_longer"])
    assert result["test_longer"]["producible"] == 1.0
    assert result["test_longer"]["longer_than_train"] == 1.0
    assert result["validation"]["longer_than_train"] == 0.0
    assert producibility.warnings(result) == []


@pytest.mark.parametrize("name", TASKS)
def test_config_rows_hold_every_example_of_its_task(tasks, name):
    """configs/kazemnejad.py's training rows hold the longest training example and
    its evaluation rows the longest test_longer one (none is dropped)."""
    from jattn.train.config import load_config  # noqa: PLC0415

    task_arg = name.removeprefix("kz_")
    config = load_config(f"{ROOT}/configs/kazemnejad.py:{task_arg},rope")
    assert config.dataset == name and config.model.position == "rope"
    tok = tasks[name].tokenizer
    longest = {
        split: (
            max(len(tok.encode(ex["inputs"])) for ex in tasks[name].source(split)),
            max(len(tok.encode(ex["targets"])) for ex in tasks[name].source(split)),
        )
        for split in ("train", "test_longer")
    }
    # By construction: 20 (41 for addition's "a+b") training input tokens + EOS.
    assert longest["train"][0] <= config.max_input_len
    assert longest["train"][1] <= config.max_len
    assert longest["test_longer"][0] <= config.eval_max_input_len
    assert longest["test_longer"][1] <= config.eval_max_len
    assert config.eval_max_batches * config.eval_batch_size >= 1_000
    assert config.eval_decode_examples >= 1_000


def test_the_decoder_only_experiment_is_kazemnejads_grid():
    """experiments/decoder_only.py trains Kazemnejad et al.'s copy and reverse with
    decoder-only models only, every scheme of its list, 3 seeds."""
    from jattn.analysis import grid  # noqa: PLC0415
    from jattn.train.config import load_config  # noqa: PLC0415

    exp = load_config(f"{ROOT}/experiments/decoder_only.py")
    runs = grid.expand(exp, "/nonexistent")
    assert len(runs) == 2 * 6 * 3
    configs = [grid.training_config(exp, run, str(ROOT)) for run in runs]
    assert {c.dataset for c in configs} == {"kz_copy", "kz_reverse"}
    assert {c.model.position for c in configs} == {
        "none",
        "t5",
        "alibi",
        "rope",
        "sinusoidal",
        "fire",
    }
    assert {c.model.architecture for c in configs} == {"decoder_only"}
