"""What each published comparison jattn holds itself against says, as data.

One `AnchorRecord` per paper: the paper, its setup and its own numbers per
scheme and task, each fact with where it was read (a table or figure of the
paper, or a file of the authors' repository). The README's comparison table
and docs/results.md quote these records, and a test checks every anchor
number there against them, so no verdict can rest on a number nobody read.

Why data: prose drifted (a median called a mean, a paper's aggregate over
tasks held against one task). A fact not read here has ``value=None`` and a
``reason``, and nothing may claim agreement with it.

What was read: the papers' pages only from their beginning (abstract,
introduction), so every table number is ``None``; the authors' repositories
at the commits the module's sources name (see the constants below). A setup
read from an example script is that script's default, and says so.
"""

from __future__ import annotations

import dataclasses
import re
import statistics

__all__ = [
    "RECORDS",
    "SETUP_KEYS",
    "AnchorRecord",
    "Fact",
    "Finding",
    "findings",
    "mean_over_seeds",
    "numbers",
    "record",
]

# The setup every record states (a fact may be unread: value None, reason given).
SETUP_KEYS = (
    "architecture",
    "layers",
    "width",
    "heads",
    "steps",
    "batch",
    "seeds",
    "train_lengths",
    "test_lengths",
    "metric",
    "checkpoint",
)


@dataclasses.dataclass(frozen=True)
class Fact:
    """One fact and where it was read; ``value=None`` means not read here (`reason` says why)."""

    value: float | str | None
    source: str
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One of the paper's numbers: a statistic of one scheme on one task."""

    task: str
    scheme: str
    statistic: str  # e.g. "exact match, seed 146317" or "mean reciprocal rank"
    value: float | None
    source: str
    reason: str = ""  # why value is None


@dataclasses.dataclass(frozen=True)
class AnchorRecord:
    """A paper, its setup (`SETUP_KEYS` and more) and its numbers jattn compares against."""

    key: str
    title: str
    authors: str
    year: int
    arxiv: str
    setup: dict[str, Fact]
    findings: tuple[Finding, ...]
    claims: tuple[Fact, ...] = ()  # the paper's words, e.g. its abstract's finding


# -- Ontañón et al. 2022 ---------------------------------------------------------------

_NB = "google-research/google-research compositional_transformers/seq2seq.ipynb"  # 30adf0e
_ONTANON_TABLES = "paper's tables not readable here (only its first page could be read)"

