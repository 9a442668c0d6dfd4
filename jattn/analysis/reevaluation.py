"""Evaluating a grid's finished runs again from their kept checkpoints, without training.

A metric added to `jattn.train.evaluation` after a grid ran (the
teacher-forced sequence accuracy of Ontañón et al. 2022, say) is missing
from its runs' ``final_metrics.json``. Training again would cost the grid's
whole wall time and, on another machine, move every float32 number within
its interval; the checkpoint of each run's final step is enough. So
``jattn ablate --reevaluate`` (`reevaluate_grid`) takes each finished run's
final checkpoint through the verified loader (`jattn.train.load.load_run`:
the step counter, every array against the checksum its save recorded,
every value finite; a step that fails is an error, never an older step),
evaluates it as training did (the run's own config, eval splits, rows,
tokenizer and decoding; under its mesh, axis rules and matmul precision),
and rewrites ``final_metrics.json`` and ``decodes/`` with the result. The
report is then rebuilt from them.

Every metric the run recorded is compared with its re-evaluation before it
is replaced, and each run's ``reevaluation.json`` keeps what changed (the
recorded and the new value) and what was added. A decoded exact match equal
to the last digit is what proves the checkpoint is the one that made the
table: a different checkpoint, or a different evaluation, would not decode
the same 1,024 strings. On another CPU float32 rounding may move a number
(`jattn.analysis.comparisons.FLOAT32_NOTE`), and the record says so rather
than hiding it. Metrics that evaluation does not make (``train/loss``,
``train/steps_per_sec``, ``num_params``, the data check's) are kept as
they were.

The grid's ``reevaluation.json`` holds the date, wall time, machine and
every run's record; `section` writes the report's account of it.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from typing import Any

from jattn.analysis import comparisons
from jattn.train import workdir as workdir_lib

__all__ = ["RECORD", "reevaluate_grid", "reevaluate_run", "section"]

RECORD = "reevaluation.json"  # in each run's workdir and in the grid's


def _evaluate(run) -> tuple[dict[str, float], dict[str, list[dict[str, Any]]]]:
    """The evaluation training makes at a step, of a `load_run` run: its metrics
    and decoded examples."""
    import jax  # noqa: PLC0415 -- only a re-evaluation needs jax
    from flax import linen as nn  # noqa: PLC0415

    from jattn import data as data_lib  # noqa: PLC0415
    from jattn.train import data_checks, evaluation, steps  # noqa: PLC0415
    from jattn.train import mesh as mesh_lib  # noqa: PLC0415
    from jattn.train.config import matmul_precision  # noqa: PLC0415

    config = run.config
    splits = data_checks.eval_splits(config, run.task)
    eval_sets = evaluation.load_eval_sets(run.task, data_lib.make_loader, config, splits)
    mesh = mesh_lib.make_mesh(config.mesh_shape)
    rules = tuple(tuple(r) for r in config.logical_axis_rules) or mesh_lib.DEFAULT_RULES
    batch = mesh_lib.batch_sharding(mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with matmul_precision(config), jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        params = jax.device_put(run.params, replicated)
        eval_step = jax.jit(
            steps.make_eval_step(run.model), in_shardings=(replicated, batch),
            out_shardings=replicated,
        )  # fmt: skip
        decode = evaluation.decode_fn(run.model, config)
        if decode is not None:
            decode = jax.jit(
                decode, in_shardings=(replicated, batch, batch), out_shardings=replicated
            )
        return evaluation.evaluate(
            params, eval_sets, eval_step=eval_step, decode=decode,
            to_global=lambda b: mesh_lib.make_global_batch(b, batch, replicated_input=True),
            tokenizer=run.tokenizer, num_decode=config.eval_decode_examples,
        )  # fmt: skip


def reevaluate_run(
    workdir: str,
    num_train_steps: int,
    evaluate: Callable[[Any], tuple[dict[str, float], dict[str, list]]] = _evaluate,
) -> dict[str, Any]:
    """Evaluates a finished run's final checkpoint again and rewrites its final
    metrics and decodes (module docstring).

    Args:
      workdir: the run's workdir.
      num_train_steps: its config's steps (the final step, whose checkpoint is read).
      evaluate: `(TrainedRun) -> (metrics, decodes)`, as training evaluates
        (replaced in tests only).

    Returns:
      the run's record, also written to ``workdir/reevaluation.json``: ``step``,
      ``equal`` (how many recorded metrics equal their re-evaluation),
      ``changed`` ({metric: [recorded, now]}), ``added`` (metrics it lacked).

    Raises:
      FileNotFoundError: the run has not finished (no final metrics of that step).
      ValueError: its final step's checkpoint is missing or does not verify.
    """
    from jattn.train.load import load_run  # noqa: PLC0415 -- imports jax and orbax
    from jattn.train.metrics import strict_json_value, write_final_metrics  # noqa: PLC0415

    final = workdir_lib.finished_metrics(workdir, num_train_steps)
    if final is None:
        raise FileNotFoundError(
            f"reevaluate: {workdir!r} has no final metrics of step {num_train_steps}"
        )
    run = load_run(workdir, step=num_train_steps)
    metrics, decodes = evaluate(run)
    metrics = {k: strict_json_value(v) for k, v in metrics.items()}
    changed = {k: [final[k], v] for k, v in sorted(metrics.items()) if k in final and final[k] != v}
    record = {
        "step": run.step,
        "equal": sum(1 for k in metrics if k in final and k not in changed),
        "changed": changed,
        "added": sorted(k for k in metrics if k not in final),
    }
    # Only the evaluation's keys are replaced; training's (and a metric the
    # evaluation no longer makes) are kept.
    write_final_metrics(os.path.join(workdir, workdir_lib.FINAL_METRICS), {**final, **metrics})
    from jattn.train.evaluation import write_decodes  # noqa: PLC0415

    write_decodes(workdir, run.step, decodes)
    workdir_lib.write_json(os.path.join(workdir, RECORD), record)
    return record


def reevaluate_grid(runs, configs, workdir: str, log=print) -> dict[str, Any]:
    """`reevaluate_run` on every finished run of a grid; writes and returns the
    grid's record (``workdir/reevaluation.json``). Runs not finished are left
    alone (the report leaves them out too).

    Raises:
      ConfigError: a finished run whose final checkpoint is missing or does not
        verify (one line naming the run; the runs before it are rewritten already).
    """
    from jattn.train.config import ConfigError  # noqa: PLC0415

    start = time.time()
    started = _utc_now()
    done: dict[str, Any] = {}
    for run, config in zip(runs, configs, strict=True):
        if workdir_lib.finished_metrics(run.workdir, config.num_train_steps) is None:
            log(f"  {run.name}: not finished, not re-evaluated")
            continue
        try:
            record = reevaluate_run(run.workdir, config.num_train_steps)
        except (FileNotFoundError, ValueError) as e:  # load_run: no step, or it fails
            raise ConfigError(f"reevaluate {run.name}: {e}") from None
        done[run.name] = record
        log(f"  {run.name}: {_run_line(record)}")
    found = {
        "started_utc": started,
        "date_utc": _utc_now(),  # when it ended
        "wall_s": round(time.time() - start, 1),
        "machine": comparisons.machine(),
        "runs": done,
    }
    workdir_lib.write_json(os.path.join(workdir, RECORD), found)
    log(f"reevaluate: {len(done)} runs in {found['wall_s']:.0f} s")
    return found


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")


def _run_line(record: dict[str, Any]) -> str:
    changed = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in record["changed"].items())
    return (
        f"step {record['step']}: {record['equal']} recorded metrics equal"
        + (f"; changed: {changed}" if changed else "")
        + (f"; added: {', '.join(record['added'])}" if record["added"] else "")
    )


def section(workdir: str) -> list[str]:
    """The report's section "Re-evaluated from the kept checkpoints" (markdown
    lines), or [] for a grid never re-evaluated."""
    found = workdir_lib.read_json(os.path.join(workdir, RECORD))
    if not found or not found.get("runs"):
        return []
    runs = found["runs"]
    equal = sum(r["equal"] for r in runs.values())
    changed = [(name, k, a, b) for name, r in runs.items() for k, (a, b) in r["changed"].items()]
    added = sorted({k for r in runs.values() for k in r["added"]})
    minutes, seconds = divmod(round(found["wall_s"]), 60)
    lines = [
        "## Re-evaluated from the kept checkpoints",
        "",
        f"The final checkpoints of the {len(runs)} runs were evaluated again "
        + (f"from {found['started_utc']} to " if found.get("started_utc") else "until ")
        + f"{found['date_utc']} UTC (`jattn ablate --reevaluate`: each loaded and verified by "
        f"`jattn.train.load.load_run`, nothing trained; {minutes} min {seconds} s), and their "
        "final metrics and decodes rewritten with the result.",
        "",
        f"Of the metrics the runs recorded when they trained, {equal} equal their "
        f"re-evaluation to the last digit"
        + (f" and {len(changed)} differ:" if changed else ", and none differs.")
        + (f" Added: {', '.join(f'`{k}`' for k in added)}." if added else ""),
        "",
    ]
    if changed:
        lines += ["| run | metric | recorded | re-evaluated |", "|---|---|---:|---:|"]
        lines += [f"| {n} | {k} | {a!r} | {b!r} |" for n, k, a, b in changed]
        lines.append("")
    lines += [comparisons.machine_line(found.get("machine")), ""]
    return lines
