"""SCAN (Lake and Baroni 2018) from its grammar: the command set, the
interpretation rules and the length splits, counted against the papers.

Contracts: the generator yields the paper's 20,910 commands, each once; the
interpretation of hand-worked commands is the paper's; the length split has
the paper's sizes (16,990 train, 3,920 test, 24-48 actions) and Csordás et
al.'s cutoff-26 re-split its definition (90/10 of <= 26 actions, all longer
ones in test); every longer split can be produced from training's actions.
"""

import collections
import json

import pytest

from jattn import data
from jattn.data import producibility, scan


def actions(target: str) -> int:
    return len(target.split(" "))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def test_the_grammar_has_the_papers_20910_commands_each_once():
    commands = scan.commands()
    assert len(commands) == 20_910 == scan.NUM_COMMANDS
    assert len(set(commands)) == len(commands)
    # The 13 command words of the paper's grammar, and nothing else.
    words = {w for c in commands for w in c.split(" ")}
    assert words == {
        "walk", "look", "run", "jump", "turn", "left", "right",
        "opposite", "around", "twice", "thrice", "and", "after",
    }  # fmt: skip
    # A single phrase is one of 34 verb phrases, alone or repeated: 102 in all.
    assert sum(" and " not in c and " after " not in c for c in commands) == 102
    assert "turn" not in commands and "turn twice" not in commands


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        # Worked by hand from the appendix's interpretation rules.
        ("jump twice after walk left", "LTURN WALK JUMP JUMP"),
        ("walk", "WALK"),
        ("turn left", "LTURN"),
        ("run right twice", "RTURN RUN RTURN RUN"),
        ("look opposite left", "LTURN LTURN LOOK"),
        ("turn opposite right thrice", "RTURN RTURN RTURN RTURN RTURN RTURN"),
        ("turn around left", "LTURN LTURN LTURN LTURN"),
        ("jump around right", "RTURN JUMP RTURN JUMP RTURN JUMP RTURN JUMP"),
        ("walk and look left", "WALK LTURN LOOK"),
        ("walk after look left", "LTURN LOOK WALK"),
        ("run twice and jump opposite left", "RUN RUN LTURN LTURN JUMP"),
    ],
)
def test_interpretation_of_hand_worked_commands(command, expected):
    assert scan.interpret(command) == expected


def test_interpret_refuses_what_the_grammar_does_not_make():
    for bad in ("turn", "walk twice twice", "jump opposite", "fly", "", "walk around"):
        with pytest.raises(ValueError, match="SCAN"):
            scan.interpret(bad)


def test_length_split_has_the_papers_sizes_and_lengths():
    (config,) = [c for c in scan.JattnScan.BUILDER_CONFIGS if c.name == "length"]
    splits = scan.length_splits(config)
    train = [ex for _, ex in splits["train"]]
    test = [ex for _, ex in splits["test_longer"]]
    # Lake and Baroni (2018), experiment 2: 16,990 training and 3,920 test commands.
    assert (len(train), len(test)) == (16_990, 3_920)
    assert {k: len(splits[k]) for k in scan.LENGTH_SPLIT_SIZES} == scan.LENGTH_SPLIT_SIZES
    assert max(actions(ex["targets"]) for ex in train) == 22
    assert {actions(ex["targets"]) for ex in test} <= set(range(24, 49))
    assert min(actions(ex["targets"]) for ex in test) == 24
    assert max(actions(ex["targets"]) for ex in test) == 48
    assert {ex["inputs"] for ex in train} | {ex["inputs"] for ex in test} == set(scan.commands())
    # Validation: 1,000 of the training commands (the paper holds none out).
    val = {ex["inputs"] for _, ex in splits["validation"]}
    assert len(val) == 1_000 and val <= {ex["inputs"] for ex in train}
    for ex in train + test:
        assert ex["targets"] == scan.interpret(ex["inputs"])


def test_cutoff26_is_csordas_et_als_resplit():
    (config,) = [c for c in scan.JattnScan.BUILDER_CONFIGS if c.name == "length_cutoff26"]
    splits = scan.length_splits(config)
    train, val, test = ([ex for _, ex in splits[s]] for s in ("train", "validation", "test_longer"))
    by_length = collections.Counter(actions(scan.interpret(c)) for c in scan.commands())
    short = sum(n for k, n in by_length.items() if k <= 26)
    longer = sum(n for k, n in by_length.items() if k > 26)
    assert (short, longer) == (18_286, 2_624)
    # Their code: int(n * (1 - 0.9)) of the short commands held out, the rest trained on.
    assert len(val) == int(short * (1 - 0.9)) == 1_828
    assert len(train) == short - len(val) == 16_458
    assert len(test) == longer
    assert {k: len(splits[k]) for k in scan.CUTOFF26_SIZES} == scan.CUTOFF26_SIZES
    assert max(actions(ex["targets"]) for ex in train + val) == 26
    assert min(actions(ex["targets"]) for ex in test) == 27
    train_in, val_in = {ex["inputs"] for ex in train}, {ex["inputs"] for ex in val}
    assert not train_in & val_in
    assert len(val) >= 1_000 and len(test) >= 1_000  # the floor per eval split
    assert scan.length_splits(config) == splits  # a pure function of the config