ONTANON = AnchorRecord(
    key="ontanon2022",
    title="Making Transformers Solve Compositional Tasks",
    authors="Ontañón, Ainslie, Cvicek, Fisher",
    year=2022,
    arxiv="2108.04378",
    setup={
        "architecture": Fact(
            "encoder-decoder Transformer", f"{_NB}, run_evaluation (Transformer(num_layers, ...))"
        ),
        "layers": Fact(2, f"{_NB}, 'Systematic Experiments' models list (abs, rel-e, ...)"),
        "width": Fact(64, f"{_NB}, models list (d_model)"),
        "feed_forward": Fact(256, f"{_NB}, models list (dff)"),
        "heads": Fact(4, f"{_NB}, models list (num_heads)"),
        "relative_radius": Fact(16, f"{_NB}, run_evaluation (RELATIVE16*: relative_radius = 16)"),
        "dropout": Fact(0.1, f"{_NB}, run_evaluation (dropout_rate = 0.1)"),
        "train_examples": Fact(200_000, f"{_NB}, setup_dataset (reversing and duplication)"),
        "test_examples": Fact(1_024, f"{_NB}, setup_dataset (reversing and duplication)"),
        "batch": Fact(64, f"{_NB}, run_evaluation (batch_size=64)"),
        "epochs": Fact(
            "reversing 2, duplication 4", f"{_NB}, 'Systematic Experiments' datasets list"
        ),
        "steps": Fact(
            "reversing 6,250, duplication 12,500",
            f"derived from {_NB}: epochs x 200,000 // 64 (3,125 steps an epoch)",
        ),
        "seeds": Fact(5, f"{_NB}, 'Systematic Experiments' (num_repetitions = 5)"),
        "train_lengths": Fact("reversing 1-16 digits", f"{_NB}, create_reversing_dataset defaults"),
        "test_lengths": Fact("reversing 17-24 digits", f"{_NB}, create_reversing_dataset defaults"),
        "metric": Fact(
            "sequence accuracy: teacher-forced argmax, output cut after the first end token, "
            "equal to the reference",
            f"{_NB}, eval_step_detailed",
        ),
        "checkpoint": Fact(
            "the model after the last epoch; the mean over repetitions is reported",
            f"{_NB}, run_evaluation ('Average repetition metrics')",
        ),
        "learning_rate": Fact(
            "Noam schedule, warmup 4,000 steps, Adam (0.9, 0.98)",
            f"{_NB}, CustomSchedule and run_evaluation",
        ),
    },
    findings=tuple(
        Finding(task, scheme, "sequence accuracy on the test split", None, "paper", _ONTANON_TABLES)
        for task in ("reversing", "duplication")
        for scheme in ("abs", "rel-e", "rel-b", "rel-eb", "rel2-e", "rel2-b", "rel2-eb")
    ),
    claims=(
        Fact(
            "design decisions such as the position encodings, decoder type, model architecture "
            "and encoding of the target task give better or worse compositional generalization",
            "paper, abstract (research.google/pubs/pub52042)",
        ),
    ),
)

# -- Kazemnejad et al. 2023 --------------------------------------------------------------

_KZ = "McGill-NLP/length-generalization results/sanity_check.jsonl"  # at 40f8a44
_KZ_MRR = (
    "McGill-NLP/length-generalization notebooks/plot_aggregate_final.ipynb, "
    "cell 24 output (mrr, no scratchpad)"
)
_KZ_SEEDS = (146317, 234054, 256788)
# pred/test_acc_overall of the best_run_seed_exp runs, seeds in _KZ_SEEDS order.
_KZ_EXACT = {
    ("copy", "none"): (0.2896, 0.2944, 0.3322),
    ("copy", "sinusoidal"): (0.0227, 0.0322, 0.0283),
    ("copy", "rope"): (0.0032, 0.0133, 0.0177),
    ("copy", "alibi"): (0.3192, 0.344, 0.3299),
    ("copy", "t5"): (0.4154, 0.4082, 0.435),
    ("reverse", "none"): (0.236, 0.2355, 0.2187),
    ("reverse", "sinusoidal"): (0.018, 0.0148, 0.0363),
    ("reverse", "rope"): (0.0406, 0.1635, 0.028),
    ("reverse", "alibi"): (0.1654, 0.1632, 0.184),
    ("reverse", "t5"): (0.2298, 0.2686, 0.2284),
    # The copy variants with repeated tokens (jattn.data.kazemnejad's kz_copy_rsc,
    # kz_copy_rsc2x, kz_copy_rdc), where their ALiBi falls far below NoPE.
    ("copy_rsc", "none"): (0.9835, 0.9808, 0.9925),
    ("copy_rsc", "sinusoidal"): (0.0, 0.0, 0.0),
    ("copy_rsc", "rope"): (0.0006, 0.0, 0.0),
    ("copy_rsc", "alibi"): (0.279, 0.2655, 0.3234),
    ("copy_rsc", "t5"): (0.7423, 0.8321, 0.7393),
    ("copy_rsc2x", "none"): (0.9731, 0.9844, 0.9633),
    ("copy_rsc2x", "sinusoidal"): (0.0, 0.0, 0.0),
    ("copy_rsc2x", "rope"): (0.0, 0.0, 0.0),
    ("copy_rsc2x", "alibi"): (0.1676, 0.2733, 0.14),
    ("copy_rsc2x", "t5"): (0.7346, 0.4068, 0.5316),
    ("copy_rdc", "none"): (0.9895, 0.9474, 0.9647),
    ("copy_rdc", "sinusoidal"): (0.0, 0.0, 0.0),
    ("copy_rdc", "rope"): (0.0001, 0.0002, 0.0467),
    ("copy_rdc", "alibi"): (0.1922, 0.1326, 0.1844),
    ("copy_rdc", "t5"): (0.9692, 0.9268, 0.9211),
}
_KZ_SPLIT = {
    "copy": "s2s_copy cmc_tr20_ts40",
    "reverse": "s2s_reverse mc_tr20_ts40",
    "copy_rsc": "s2s_copy rsc_tr20_ts40",
    "copy_rsc2x": "s2s_copy rsc2x_tr20_ts40",
    "copy_rdc": "s2s_copy rdc_tr20_ts40",
}
_KZ_PE = {
    "none": "none",
    "sinusoidal": "abs_sinusoid",
    "rope": "rotary",
    "alibi": "alibi",
    "t5": "t5_relative_bias",
}
# Mean reciprocal rank over tasks and seeds (their aggregate), rows of the notebook's output.
_KZ_MRR_VALUES = {
    "none": 0.686928,
    "t5": 0.549020,
    "alibi": 0.502288,
    "rope": 0.329739,
    "sinusoidal": 0.215359,
}

