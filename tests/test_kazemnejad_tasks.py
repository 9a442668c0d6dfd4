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


# -- copy with repeated tokens (their make_copy_dataset.py: rsc, rsc2x, rdc) -------------

REPEAT = {"kz_copy_rsc": "rsc", "kz_copy_rsc2x": "rsc2x", "kz_copy_rdc": "rdc"}


def repeat_rule(variant: str, inputs: str) -> tuple[int, str]:
    """(n, the correct target) of a repeated-token input, written from their definitions."""
    if variant == "rdc":  # "Replace a with b in a a a" -> "b b b"
        a, arrow, b, colon, body = inputs[0], inputs[1], inputs[2], inputs[3], inputs[4:]
        assert (arrow, colon) == (">", ":") and a != b and body == a * len(body)
        return len(body), b * len(body)
    assert len(set(inputs)) == 1 and inputs[0] not in ">:"
    return len(inputs), inputs * (2 if variant == "rsc2x" else 1)


def test_repeat_rule_by_hand():
    assert repeat_rule("rsc", "kkk") == (3, "kkk")
    assert repeat_rule("rsc2x", "77") == (2, "7777")
    assert repeat_rule("rdc", "6>Z:666") == (3, "ZZZ")
    with pytest.raises(AssertionError):
        repeat_rule("rsc", "kkj")


@pytest.fixture(scope="module")
def repeat_default_splits():
    (config,) = [c for c in kazemnejad.REPEAT_CONFIGS if c.name == "default"]
    return {v: kazemnejad.repeat_splits(config, v) for v in kazemnejad.REPEAT_TASKS}


@pytest.mark.parametrize("variant", ["rsc", "rsc2x", "rdc"])
def test_repeat_splits_follow_their_definition(repeat_default_splits, variant):
    """Every example follows the rule; train and validation hold every example
    of each length 1-20 (rsc: all 500 tokens; rdc: all 22 x 21 ordered pairs)
    once, split 1,000 for validation; test_longer has 50 of each length 21-40,
    distinct, made of tokens training shows."""
    splits = repeat_default_splits[variant]
    assert (len(splits["validation"]), len(splits["test_longer"])) == (1_000, 1_000)
    by_length: dict[int, set[str]] = {}
    train_tokens = set()
    for split in ("train", "validation"):
        for _, ex in splits[split]:
            n, target = repeat_rule(variant, ex["inputs"])
            assert ex["targets"] == target and 1 <= n <= 20
            by_length.setdefault(n, set()).add(ex["inputs"])
            if split == "train":
                train_tokens |= set(target)
    per_length = 500 if variant != "rdc" else 22 * 21
    assert sorted(by_length) == list(range(1, 21))
    assert {len(v) for v in by_length.values()} == {per_length}
    assert len(splits["train"]) + 1_000 == 20 * per_length  # each example once
    test_lengths = []
    for _, ex in splits["test_longer"]:
        n, target = repeat_rule(variant, ex["inputs"])
        assert ex["targets"] == target and 21 <= n <= 40 and set(target) <= train_tokens
        test_lengths.append(n)
    assert {test_lengths.count(n) for n in range(21, 41)} == {50}
    assert len({ex["inputs"] for _, ex in splits["test_longer"]}) == 1_000
    # The token list: digits and letters first, as their T5 pieces, then one character each.
    assert kazemnejad.repeat_alphabet(64)[:12] == "0123456789ab"
    assert len(set(kazemnejad.repeat_alphabet(500))) == 500


def test_repeat_splits_are_pure_and_check_their_sizes():
    (tiny,) = [c for c in kazemnejad.REPEAT_CONFIGS if c.name == "tiny"]
    assert kazemnejad.repeat_splits(tiny, "rdc") == kazemnejad.repeat_splits(tiny, "rdc")
    with pytest.raises(ValueError, match="unknown repeated-token variant 'rsd'"):
        kazemnejad.repeat_splits(tiny, "rsd")
    too_many = kazemnejad.RepeatConfig(
        name="t", examples_per_length=2, num_validation=10, num_test_longer=100
    )
    with pytest.raises(ValueError, match="5 examples of length 21 asked of 2"):
        kazemnejad.repeat_splits(too_many, "rsc")
    no_train = kazemnejad.RepeatConfig(name="t", examples_per_length=2, num_validation=40)
    with pytest.raises(ValueError, match="leaves no training example"):
        kazemnejad.repeat_splits(no_train, "rsc")


def test_a_repeat_variant_builds_through_tfds_producibly(data_dir):
    task = data.load("kz_copy_rsc2x/tiny", data_dir=data_dir)
    assert task.full_name == "jattn_kz_copy_rsc2x/tiny/1.0.0"
    assert task.metrics == ("exact_match", "chrf")
    assert tuple(len(task.source(s)) for s in task.splits) == (550, 50, 40)
    for split in task.splits:
        for ex in task.source(split):
            assert ex["targets"] == repeat_rule("rsc2x", ex["inputs"])[1]
    result = producibility.check(task, ["validation", "test_longer"])
    assert result["test_longer"]["producible"] == 1.0
    assert result["test_longer"]["longer_than_train"] == 1.0