def test_scan_loads_with_the_word_tokenizer(data_dir):
    task = data.load("scan/tiny", data_dir=data_dir, tokenizer="word")
    assert task.splits == ("train", "validation", "test_longer")
    assert task.metrics == ("exact_match",)
    tok = task.tokenizer
    # PAD, EOS, UNK, 13 command words and 6 actions (training shows them all).
    assert tok.vocab_size == 3 + 13 + 6
    ex = task.source("test_longer")[0]
    ids = tok.encode(ex["targets"])
    assert len(ids) == actions(ex["targets"]) + 1  # one id per action, then EOS
    assert tok.decode(ids) == ex["targets"]
    for ex in task.source("train"):
        assert ex["targets"] == scan.interpret(ex["inputs"])


@pytest.mark.parametrize("config", ["length", "length_cutoff26"])
def test_scan_test_longer_is_fully_producible(data_dir, config):
    task = data.load(f"scan/{config}", data_dir=data_dir, tokenizer="word")
    result = producibility.check(task, ["validation", "test_longer"])
    assert result["test_longer"]["producible"] == 1.0
    assert result["test_longer"]["longer_than_train"] == 1.0
    assert result["validation"]["longer_than_train"] == 0.0
    cutoff = 22 if config == "length" else 26
    assert result["train"]["max_target_tokens"] == cutoff + 1  # EOS
    assert result["test_longer"]["max_target_tokens"] == 48 + 1
    assert producibility.warnings(result) == []


def test_word_tokenizer_round_trip_and_run_copy(tmp_path):
    from jattn.data import tokenizers  # noqa: PLC0415

    tok = tokenizers.WordTokenizer.train(["walk left", "LTURN WALK"])
    assert tok.words == ("LTURN", "WALK", "left", "walk")  # sorted
    assert tok.encode("walk left") == [6, 5, tokenizers.EOS_ID]
    assert tok.encode("fly") == [tokenizers.UNK_ID, tokenizers.EOS_ID]
    assert tok.decode([3, 4, tokenizers.EOS_ID, 3]) == "LTURN WALK"
    tokenizers.save_to_dir(tok, str(tmp_path))
    again = tokenizers.load_from_dir(str(tmp_path))
    assert isinstance(again, tokenizers.WordTokenizer) and again.words == tok.words
    assert tokenizers.vocab_hash(again) == tokenizers.vocab_hash(tok)
    other = tokenizers.WordTokenizer(("WALK", "LTURN", "left", "walk"))
    assert tokenizers.vocab_hash(other) != tokenizers.vocab_hash(tok)
    with pytest.raises(ValueError, match="distinct"):
        tokenizers.WordTokenizer(("a b",))


@pytest.mark.slow
def test_scan_experiment_tiny_runs_and_reports_as_the_anchors(tmp_path):
    """experiments/scan.py:tiny trains its two schemes on scan/tiny and its
    report has the anchors' section: best of seeds, beyond-training teacher-forced
    accuracy, exact match by action-sequence length beyond the cutoff of 26."""
    import pathlib  # noqa: PLC0415

    from jattn.analysis import main_ablate  # noqa: PLC0415

    root = pathlib.Path(__file__).resolve().parent.parent
    spec = str(root / "experiments" / "scan.py") + ":tiny"
    workdir = tmp_path / "scan"
    assert main_ablate(spec, str(workdir), [], emit_fmt=None, report_only=False,
                       repo_root=str(root)) == 0  # fmt: skip
    md = (workdir / "results.md").read_text()
    assert "| position=t5 | 1 |" in md and "| position=sinusoidal | 1 |" in md
    assert "## As the anchors report" in md
    assert "eval/test_longer/beyond_train/accuracy best" in md
    assert "eval/test_longer/beyond_train/length_avg_accuracy best" in md
    assert "27-31 †" in md  # the first bucket beyond 26 actions
    check = json.loads((workdir / "runs" / "position-t5_seed-0" / "data_check.json").read_text())
    assert check["test_longer"]["producible"] == 1.0
    assert check["train"]["max_target_tokens"] <= 27


@pytest.mark.parametrize(("preset", "dataset", "longest_split"), [
    ("", "scan/length_cutoff26", 2_624), ("length22", "scan/length", 3_920)])  # fmt: skip