KAZEMNEJAD = AnchorRecord(
    key="kazemnejad2023",
    title="The Impact of Positional Encoding on Length Generalization in Transformers",
    authors="Kazemnejad, Padhi, Natesan Ramamurthy, Das, Reddy",
    year=2023,
    arxiv="2305.19466",
    setup={
        "architecture": Fact(
            "decoder-only T5 (custom_decoder_only_t5 with the t5-base config, not pretrained)",
            f"{_KZ}, cfg__model.type, cfg__model.hf_model_name, cfg__model.from_pretrained",
        ),
        "parameters": Fact(
            "137,927,808 (sinusoidal: 150,510,720)", f"{_KZ}, sum__num_total_params"
        ),
        "layers": Fact(None, _KZ, "the t5-base config they load is not stored here"),
        "width": Fact(None, _KZ, "the t5-base config they load is not stored here"),
        "heads": Fact(None, _KZ, "the t5-base config they load is not stored here"),
        "steps": Fact(40_000, f"{_KZ}, cfg__trainer.max_steps"),
        "batch": Fact(64, f"{_KZ}, cfg__trainer.target_batch_size"),
        "learning_rate": Fact(
            "3e-05, polynomial decay, warmup ratio 0.06, weight decay 0.05",
            f"{_KZ}, cfg__trainer.*",
        ),
        "train_examples": Fact(100_000, f"{_KZ}, sum__num_train_samples"),
        "seeds": Fact(3, f"{_KZ}, job_type best_run_seed_exp: seeds 146317, 234054, 256788"),
        "train_lengths": Fact("1-20", f"{_KZ}, split names *_tr20_ts40"),
        "test_lengths": Fact("21-40", f"{_KZ}, sum__pred/test_acc_21 .. _40"),
        "test_examples": Fact(10_000, f"{_KZ}, sum__pred/test_num_samples"),
        "metric": Fact(
            "exact match of the greedy output (pred/test_acc_overall: share of test examples "
            "whose parsed prediction is correct; pred/test_seq_acc is a padded token-sequence "
            "accuracy that ignores extra output, not this)",
            "McGill-NLP/length-generalization src/analyzers/seq2seq_analyzer.py "
            "(log_accuracies_and_distances) and src/data/s2s_dl_factory.py",
        ),
        "checkpoint": Fact(
            "the best checkpoint by validation seq_acc, evaluated every 2,000 steps (e.g. RoPE "
            "on copy: checkpoint-6000 for every seed)",
            f"{_KZ}, cfg__trainer.metric_for_best_model, eval_steps, sum__predict_test_ckpt_path",
        ),
    },
    findings=tuple(
        Finding(
            task,
            scheme,
            f"exact match over lengths 21-40, seed {seed}",
            value,
            f"{_KZ}, split {_KZ_SPLIT[task]}, position_encoding_type {_KZ_PE[scheme]}, "
            f"seed {seed}, sum__pred/test_acc_overall",
        )
        for (task, scheme), values in _KZ_EXACT.items()
        for seed, value in zip(_KZ_SEEDS, values, strict=True)
    )
    + tuple(
        Finding("all tasks", scheme, "mean reciprocal rank", value, _KZ_MRR)
        for scheme, value in _KZ_MRR_VALUES.items()
    ),
    claims=(
        Fact(
            "NoPE outperforms the explicit position encodings; ALiBi, Rotary and APE are not "
            "well suited for length generalization in downstream tasks",
            "paper, abstract (ar5iv.org/html/2305.19466)",
        ),
    ),
)

