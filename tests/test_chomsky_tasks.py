"""Delétang et al. (2023)'s 15 tasks (`jattn.data.chomsky`).

Contracts: every task's rule, written here independently of the generators
and checked on hand-worked examples (the paper's where it gives them); every
generated example is what its rule gives; split lengths (train 1-40 with
every length equally often, ``test_longer`` 41-500); defaults with 1,000+
examples per evaluation split; a task built through its real tfds builder
whose ``test_longer`` is producible from training; and an unknown task name
is a one-line error naming the registered ones.
"""

import math
import pathlib
import re

import numpy as np
import pytest

from jattn import data
from jattn.data import chomsky, chomsky_tasks, producibility, registry, tasks

ROOT = pathlib.Path(__file__).resolve().parent.parent
CYCLE = {"-": -1, "0": 0, "+": 1}


def _pad(answer: str, width: int) -> str:
    assert len(answer) <= width
    return answer + "0" * (width - len(answer))


def _eval_mod5(expression: str, alphabet: str) -> int:
    assert set(expression) <= set(alphabet), expression
    return eval(expression) % 5  # noqa: S307 - digits, operators and brackets only (checked)


def _stack(s: str) -> str:
    m = re.fullmatch(r"([01]+)([pab]*)", s)
    assert m, s
    stack = list(m.group(1))
    for action in m.group(2):
        if action == "p":
            stack = stack[:-1]
        else:
            stack.append({"a": "0", "b": "1"}[action])
    return _pad("".join(stack[::-1]) + "2", len(s) + 1)


def _solve(s: str) -> str:
    if len(s) < 3:
        assert s == "0" * len(s)
        return "0"
    lhs, rhs = s.split("=")
    assert lhs.count("x") == 1 and "*" not in lhs and len(rhs) == 1
    roots = [d for d in "01234" if _eval_mod5(lhs.replace("x", d), "01234+-()") == int(rhs)]
    assert len(roots) == 1, s
    return roots[0]


def _missing(s: str) -> str:
    if len(s) == 1:
        return "1"
    body = s[:-1] if len(s) % 2 else s
    assert s.count("2") == 1 and (len(s) % 2 == 0 or s[-1] == "3")
    half = len(body) // 2
    first, second = body[:half], body[half:]
    i = body.index("2") % half
    return second[i] if "2" in first else first[i]


def _little_endian_int(bits: str) -> int:
    assert bits and set(bits) <= {"0", "1"}
    return int(bits[::-1], 2)


def _binary(s: str, op: str) -> str:
    n = len(s)
    if op not in s:  # the paper's placeholder for 1-2 tokens: one number
        assert n <= 2
        value = _little_endian_int(s)
        answer = bin(value)[2:][::-1] if op == "+" else "0" * (n - 1)
    else:
        a, b = (_little_endian_int(x) for x in s.split(op))
        assert a > 0 and b > 0
        answer = bin(a + b if op == "+" else a * b)[2:][::-1]
    return _pad(answer + "2", n + 1 if op == "+" else n)


def _sqrt(s: str) -> str:
    n = int(s, 2)
    assert n > 0
    lo, hi = 0, n  # bisection: the largest r with r * r <= n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if mid * mid <= n else (lo, mid - 1)
    return bin(lo)[2:].zfill(math.ceil(len(s) / 2))


def _bits(s: str) -> str:
    assert set(s) <= {"0", "1"}
    return s