def test_scan_grid_rows_hold_every_example_and_decode_all(preset, dataset, longest_split):
    """Every run of experiments/scan.py trains on rows that hold the longest training
    example, and evaluates and decodes every example of both splits (none dropped)."""
    import pathlib  # noqa: PLC0415

    from jattn.analysis import grid  # noqa: PLC0415
    from jattn.train.config import load_config  # noqa: PLC0415

    root = pathlib.Path(__file__).resolve().parent.parent
    spec = str(root / "experiments" / "scan.py") + (f":{preset}" if preset else "")
    exp = load_config(spec)
    runs = grid.expand(exp, "/nonexistent")
    assert len(runs) == 6 * 3
    for run in runs:
        config = grid.training_config(exp, run, str(root))
        assert config.dataset == dataset and config.tokenizer == "word"
        assert config.max_input_len >= 9 + 1 and config.max_len >= 26 + 1  # EOS
        assert config.eval_max_input_len >= 9 + 1 and config.eval_max_len >= 48 + 1
        assert config.eval_max_batches * config.eval_batch_size >= longest_split
        assert config.eval_decode_examples >= longest_split
        assert config.best_metric == ""  # the last step, nothing selected on validation


def test_the_csordas_preset_is_their_model_and_variants():
    """experiments/scan.py:csordas: Csordás et al.'s model (3+3 layers, width 128, 8
    heads, feed-forward 256, dropout 0.5, learning rate 1e-3; docs/results/anchors.json) with
    their relative variant and shared layers against absolute positions, 3 seeds,
    every example of both splits decoded, nothing selected on validation."""
    import pathlib  # noqa: PLC0415

    from anchor_data import record  # noqa: PLC0415

    from jattn.analysis import grid  # noqa: PLC0415
    from jattn.train.config import load_config  # noqa: PLC0415

    csordas = record("csordas2021")
    root = pathlib.Path(__file__).resolve().parent.parent
    exp = load_config(str(root / "experiments" / "scan.py") + ":csordas")
    runs = grid.expand(exp, "/nonexistent")
    seen = set()
    for run in runs:
        c = grid.training_config(exp, run, str(root))
        m = c.model
        assert (m.num_layers, m.d_model, m.num_heads, m.d_ff, m.dropout_rate) == (
            3, csordas.setup["width"].value, csordas.setup["heads"].value,
            csordas.setup["feed_forward"].value, csordas.setup["dropout"].value,
        )  # fmt: skip
        assert c.learning_rate == csordas.setup["learning_rate"].value
        assert c.dataset == "scan/length_cutoff26" and c.best_metric == ""
        assert c.eval_decode_examples >= 2_624 and c.eval_max_batches * c.eval_batch_size >= 2_624
        seen.add((m.position, m.shared_layers, c.seed))
    assert seen == {
        (p, shared, seed)
        for p in ("sinusoidal", "transformer_xl")
        for shared in (False, True)
        for seed in (0, 1, 2)
    }


def test_the_csordas_long_preset_is_the_same_model_at_3x_the_steps():
    """experiments/scan.py:csordas_long: the csordas preset's model and evaluation,
    their relative variant against sinusoidal positions, one seed, no shared layers,
    3x the steps, both splits evaluated along the way, checkpoints to resume from."""
    import pathlib  # noqa: PLC0415

    from jattn.analysis import grid  # noqa: PLC0415
    from jattn.train.config import load_config  # noqa: PLC0415

    root = pathlib.Path(__file__).resolve().parent.parent
    spec = str(root / "experiments" / "scan.py")
    short, long = (load_config(f"{spec}:{arg}") for arg in ("csordas", "csordas_long"))
    base = grid.training_config(short, grid.expand(short, "/nonexistent")[0], str(root))
    runs = grid.expand(long, "/nonexistent")
    configs = [grid.training_config(long, run, str(root)) for run in runs]
    assert sorted((c.model.position, c.model.shared_layers, c.seed) for c in configs) == [
        ("sinusoidal", False, 0),
        ("transformer_xl", False, 0),
    ]
    for c in configs:
        assert c.num_train_steps == 3 * base.num_train_steps
        assert c.eval_every_steps == c.num_train_steps // 3 == c.checkpoint_every_steps
        for key in ("num_layers", "d_model", "num_heads", "d_ff", "dropout_rate"):
            assert c.model[key] == base.model[key], key
        for key in ("dataset", "batch_size", "learning_rate", "eval_decode_examples",
                    "eval_max_batches", "best_metric"):  # fmt: skip
            assert c[key] == base[key], key


def test_scan_refuses_a_character_tokenizer(data_dir):
    with pytest.raises(ValueError, match="tokenizer='word'"):
        data.load("scan/tiny", data_dir=data_dir)  # the default is "char"