# -- Ruoss et al. 2023 ---------------------------------------------------------------------

_RPE = "google-deepmind/randomized_positional_encodings"  # at e8c6474
_RPE_EX = f"{_RPE} experiments/example.py defaults (the paper's runs: not read here)"
_PAPER_SETUP = "paper's setup section not readable here (only its abstract and introduction)"
_TABLE_UNREAD = "table not readable here (only the paper's first page could be read)"
_RPE_PAGE = "ar5iv.labs.arxiv.org/html/2305.16843"

RUOSS = AnchorRecord(
    key="ruoss2023",
    title="Randomized Positional Encodings Boost Length Generalization of Transformers",
    authors="Ruoss, Delétang, Genewein, Grau-Moya, Csordás, Bennani, Legg, Veness",
    year=2023,
    arxiv="2305.16843",
    setup={
        "architecture": Fact(
            "encoder-only Transformer reading an input tape followed by an empty output tape",
            f"{_RPE} experiments/constants.py (transformer_encoder) and experiments/utils.py "
            "(make_model_with_empty_targets)",
        ),
        "layers": Fact(5, f"{_RPE_EX}, num_layers"),
        "width": Fact(64, f"{_RPE_EX}, embedding_dim"),
        "heads": Fact(8, f"{_RPE} models/transformer.py, num_heads default"),
        "steps": Fact(10_000, f"{_RPE_EX}, training_steps"),
        "batch": Fact(128, f"{_RPE_EX}, batch_size"),
        "noise_max_length": Fact(2_048, f"{_RPE_EX}, positional_encodings_params"),
        "seeds": Fact(None, "paper", _PAPER_SETUP),
        "train_lengths": Fact("1-40", f"{_RPE_EX}, sequence_length and UniformCurriculum"),
        "test_lengths": Fact(
            None, "paper", f"{_PAPER_SETUP}; the example evaluates lengths up to 100"
        ),
        "metric": Fact(
            "per-token accuracy at each test length, averaged over the lengths beyond training",
            f"{_RPE_EX}, accuracy_fn and score",
        ),
        "checkpoint": Fact("the parameters after the last training step", f"{_RPE_EX}, main"),
        "seed_selection": Fact(None, "paper", _PAPER_SETUP),
    },
    findings=(
        Finding(
            "15 tasks",
            "randomized minus plain, averaged",
            "test accuracy increase (%)",
            12.0,
            f"paper, abstract ({_RPE_PAGE})",
        ),
        Finding("15 tasks", "all", "models trained", 6000, f"paper, abstract ({_RPE_PAGE})"),
        Finding(
            "each task",
            "each scheme, plain and randomized",
            "accuracy (Table 1)",
            None,
            "paper, Table 1",
            _TABLE_UNREAD,
        ),
    ),
)

# -- Delétang et al. 2023 ------------------------------------------------------------------

_NNCH = "google-deepmind/neural_networks_chomsky_hierarchy"  # at 2b8eb4b
_NNCH_EX = f"{_NNCH} experiments/example.py defaults (a tape-RNN on even_pairs)"