# Each task's rule, independent of the generators: input -> correct target.
RULES = {
    "even_pairs": lambda s: str(int(_bits(s)[0] != s[-1])),  # transitions odd iff ends differ
    "parity_check": lambda s: str(_bits(s).count("1") % 2),
    "cycle_navigation": lambda s: str(sum(CYCLE[c] for c in s) % 5),
    "modular_arithmetic": lambda s: str(_eval_mod5(s, "01234+-*")),
    "stack_manipulation": _stack,
    "reverse_string": lambda s: _bits(s)[::-1],
    "modular_arithmetic_brackets": lambda s: str(_eval_mod5(s, "01234+-*()")),
    "solve_equation": _solve,
    "duplicate_string": lambda s: _bits(s) * 2,
    "missing_duplicate_string": _missing,
    "odds_first": lambda s: (
        "".join(_bits(s)[i] for i in range(1, len(s), 2))
        + "".join(s[i] for i in range(0, len(s), 2))
    ),
    "binary_addition": lambda s: _binary(s, "+"),
    "binary_multiplication": lambda s: _binary(s, "*"),
    "compute_sqrt": _sqrt,
    "bucket_sort": lambda s: "".join(sorted(s)),
}

# Worked by hand (the paper's docstring examples where it has them).
HAND = {
    "even_pairs": [("001110", "0"), ("0101001", "1"), ("1", "0")],
    "parity_check": [("1010100", "1"), ("01111", "0")],
    "cycle_navigation": [("+-0--", "3"), ("+++-", "2"), ("-", "4")],
    "modular_arithmetic": [("1+2*3", "2"), ("1-1-1", "4"), ("0*1+4*3-2", "0")],
    "stack_manipulation": [("0110bpp", "11020000"), ("110ppp", "2000000"), ("1", "12")],
    "reverse_string": [("011010", "010110")],
    "modular_arithmetic_brackets": [("(-2)", "3"), ("(1-(3*4))", "4"), ("((2+3)*(4-1))", "0")],
    "solve_equation": [("(x-2)=3", "0"), ("((1+x)-(-3))=1", "2"), ("00", "0")],
    "duplicate_string": [("101", "101101")],
    "missing_duplicate_string": [("01100210", "1"), ("1011213", "0"), ("1", "1")],
    "odds_first": [("00110101", "01110100"), ("110", "110")],
    "binary_addition": [("001+01101", "0101120000"), ("1001+000001", "100101200000")],
    "binary_multiplication": [("001*01101", "000110120"), ("1001*000001", "00000100120")],
    "compute_sqrt": [("100101", "110"), ("111", "10")],
    "bucket_sort": [("10204112", "00111224")],
}

SMALL = chomsky.ChomskyConfig(name="t", num_train=120, num_validation=40, num_test_longer=46)


@pytest.fixture(scope="module")
def small_splits():
    return {task: chomsky.chomsky_splits(task, SMALL) for task in chomsky.TASKS}


def test_the_15_tasks_are_registered_by_level():
    assert set(RULES) == set(chomsky.TASKS) == set(HAND)
    levels = [chomsky.LEVELS[t] for t in chomsky.TASKS]
    assert (levels.count("regular"), levels.count("dcf"), levels.count("cs")) == (4, 4, 7)
    for task in chomsky.TASKS:
        cls, default = registry.BUILDERS[task]
        assert default == "default" and cls is chomsky.BUILDERS[task][0]
        assert tasks.task_metrics(task) == tasks.CHAR_METRICS
        # The docstring cites its source and says what a correct output is.
        assert f"tasks/{chomsky.LEVELS[task]}/{task}.py" in cls.__doc__
        doc = " ".join(cls.__doc__.split())
        assert "Correct output" in doc and "1-40" in doc and "41-500" in doc
    # No module's table shadows another's.
    tables = [registry.builders.BUILDERS, registry.kazemnejad.BUILDERS, registry.scan.BUILDERS]
    assert len(registry.BUILDERS) == sum(map(len, tables)) + len(chomsky.BUILDERS)


@pytest.mark.parametrize("task", sorted(HAND))
def test_rule_on_hand_worked_examples(task):
    for inputs, target in HAND[task]:
        assert RULES[task](inputs) == target, (task, inputs)


@pytest.mark.parametrize("task", chomsky.TASKS)
def test_every_generated_output_follows_the_rule(task, small_splits):
    for split, examples in small_splits[task].items():
        for _, ex in examples:
            assert RULES[task](ex["inputs"]) == ex["targets"], (split, ex)


