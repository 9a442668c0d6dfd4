"""Input pipeline benchmark: packing efficiency and throughput of jattn.data.

    python benchmarks/data.py [--data-dir DIR] [--num-batches 50] [--platform cpu]

Prints a markdown table, one row per (task, max_len, max_input_len, pack):
examples and batches per second of the pipeline alone (one thread, no
prefetch), examples per row, real tokens / all tokens of inputs and targets,
and the fraction of examples dropped for being longer than the rows.
`--max-input-lens` lists encoder row lengths to try (0 = max_len, one shared
length). Defaults: the CPU experiment's batch of 64 rows. Flags are spelled
with dashes, as everywhere in `jattn`; the old underscore spellings still work.
"""

from __future__ import annotations

import argparse
import os
import platform
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
    parser.add_argument("--batch-size", type=int, default=64, help="rows a batch (default 64)")
    parser.add_argument(
        "--num-batches", type=int, default=50, help="batches measured per row (default 50)"
    )
    args = parser.parse_args(normalize_flags(sys.argv[1:] if argv is None else argv))
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="jattn_bench_data_")

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


if __name__ == "__main__":
    main()