DELETANG = AnchorRecord(
    key="deletang2023",
    title="Neural Networks and the Chomsky Hierarchy",
    authors="Delétang, Ruoss, Grau-Moya, Genewein, Wenliang, Catt, Cundy, Hutter, Legg, "
    "Veness, Ortega",
    year=2023,
    arxiv="2207.02098",
    setup={
        "architecture": Fact(
            "among others, a Transformer encoder (transformer_encoder) and an encoder-decoder "
            "Transformer",
            f"{_NNCH} experiments/constants.py, MODEL_BUILDERS",
        ),
        "layers": Fact(None, "paper", _PAPER_SETUP),
        "width": Fact(None, "paper", _PAPER_SETUP),
        "heads": Fact(None, "paper", _PAPER_SETUP),
        "steps": Fact(10_000, f"{_NNCH_EX}, training_steps"),
        "batch": Fact(128, f"{_NNCH_EX}, batch_size"),
        "seeds": Fact(None, "paper", _PAPER_SETUP),
        "train_lengths": Fact("1-40", f"{_NNCH_EX}, sequence_length"),
        "test_lengths": Fact(None, "paper", f"{_PAPER_SETUP}; the example evaluates up to 100"),
        "metric": Fact(
            "per-token accuracy at each test length, averaged over the lengths beyond training",
            f"{_NNCH_EX}, score",
        ),
        "checkpoint": Fact(None, "paper", _PAPER_SETUP),
    },
    findings=(
        Finding(
            "15 tasks",
            "all architectures",
            "models trained",
            20_910,
            "paper, abstract (arXiv v3, ICLR 2023)",
        ),
        Finding(
            "16 tasks",
            "all architectures",
            "models trained (repository README's abstract, differs from the paper's)",
            2_200,
            f"{_NNCH} README.md",
        ),
        Finding(
            "each task",
            "Transformer, each positional encoding",
            "accuracy (the paper's per-task table)",
            None,
            "paper",
            _TABLE_UNREAD,
        ),
    ),
    claims=(
        Fact(
            "RNNs and Transformers fail to generalize on non-regular tasks",
            "paper, abstract (ar5iv.labs.arxiv.org/html/2207.02098v1)",
        ),
    ),
)

# -- Csordás et al. 2021 -------------------------------------------------------------------

_TG = "RobertCsordas/transformer_generalization"  # at 38f2734
_TG_SWEEP = f"{_TG} sweeps/scan_trafo_length_cutoff.yaml"
_TG_PROFILE = f"{_TG} main.py, profile trafo_scan"
_CS_TABLES = "paper's tables not readable here (only its abstract could be read)"

