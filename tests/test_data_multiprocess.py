"""Two real processes, shard_index 0 and 1 of 2: disjoint shards that cover the split."""

import collections
import json
import os
import subprocess
import sys

import pytest

import jattn.data as data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process of a two-process job: reads its shard of one epoch and writes the
# examples it saw (decoded) and its first batch's shape as JSON.
WORKER = """
import json, sys
import jattn.data as data
data_dir, shard_index, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
task = data.load("numbers/de_tiny", data_dir=data_dir)
loader = data.make_loader(task, "train", batch_size=16, max_len=96, seed=7, num_epochs=1,
                          shard=(shard_index, 2))
seen, shapes = [], set()
for batch in loader:
    shapes.add(tuple(batch["inputs"].shape))
    for ex in data.unpack(batch):
        seen.append([task.tokenizer.decode(ex["inputs"]), task.tokenizer.decode(ex["targets"])])
json.dump({"seen": seen, "shapes": sorted(shapes)}, open(out, "w"))
"""


@pytest.fixture(scope="module")
def prepared(data_dir):
    return data_dir, data.load("numbers/de_tiny", data_dir=data_dir)  # prepared once


def test_two_processes_get_disjoint_covering_shards(prepared, tmp_path):
    data_dir, task = prepared
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, data_dir, str(i), str(tmp_path / f"{i}.json")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out.decode()[-3000:]
    results = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    shards = [collections.Counter(map(tuple, r["seen"])) for r in results]
    assert all(r["shapes"] == [[16, 96]] for r in results)
    assert sum(shards[0].values()) == sum(shards[1].values()) == 300
    assert not set(shards[0]) & set(shards[1])  # disjoint
    src = task.source("train")
    everything = collections.Counter((ex["inputs"], ex["targets"]) for ex in src)
    assert shards[0] + shards[1] == everything  # together: every example exactly once
