"""Input pipeline benchmark: packing efficiency and throughput of jattn.data.

    JAX_PLATFORMS=cpu python experiments/bench_data.py [--data_dir DIR] [--num_batches 50]

Prints a markdown table, one row per (task, max_len, max_input_len, pack):
examples and batches per second of the pipeline alone (one thread, no
prefetch), examples per row, real tokens / all tokens of inputs and targets,
and the fraction of examples dropped for being longer than the rows.
`--max_input_lens` lists encoder row lengths to try (0 = max_len, one shared
length). Defaults: the CPU experiment's batch of 64 rows.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jattn.data as data  # noqa: E402

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
    parser.add_argument("--data_dir", default=None, help="tfds data dir (default: a temp dir)")
    parser.add_argument("--tasks", default="numbers,numbers/en,reverse")
    parser.add_argument("--max_lens", default="32,64")
    parser.add_argument("--max_input_lens", default="0,16", help="0: max_len")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--num_batches", type=int, default=50)
    args = parser.parse_args(argv)
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
