"""Input pipeline benchmark: packing efficiency and throughput of jattn.data.

    python benchmarks/data.py [--data-dir DIR] [--num-batches 50] [--platform cpu]

Prints a markdown table, one row per (task, max_len, max_input_len, pack):
examples and batches per second of the pipeline alone (one thread, no
prefetch), examples per row, real tokens / all tokens of inputs and targets,
and the fraction of examples dropped for being longer than the rows.
`--max-input-lens` lists encoder row lengths to try (0 = max_len, one shared
length). Defaults: the CPU experiment's batch of 64 rows. Flags are spelled
with dashes, as everywhere in `jattn`; the old underscore spellings still work.

    python benchmarks/data.py --config configs/chomsky.py:reverse_string,test100 \
        --baseline HEAD~1 --rounds 5 [--batch-size 128]

times one config's training rows (its data set, row lengths and packing;
`--batch-size` defaults to the config's) in this tree, and with `--baseline
REV` also in jattn as it was at git revision REV (its `jattn/` exported to a
temporary folder), side by side in one run: each round runs one child
process per tree, in alternating order, and the table gives the median over
rounds of ms a batch (after the first batch, whose time is its own column:
it includes reading the split when the tree keeps it in memory) and of each
round's ratio of the baseline's time to this tree's, with its range.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _platform import HELP as PLATFORM_HELP  # noqa: E402
from _platform import select_platform  # noqa: E402

select_platform()  # where it is started, unless --platform names one

import jattn.data as data  # noqa: E402
from jattn.cli.common import normalize_flags  # noqa: E402

COLUMNS = (
    ("examples_per_s", "examples/s", "{:,.0f}"),
    ("batches_per_s", "batches/s", "{:.1f}"),
    ("examples_per_row", "examples/row", "{:.2f}"),
    ("inputs_efficiency", "inputs real/all", "{:.3f}"),
    ("targets_efficiency", "targets real/all", "{:.3f}"),
    ("dropped_fraction", "dropped", "{:.3f}"),
)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--platform", default=None, help=PLATFORM_HELP)
    parser.add_argument("--data-dir", default=None, help="tfds data dir (default: a temp dir)")
    parser.add_argument(
        "--tasks", default="numbers,numbers/en,reverse", help="comma-separated jattn tasks"
    )
    parser.add_argument(
        "--max-lens", default="32,64", help="comma-separated target row lengths (default 32,64)"
    )
    parser.add_argument(
        "--max-input-lens",
        default="0,16",
        help="comma-separated input row lengths, 0: max_len (default 0,16)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows a batch (default 64; with --config: the config's)",
    )
    parser.add_argument(
        "--num-batches", type=int, default=50, help="batches measured per row (default 50)"
    )
    parser.add_argument("--config", default=None, help="time this config's training rows")
    parser.add_argument("--baseline", default=None, help="with --config: also jattn at git REV")
    parser.add_argument("--rounds", type=int, default=5, help="with --config (default 5)")
    args = parser.parse_args(normalize_flags(sys.argv[1:] if argv is None else argv))
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="jattn_bench_data_")
    if args.config:
        return compare_trees(args, data_dir)
    args.batch_size = args.batch_size or 64

    header = ["task", "max_len", "max_input_len", "pack"] + [title for _, title, _ in COLUMNS]
    lines = [
        f"Input pipeline, batch {args.batch_size} rows, {args.num_batches} batches, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    print("\n".join(lines), flush=True)
    for name in args.tasks.split(","):
        task = data.load(name, data_dir=data_dir)
        for max_len in (int(x) for x in args.max_lens.split(",")):
            for input_len in (int(x) or max_len for x in args.max_input_lens.split(",")):
                for pack in (True, False):
                    stats = data.measure_loader(
                        task,
                        "train",
                        batch_size=args.batch_size,
                        max_len=max_len,
                        max_input_len=input_len,
                        num_batches=args.num_batches,
                        pack=pack,
                    )
                    cells = [name, str(max_len), str(input_len), "yes" if pack else "no"]
                    cells += [fmt.format(stats[key]) for key, _, fmt in COLUMNS]
                    line = "| " + " | ".join(cells) + " |"
                    print(line, flush=True)
                    lines.append(line)
    return "\n".join(lines)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One child per tree and round: the jattn on PYTHONPATH reads a config's rows.
CHILD = """
import json, sys, time
import jattn.data as data
spec = json.loads(sys.argv[1])
assert data.__file__.startswith(spec["tree"]), (data.__file__, spec["tree"])
task = data.load(spec["dataset"], **spec["task"])
it = iter(data.make_loader(task, "train", seed=0, prefetch=0, **spec["loader"]))
start = time.perf_counter()
next(it)
first = time.perf_counter() - start
before = data.loader_stats(it)["examples"]
start = time.perf_counter()
for _ in range(spec["num_batches"]):
    next(it)