@pytest.mark.parametrize("task", chomsky.TASKS)
def test_split_lengths(task, small_splits):
    """Train and validation use every length of 1-40 equally often (the
    modular arithmetic without brackets rounds even lengths down), and
    test_longer lies in 41-500."""
    splits = small_splits[task]
    for split, lo, hi in (("train", 1, 40), ("validation", 1, 40), ("test_longer", 41, 500)):
        lengths = [len(ex["inputs"]) for _, ex in splits[split]]
        if task == "modular_arithmetic":
            assert all(n % 2 for n in lengths)
        assert lo <= min(lengths) and max(lengths) <= hi, (split, min(lengths), max(lengths))
    train = [len(ex["inputs"]) for _, ex in splits["train"]]
    if task != "modular_arithmetic":
        assert sorted(set(train)) == list(range(1, 41))
        assert {train.count(n) for n in range(1, 41)} == {3}  # 120 = 3 x 40
    assert len(splits["test_longer"]) == 46


def test_split_lengths_are_even_and_random():
    rng = np.random.default_rng(0)
    lengths = chomsky.split_lengths(rng, 1_380, (41, 500)).tolist()
    assert sorted(set(lengths)) == list(range(41, 501))
    assert {lengths.count(n) for n in range(41, 501)} == {3}
    assert lengths != sorted(lengths)


def test_splits_are_a_pure_function_of_the_config_with_a_stream_per_split():
    a = chomsky.chomsky_splits("bucket_sort", SMALL)
    assert chomsky.chomsky_splits("bucket_sort", SMALL) == a
    other_seed = chomsky.ChomskyConfig(name="t", num_train=120, num_validation=40, seed=1)
    assert chomsky.chomsky_splits("bucket_sort", other_seed)["train"] != a["train"]
    shorter_test = chomsky.ChomskyConfig(
        name="t", num_train=120, num_validation=40, test_lengths=(41, 50)
    )
    b = chomsky.chomsky_splits("bucket_sort", shorter_test)
    assert b["train"] == a["train"] and b["validation"] == a["validation"]
    assert max(len(ex["inputs"]) for _, ex in b["test_longer"]) <= 50
    with pytest.raises(ValueError, match="test_lengths"):
        chomsky.chomsky_splits(
            "bucket_sort", chomsky.ChomskyConfig(name="t", test_lengths=(40, 60))
        )
    with pytest.raises(ValueError, match="unknown Chomsky task 'sort'.*bucket_sort"):
        chomsky.chomsky_splits("sort", SMALL)


def test_default_configs_have_the_papers_lengths_and_1000_eval_examples():
    by_name = {c.name: c for c in chomsky.CONFIGS}
    default = by_name["default"]
    assert default.train_lengths == (1, 40) and default.test_lengths == (41, 500)
    assert by_name["test100"].test_lengths == (41, 100)
    for name in ("default", "test100"):
        assert by_name[name].num_validation >= 1_000 and by_name[name].num_test_longer >= 1_000
        span = by_name[name].test_lengths[1] - by_name[name].test_lengths[0] + 1
        assert by_name[name].num_test_longer % span == 0  # every test length equally often


def test_scored_length_is_the_papers_accuracy_mask():
    assert chomsky_tasks.scored_length("binary_addition", "0101120000") == 6
    assert chomsky_tasks.scored_length("stack_manipulation", "2000000") == 1
    assert chomsky_tasks.scored_length("binary_multiplication", "02") == 2
    assert chomsky_tasks.scored_length("reverse_string", "0122") == 4
    assert chomsky_tasks.scored_length("parity_check", "1") == 1
    with pytest.raises(ValueError, match="terminator"):
        chomsky_tasks.scored_length("binary_addition", "0101")