CSORDAS = AnchorRecord(
    key="csordas2021",
    title="The Devil is in the Detail: Simple Tricks Improve Systematic Generalization of "
    "Transformers",
    authors="Csordás, Irie, Schmidhuber",
    year=2021,
    arxiv="2108.12284",
    setup={
        "architecture": Fact(
            "encoder-decoder Transformer; variants noscale, universal_noscale, relative "
            "(Transformer-XL style), relative_universal, scaledinit, universal_scaledinit",
            f"{_TG_SWEEP}, transformer.variant",
        ),
        "layers": Fact("3+3", f"{_TG} main.py defaults, transformer.encoder_n_layers/decoder"),
        "width": Fact(128, f"{_TG_PROFILE}, state_size"),
        "feed_forward": Fact(256, f"{_TG} main.py default ff_multiplier 2.0 x state_size 128"),
        "heads": Fact(8, f"{_TG_PROFILE}, transformer.n_heads"),
        "dropout": Fact(0.5, f"{_TG_PROFILE}, dropout"),
        "learning_rate": Fact(0.001, f"{_TG_PROFILE}, lr"),
        "steps": Fact(50_000, f"{_TG_SWEEP}, stop_after"),
        "batch": Fact(256, f"{_TG_PROFILE}, batch_size"),
        "seeds": Fact(5, f"{_TG_SWEEP}, sweep_id_for_grid_search 1-5"),
        "train_lengths": Fact(
            "90% of the commands whose output has at most cutoff actions; cutoffs 22, 24, 25, "
            "26, 27, 28, 30, 32, 33, 36, 40",
            f"{_TG_SWEEP}, scan.length_cutoff; {_TG} tasks/scan_resplit_transformer.py and "
            "dataset/scan_length_resplit.py (train_proprtion 0.9)",
        ),
        "test_lengths": Fact(
            "every command whose output is longer than the cutoff (their 'val' set)",
            f"{_TG} tasks/scan_resplit_transformer.py",
        ),
        "metric": Fact(
            "sequence accuracy; the cutoff sweep reports the median over runs",
            f"{_TG} paper/plot_scan_eos_performance.py (val/accuracy/total, MedianTracker)",
        ),
        "checkpoint": Fact(None, "paper", _CS_TABLES),
    },
    findings=(
        Finding(
            "SCAN length split, cutoff 26",
            "relative",
            "accuracy",
            1.0,
            "paper, abstract: 'yielding 100% accuracy on the length split with a cutoff at 26'",
        ),
        Finding(
            "SCAN length split, cutoff 26", "each variant", "main table", None, "paper", _CS_TABLES
        ),
        Finding(
            "SCAN length split, each cutoff",
            "each variant",
            "median accuracy (cutoff sweep table)",
            None,
            "paper",
            _CS_TABLES,
        ),
    ),
)

RECORDS: dict[str, AnchorRecord] = {
    r.key: r for r in (ONTANON, KAZEMNEJAD, RUOSS, DELETANG, CSORDAS)
}


def record(key: str) -> AnchorRecord:
    """The record of one anchor, by key (``"ruoss2023"``)."""
    if key not in RECORDS:
        raise KeyError(f"no anchor record {key!r}; known: {', '.join(RECORDS)}")
    return RECORDS[key]


def findings(key: str, task: str | None = None, scheme: str | None = None) -> list[Finding]:
    """The findings of one anchor, optionally of one task and scheme."""
    return [
        f
        for f in record(key).findings
        if (task is None or f.task == task) and (scheme is None or f.scheme == scheme)
    ]


def mean_over_seeds(key: str, task: str, scheme: str) -> float:
    """The mean of an anchor's per-seed findings (statistic ``..., seed N``) of one task and scheme.

    Raises:
      ValueError: the anchor holds no per-seed number for them, or one was not read.
    """
    per_seed = [f for f in findings(key, task, scheme) if ", seed " in f.statistic]
    if not per_seed:
        raise ValueError(f"{key} has no per-seed numbers for {task!r}, {scheme!r}")
    if any(f.value is None for f in per_seed):
        raise ValueError(f"{key} has a per-seed number for {task!r}, {scheme!r} not read here")
    return statistics.mean(float(f.value) for f in per_seed)


_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e-?\d+)?")


def numbers(key: str) -> set[float]:
    """Every number an anchor's record states: findings, per-seed means, and the numbers in
    its setup facts (``"reversing 6,250"`` gives 6250). A README number about this anchor
    must be one of these."""
    rec = record(key)
    out: set[float] = set()
    for f in rec.findings:
        if f.value is not None:
            out.add(float(f.value))
        text = f"{f.task} {f.statistic}"
        out.update(float(m.replace(",", "")) for m in _NUMBER.findall(text))
    for f in rec.findings:
        if ", seed " in f.statistic:
            out.add(mean_over_seeds(key, f.task, f.scheme))
    for fact in list(rec.setup.values()) + list(rec.claims):
        if isinstance(fact.value, int | float):
            out.add(float(fact.value))
        elif isinstance(fact.value, str):
            out.update(float(m.replace(",", "")) for m in _NUMBER.findall(fact.value))
    return out