elapsed = time.perf_counter() - start
examples = data.loader_stats(it)["examples"] - before
print(json.dumps({"first_s": first, "elapsed_s": elapsed, "examples": examples}))
"""


def _export(rev: str) -> str:
    """jattn/ as it was at git revision `rev`, in a temporary folder (its path)."""
    folder = tempfile.mkdtemp(prefix="jattn_bench_data_baseline_")
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", rev, "jattn"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


def compare_trees(args, data_dir: str) -> str:
    """The table of `--config` (see the module's docstring)."""
    from jattn.train.config import load_config  # noqa: PLC0415

    c = load_config(args.config)
    task_keys = {k: c.get(k) for k in ("tokenizer", "vocab_size", "source_key", "target_key")}
    batch = args.batch_size or c.batch_size
    spec = {
        "dataset": c.dataset,
        "task": dict(task_keys, data_dir=c.data_dir or data_dir),
        "loader": {
            "batch_size": batch,
            "max_len": c.max_len,
            "max_input_len": c.max_input_len or c.max_len,
            "pack": c.pack,
            "overlong": c.overlong,
        },
        "num_batches": args.num_batches,
    }
    trees = {"this tree": ROOT}
    if args.baseline:
        rev = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", args.baseline],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        trees = {f"baseline {rev}": _export(args.baseline), **trees}
    runs = {name: [] for name in trees}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        for name in trees if r % 2 == 0 else reversed(trees):
            env = dict(os.environ, PYTHONPATH=trees[name])
            out = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(dict(spec, tree=trees[name]))],
                env=env, cwd=tempfile.gettempdir(),  # not a folder holding another jattn/
                check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    header = ["config", "tree", "batch", "ms/batch", "batches/s", "examples/s", "first batch s"]
    header += ["speed-up (range)"] if args.baseline else []
    lines = [
        f"Input pipeline of {args.config}: {spec['dataset']}, {batch} rows of "
        f"{spec['loader']['max_input_len']} + {c.max_len}, pack={c.pack}, {args.num_batches} "
        f"batches a round, median of {args.rounds} rounds (one process a tree and round, "
        f"alternating order), {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load average {load_before:.1f} before and "
        f"{os.getloadavg()[0]:.1f} after",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    base = next(iter(runs.values()))
    for name, results in runs.items():
        ms = statistics.median(1e3 * x["elapsed_s"] / args.num_batches for x in results)
        examples = statistics.median(x["examples"] / x["elapsed_s"] for x in results)
        first = statistics.median(x["first_s"] for x in results)
        cells = [args.config, name, str(batch), f"{ms:.2f}", f"{1e3 / ms:.1f}"]
        cells += [f"{examples:,.0f}", f"{first:.2f}"]
        if args.baseline:  # each round's baseline time over this tree's, paired by round
            ratios = [b["elapsed_s"] / x["elapsed_s"] for b, x in zip(base, results, strict=True)]
            spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if results is not base else ""
            cells.append(f"{statistics.median(ratios):.2f}x{spread}")
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines), flush=True)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