@pytest.mark.parametrize("task", chomsky.TASKS)
def test_target_tokens_is_a_function_of_the_input_length(task):
    """What `jattn decode` tells an encoder-only model: the target length
    (EOS included) at an input length, the same for every draw of it."""
    for length in (1, 2, 3, 7, 40, 41, 97):
        seen = {
            len(chomsky_tasks.GENERATORS[task](np.random.default_rng(s), length)[1])
            for s in range(6)
        }
        assert seen == {chomsky_tasks.target_tokens(task, length) - 1}, (length, seen)
    assert chomsky_tasks.target_tokens("reverse_string", 5) == 6
    assert chomsky_tasks.target_tokens("parity_check", 40) == 2
    with pytest.raises(ValueError, match="at least one symbol"):
        chomsky_tasks.target_tokens(task, 0)
    with pytest.raises(ValueError, match="unknown Chomsky task"):
        chomsky_tasks.target_tokens("reverse", 3)


@pytest.fixture(scope="module")
def built(data_dir):
    return {
        name: data.load(f"{name}/tiny", data_dir=data_dir)
        for name in ("binary_addition", "parity_check")
    }


@pytest.mark.parametrize("task", ["binary_addition", "parity_check"])
def test_builds_through_tfds_with_a_producible_test_split(built, task):
    loaded = built[task]
    assert loaded.splits == ("train", "validation", "test_longer")
    assert loaded.full_name == f"jattn_chomsky_{task}/tiny/1.0.0"
    sizes = tuple(len(loaded.source(s)) for s in loaded.splits)
    assert sizes == (600, 50, 50)
    want = chomsky.chomsky_splits(task, next(c for c in chomsky.CONFIGS if c.name == "tiny"))
    for split in loaded.splits:  # tfds stores the examples in its own (shuffled) order
        got = sorted((ex["inputs"], ex["targets"]) for ex in loaded.source(split))
        assert got == sorted((ex["inputs"], ex["targets"]) for _, ex in want[split])
    # PAD, EOS, UNK, then the paper's symbols: 0 1 (+ 2 for addition).
    assert loaded.tokenizer.vocab_size == (3 + 4 if task == "binary_addition" else 3 + 2)
    result = producibility.check(loaded, ["validation", "test_longer"])
    assert result["test_longer"]["producible"] == 1.0
    longer = 1.0 if task == "binary_addition" else 0.0  # a class is one token at any length
    assert result["test_longer"]["longer_than_train"] == longer
    assert producibility.warnings(result) == []


def test_unknown_task_name_is_one_line_naming_the_registered_ones(data_dir):
    with pytest.raises(ValueError) as e:
        data.load("parity_checks", data_dir=data_dir)
    message = str(e.value)
    assert "\n" not in message and "'parity_checks'" in message
    assert all(name in message for name in (*chomsky.TASKS, "kz_copy_rsc", "copy"))


def test_config_picks_the_task_and_sizes_rows_to_its_splits():
    from jattn.train.config import ConfigError, check_config, load_config  # noqa: PLC0415

    c = load_config(f"{ROOT}/configs/chomsky.py:duplicate_string,rope")
    check_config(c)
    assert c.dataset == "duplicate_string/default" and c.model.position == "rope"
    assert (c.max_input_len, c.max_len) == (41, 81)  # 40 bits + EOS, 80 bits + EOS
    assert (c.eval_max_input_len, c.eval_max_len) == (501, 1001)
    assert c.model.max_len >= c.eval_max_input_len + c.eval_max_len
    assert c.eval_decode_examples >= 1_000 and c.eval_max_batches == 0
    c = load_config(f"{ROOT}/configs/chomsky.py:parity_check,test100")
    assert c.dataset == "parity_check/test100" and c.max_len == c.eval_max_len == 2
    for bad in ("", "parity", "parity_check,even_pairs"):
        with pytest.raises(ConfigError, match="parity_check") as e:
            load_config(f"{ROOT}/configs/chomsky.py:{bad}")
        assert "\n" not in str(e.value)
