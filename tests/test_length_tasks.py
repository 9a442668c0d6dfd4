"""The length-generalisation tasks: digit builders (Ontañón et al. 2022), the
redesigned `numbers` split, and the producibility check every run performs.

Contracts: splits are disjoint and have the configured lengths; every
`test_longer` split a shipped experiment uses can be produced from what
training shows (all its target tokens occur in training targets), and a
split that cannot (`numbers/de_7to8`) is reported as such, not as a 0.
"""

import string

import pytest

from jattn import data
from jattn.data import builders, producibility


def records(task, split):
    return [(ex["inputs"], ex["targets"]) for ex in task.source(split)]


@pytest.fixture(scope="module")
def digit_tasks(data_dir):
    return {
        name: data.load(f"{name}/tiny", data_dir=data_dir)
        for name in ("reverse_digits", "duplicate_digits")
    }


@pytest.mark.parametrize("name", ["reverse_digits", "duplicate_digits"])
def test_digit_tasks_splits_lengths_and_targets(digit_tasks, name):
    task = digit_tasks[name]
    assert task.splits == ("train", "validation", "test_longer")
    train, val, test = (records(task, s) for s in task.splits)
    assert (len(train), len(val), len(test)) == (600, 50, 50)
    for i, t in train + val + test:
        assert set(i) <= set(string.digits)
        assert t == (i[::-1] if name == "reverse_digits" else i + i)
    assert {len(i) for i, _ in train + val} <= set(range(1, 17))
    assert {len(i) for i, _ in test} <= set(range(17, 25))
    assert max(len(i) for i, _ in train) == 16 and min(len(i) for i, _ in test) == 17
    train_in, val_in, test_in = ({i for i, _ in split} for split in (train, val, test))
    assert len(train_in) == len(train)  # distinct strings
    assert not train_in & val_in and not train_in & test_in
    # Padding, EOS, unknown and the ten digits: a model has nothing else to emit.
    assert task.tokenizer.vocab_size == 13


def test_digit_splits_follow_the_config_and_seed():
    config = builders.DigitsConfig(
        name="t", num_train=200, num_validation=20, num_test_longer=30, test_lengths=(20, 21)
    )
    a = builders.digits_splits(config, "reverse_digits")
    b = builders.digits_splits(config, "reverse_digits")
    assert a == b  # a pure function of the config
    assert {len(ex["inputs"]) for _, ex in a["test_longer"]} == {20, 21}
    other = builders.digits_splits(
        builders.DigitsConfig(name="t", num_train=200, seed=1), "reverse_digits"
    )
    assert other["train"] != a["train"]
    with pytest.raises(ValueError, match="disjoint"):
        builders.digits_splits(
            builders.DigitsConfig(name="t", train_lengths=(1, 17)), "reverse_digits"
        )


def test_default_digit_config_is_the_anchors_recipe():
    (default,) = [c for c in builders.DIGITS_CONFIGS if c.name == "default"]
    assert default.train_lengths == (1, 16) and default.test_lengths == (17, 24)
    assert default.num_train == 200_000 and default.num_test_longer == 1_024


@pytest.mark.parametrize("name", ["reverse_digits", "duplicate_digits"])
def test_digit_test_longer_is_fully_producible_and_longer(digit_tasks, name):
    result = producibility.check(digit_tasks[name], ["validation", "test_longer"])
    assert result["test_longer"]["producible"] == 1.0
    assert result["test_longer"]["longer_than_train"] == 1.0  # 17+ digits, all
    assert result["validation"]["longer_than_train"] == 0.0
    assert result["train"]["max_target_tokens"] == (17 if name == "reverse_digits" else 33)
    assert producibility.warnings(result) == []
    assert producibility.metrics(result)["data/test_longer/producible"] == 1.0


@pytest.fixture(scope="module")
def numbers_old_and_new(data_dir):
    return data.load("numbers", data_dir=data_dir), data.load("numbers/de_7to8", data_dir=data_dir)


def test_numbers_split_producible_and_the_old_one_not(numbers_old_and_new):
    new, old = numbers_old_and_new
    ok = producibility.check(new, ["validation", "test_longer"])
    assert ok["test_longer"]["producible"] == 1.0 and ok["validation"]["producible"] == 1.0
    assert 0.0 < ok["test_longer"]["longer_than_train"] < 1.0
    assert {len(ex["inputs"]) for ex in new.source("test_longer")} == {6}
    bad = producibility.check(old, ["validation", "test_longer"])
    # The 1.0.0 split: "Million" needs a space, "M" and "o", never in a training target.
    assert bad["test_longer"]["producible"] == 0.0
    assert {" ", "M", "o"} <= set(bad["test_longer"]["unseen_characters"])
    (line,) = producibility.warnings(bad)
    assert "test_longer" in line and "0.0%" in line


def test_check_counts_tokens_by_hand(digit_tasks):
    """The shares are counts over the split, computed here independently."""
    task = digit_tasks["reverse_digits"]
    result = producibility.check(task, ["test_longer"], limit=10)
    assert result["train"]["scanned"] == 10 and result["train"]["examples"] == 600
    sample = producibility.sample_indices(600, 10)
    train = [task.source("train")[int(i)]["targets"] for i in sample]
    seen = set("".join(train))
    longest = max(len(t) for t in train) + 1  # EOS
    test = [ex["targets"] for ex in task.source("test_longer")]
    want_producible = sum(set(t) <= seen for t in test) / len(test)
    want_longer = sum(len(t) + 1 > longest for t in test) / len(test)
    assert result["test_longer"]["producible"] == pytest.approx(want_producible)
    assert result["test_longer"]["longer_than_train"] == pytest.approx(want_longer)
    assert result["train"]["max_target_tokens"] == longest


def _shipped_datasets() -> set[tuple[str, str]]:
    """The (dataset, tokenizer) of every run of every preset of every shipped experiment."""
    import pathlib  # noqa: PLC0415

    from jattn.analysis import grid  # noqa: PLC0415
    from jattn.train.config import load_config  # noqa: PLC0415

    root = pathlib.Path(__file__).resolve().parent.parent
    found = set()
    for path in sorted((root / "experiments").glob("*.py")):
        if "def get_config" not in path.read_text():
            continue  # a benchmark script
        for preset in ("", "duplicate", "quick", "length22"):
            try:
                exp = load_config(f"{path}:{preset}" if preset else str(path))
            except Exception:  # noqa: BLE001, S112 - a preset this experiment lacks
                continue
            for run in grid.expand(exp, "/nonexistent"):
                config = grid.training_config(exp, run, str(root))
                found.add((config.dataset, config.tokenizer))
    return found


@pytest.mark.slow
def test_every_shipped_experiments_test_longer_is_producible(data_dir):
    """DESIGN: every longer evaluation split a shipped experiment uses can be
    produced from what training shows."""
    datasets = _shipped_datasets()
    names = {name for name, _ in datasets}
    assert {"reverse_digits", "duplicate_digits", "numbers"} <= names
    assert {"scan/length_cutoff26", "scan/length"} <= names  # experiments/scan.py
    for name, tokenizer in sorted(datasets):
        task = data.load(name, data_dir=data_dir, tokenizer=tokenizer)
        result = producibility.check(task, ["test_longer"])
        assert result["test_longer"]["producible"] == 1.0, (name, result)
        assert result["test_longer"]["examples"] >= 1_000, name
