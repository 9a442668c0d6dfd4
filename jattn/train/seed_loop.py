"""`train_seeds(config, workdir)`: every seed of `config.seeds` in one jitted program.

With `config.sweep_learning_rate` / `sweep_warmup_steps` the program's members
are every (swept values, seed) combination (`jattn.train.members`), each the
single run with those values; "seed" below reads "member" then.

The loop reads like `jattn.train.loop.train_and_evaluate`, whose helpers it
uses, with a seed axis `S` in front of every array:

1. check the config, build the mesh, load the data, build the model once;
2. every seed's workdir (``WORKDIR/seed-<s>/`` by default) gets what a single
   run's gets: `config.json` (with ``seed=s``), `model_config.json`, the
   tokenizer, `data_check.json`, then `metrics.jsonl`, `tb/`, `decodes/`,
   `final_metrics.json` and, at the end, its own checkpoint;
3. the stacked state `[S, ...]` is initialised by vmapping a single run's
   init over the seeds' root keys, or restored with every seed's data iterator
   from ``WORKDIR/checkpoints/`` (`jattn.train.seeds.save_stacked`): the
   newest step that restores and verifies, damaged ones set aside
   (`jattn.train.recovery`);
4. the train step is the single run's step over the seed axis: `jax.vmap`
   (batched; fills an accelerator) or `lax.map` (each seed's own computation
   inside the one program; bit for bit a single run's numbers), chosen by
   `config.seed_program` (`jattn.train.seeds.program_kind`: "auto" is map on
   the CPU); a seed whose loss turns NaN or Inf keeps its last good state (a
   select on device) and stops being logged, and the others go on;
5. evaluation and decoding go over the seed axis the same way, and each
   seed's metrics and decodes are written to its own workdir
   (`jattn.train.seed_metrics`).

The single run's protections apply (docs/reliability.md, "Seeds in one
program"): the write checks, the workdir lock, the data checks, the checks
around each save, sane-loss retention and SIGTERM at every stage.

A seed of this program sees exactly the batches and random numbers of the
single run with that seed: under map its losses are the single run's; under
vmap they agree up to the rounding of batched matmuls, which training
amplifies over hundreds of steps (see `tests/test_train_seeds.py`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jattn.data import producibility
from jattn.data.tokenizers import save_to_dir, vocab_hash
from jattn.train import checkpoints as ckpt
from jattn.train import data_checks, evaluation, filesystem, recovery, steps
from jattn.train import loop as single
from jattn.train import members as members_lib
from jattn.train import mesh as mesh_lib
from jattn.train import seeds as seeds_lib
from jattn.train.config import ConfigError, build_model_config, check_config
from jattn.train.distributed import PreemptionWatch
from jattn.train.metrics import Progress, TrainMetrics, strict_json_value, write_final_metrics
from jattn.train.optim import make_optimizer
from jattn.train.restore import load_task
from jattn.train.sanity import SANE_STEP_METRIC
from jattn.train.seed_metrics import SeedMetrics, finished_members
from jattn.train.workdir_lock import WorkdirLock

__all__ = ["train_seeds"]


def _last_loss(tm: TrainMetrics, workdir: str) -> float:
    loss = tm.logged_loss
    return loss if math.isfinite(loss) else single._last_logged_loss(workdir)


def train_seeds(
    config: ml_collections.ConfigDict,
    workdir: str,
    seed_dirs: list[str] | None = None,
    *,
    members: Sequence[members_lib.Member] | None = None,
    raise_on_divergence: bool = True,
    watch: PreemptionWatch | None = None,
) -> dict[str, Any]:
    """Trains (or resumes) every seed of `config.seeds` in one program.

    It has a single run's protections (docs/reliability.md, "Seeds in one
    program"): the workdir, `checkpoints/` and every seed workdir are probed
    for writing at start; the workdir is locked; damaged stacked checkpoints
    are set aside and the newest one that restores and verifies is resumed;
    the data checks run; each save checks the previous one and the free
    space; and retention keeps the last sane checkpoint, where a stacked
    checkpoint is sane when every seed's last logged loss is sane: a live
    seed's at that step, a seed that went NaN the last one it logged (its
    state is frozen there; `jattn.train.seed_metrics`).

    Args:
      config: a full config with `seeds` set.
      workdir: the group's directory: holds the stacked ``checkpoints/``.
      seed_dirs: each member's run directory (default ``workdir/<member name>``:
        ``seed-<s>``, or e.g. ``learning_rate-0.001_seed-<s>`` with a sweep),
        laid out as a single run's.
      members: the program's members (`jattn.train.members`); default: every
        seed and swept value of `config` (`members.members(config)`).
      raise_on_divergence: raise `TrainingDivergedError` at the end (after the
        other seeds finished) when a seed diverged; False returns it in
        ``"diverged"``.
      watch: the caller's `PreemptionWatch` (`train_and_evaluate`'s); None
        installs one for this call.

    Returns:
      ``{"step", "preempted", "seeds": {key: final metrics}, "diverged":
      {key: message}}``, keyed by seed (or by member name when a learning
      rate or warmup is swept: `Member.key`); each member's final metrics as
      its ``final_metrics.json`` holds them.

    Raises:
      ConfigError: as `train_and_evaluate`, or a config that cannot vmap.
      TrainingDivergedError: a seed diverged (`raise_on_divergence`).
      WorkdirLockedError, WorkdirIOError, Terminated: as `train_and_evaluate`.
    """
    with contextlib.ExitStack() as stack:
        if watch is None:
            watch = PreemptionWatch(stage="start-up")
            stack.callback(watch.close)
        return _train_seeds(config, workdir, seed_dirs, members, raise_on_divergence, watch, stack)


def _train_seeds(
    config, workdir, seed_dirs, members, raise_on_divergence, watch, stack
) -> dict[str, Any]:
    """`train_seeds` under `watch`; `stack` holds the workdir's lock."""
    from jattn import data as data_lib  # noqa: PLC0415
    from jattn.models import Transformer  # noqa: PLC0415

    # 1. Config, mesh, data, model. ----------------------------------------------------
    check_config(config)
    config = config.copy_and_resolve_references()  # `seeds` may shrink below; not the caller's
    blockers = seeds_lib.vmap_blockers(config)
    if blockers:
        raise ConfigError(
            "config.seeds: these seeds cannot train in one program: " + "; ".join(blockers)
        )
    program = list(members) if members is not None else members_lib.members(config)
    workdir = os.path.abspath(workdir)
    dirs = seed_dirs or members_lib.member_workdirs(workdir, program)
    dirs = [os.path.abspath(d) for d in dirs]
    if len(dirs) != len(program):
        raise ConfigError(f"{len(program)} members but {len(dirs)} workdirs")
    seed_configs = [members_lib.member_config(config, m) for m in program]
    keys = [m.key for m in program]  # how results and the stacked checkpoint name them
    is_main = jax.process_index() == 0
    mesh = mesh_lib.make_mesh(config.mesh_shape)
    rules = tuple(tuple(r) for r in config.logical_axis_rules) or mesh_lib.DEFAULT_RULES
    single._check_sizes(config, mesh)
    axis = config.seed_mesh_axis or None
    task = load_task(config)
    eval_splits = data_checks.eval_splits(config, task)
    data_checks.check_best_metric(config, task, eval_splits)

    # 2. Checkpoints: writable, one writer, damaged steps set aside before orbax opens
    # them; seeds already finished (e.g. by single runs) are left out of the program.
    checkpoint_dir = os.path.join(workdir, ckpt.CHECKPOINT_DIR)
    if is_main:
        filesystem.check_writable(workdir, checkpoint_dir, *dirs)
        lock = stack.enter_context(WorkdirLock(workdir))
        if lock.previous:
            pid = lock.previous.get("pid")
            single._warn(f"warning: took over the lock of {workdir} left by pid {pid}, which died")
        recovery.set_aside_incomplete(checkpoint_dir, single._warn)
    done = finished_members(dirs, seed_configs)
    done_finals = {keys[i]: f for i, f in done.items()}  # by key: positions shift below
    group_config = config.copy_and_resolve_references()
    with group_config.unlocked():
        group_config.best_metric = ""  # the best step of one seed is not the group's
    mngr = ckpt.make_manager(workdir, group_config)
    latest = mngr.latest_step()
    meta = ckpt.saved_meta(mngr, latest) if latest is not None else None
    saved_keys = (meta or {}).get("signature", {}).get("seeds", [])
    gone = {saved_keys[int(k)]: v for k, v in (meta or {}).get("diverged", {}).items()}
    # Finished: the last step saved and every member's final_metrics.json written (or
    # the member diverged). A stop while the members' final files were being written
    # resumes at the last step: no training, the final evaluation and files again.
    if (
        meta is not None
        and meta.get("step") == config.num_train_steps
        and all(i in done or k in gone for i, k in enumerate(keys))
    ):
        mngr.close()  # the program finished: what each seed wrote is its result
        seeds_lib.check_stacked_compatible(meta, config, saved_keys, f"workdir {workdir!r}")
        return {
            "step": config.num_train_steps,
            "preempted": False,
            "seeds": {keys[i]: f for i, f in done.items()},
            "diverged": gone,
        }
    todo = [i for i in range(len(program)) if i not in done]
    if not todo:
        mngr.close()
        return {
            "step": config.num_train_steps,
            "preempted": False,
            "seeds": {keys[i]: f for i, f in done.items()},
            "diverged": {},
        }
    if len(todo) < len(program) and latest is None:
        program = [program[i] for i in todo]
        keys = [keys[i] for i in todo]
        dirs = [dirs[i] for i in todo]
        seed_configs = [seed_configs[i] for i in todo]
    num = len(program)
    seeds = [m.seed for m in program]
    labels = [m.label for m in program]
    if meta is not None:
        seeds_lib.check_stacked_compatible(meta, config, keys, f"workdir {workdir!r}")
    data_checks.check_row_lengths(config, task, single._warn)  # after: a resume's diffs say more

    data_check = producibility.check(task, eval_splits)
    vocab = vocab_hash(task.tokenizer)  # recorded in each member's own checkpoint
    model_config = build_model_config(config, task.tokenizer.vocab_size)
    model = Transformer(model_config)
    tx, schedule = make_optimizer(config)
    if is_main:
        for d, c in zip(dirs, seed_configs, strict=True):
            single._write_run_config(d, c, model_config)
            save_to_dir(task.tokenizer, d)
            with open(os.path.join(d, single.DATA_CHECK), "w") as f:
                json.dump(data_check, f, indent=2)

    # 3. The stacked state's shapes and shardings: one run's, with a seed axis in front.
    init_boxed = single._make_init(model, tx, config, rows=mesh.shape["data"] * mesh.shape["fsdp"])
    roots = np.stack([jax.random.key_data(jax.random.key(s)) for s in seeds])  # uint32 [S, 2]
    abstract_one, shardings_one = single._abstract_state(init_boxed, roots[0], mesh, rules)
    abstract, shardings = seeds_lib.stacked_abstract(abstract_one, shardings_one, num, axis)
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_one.params))
    seed_sharding = NamedSharding(mesh, P(axis))
    replicated = NamedSharding(mesh, P())

    # 4. Data streams; initialise, or restore the newest step that restores and verifies.
    def new_streams() -> seeds_lib.SeedStreams:
        return seeds_lib.SeedStreams([iter(single._train_loader(task, c)) for c in seed_configs])

    eval_sets = evaluation.load_eval_sets(task, data_lib.make_loader, config, eval_splits)
    diverged: dict[int, str] = {}
    restored, streams = None, None
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        if latest is not None:
            target = {
                "state": abstract,
                "alive": jax.ShapeDtypeStruct((num,), jnp.bool_, sharding=seed_sharding),
            }
            restored, streams, latest = recovery.restore_newest(
                mngr,
                lambda step, s: seeds_lib.restore_stacked(mngr, step, target, s),
                new_streams,
                single._warn,
                # (state, alive, meta): every seed still training at the step, all finite
                verify=lambda r, step: recovery.verify_state(r[0], step, live=r[1]),
            )
        if restored is not None:
            state, alive, saved = restored
            diverged = {int(k): v for k, v in saved.get("diverged", {}).items()}
            start = int(saved["step"])
        else:
            if is_main:
                for d in dirs:
                    recovery.archive_metrics(d, single._warn)
            streams = streams or new_streams()
            init = jax.jit(
                jax.vmap(lambda r: nn.meta.unbox(init_boxed(r))), out_shardings=shardings
            )
            state = init(jax.device_put(roots, seed_sharding))
            alive = jax.device_put(np.ones(num, bool), seed_sharding)
            start = 0

    # 5. Compiled functions. -----------------------------------------------------------
    batch_sharding = seeds_lib.seed_batch_sharding(mesh, axis)
    rows_spec = P(None, tuple(a for a in ("data", "fsdp") if a != axis), None)
    kind = seeds_lib.program_kind(config)
    step_fn = seeds_lib.seed_train_step(
        model,
        tx,
        schedule,
        config,
        mesh,
        seeds,
        rows_spec,
        kind,
        hparams=members_lib.hparam_arrays(program),
    )
    rows = config.batch_size
    abstract_batch = {
        k: jax.ShapeDtypeStruct((num, rows, n), jnp.int32, sharding=batch_sharding)
        for k, n in seeds_lib.batch_lengths(config).items()
    }
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        train_step = (
            jax.jit(
                step_fn,
                in_shardings=(shardings, batch_sharding, seed_sharding),
                out_shardings=(shardings, replicated, seed_sharding),
                donate_argnums=(0,),
            )
            .lower(abstract, abstract_batch, jax.ShapeDtypeStruct((num,), jnp.bool_))
            .compile()
        )
    eval_batch_sharding = mesh_lib.batch_sharding(mesh)
    eval_step = jax.jit(
        seeds_lib.over_seeds(steps.make_eval_step(model), kind, num_shared=1),
        in_shardings=(shardings.params, eval_batch_sharding),
        out_shardings=replicated,
    )
    decode_one = single._decode_fn(model, config)
    decode = decode_one and jax.jit(
        seeds_lib.over_seeds(decode_one, kind, num_shared=1),
        in_shardings=(shardings.params, eval_batch_sharding),
        out_shardings=replicated,
    )
    to_global = functools.partial(
        mesh_lib.make_global_batch, sharding=eval_batch_sharding, replicated_input=True
    )

    # 6. Per-seed writers and loss sanity; one progress bar for the program, whose
    # tokens a second are every seed's.
    progress = Progress(
        config.num_train_steps,
        start,
        enabled=is_main and config.progress_bar,
        is_main=is_main,
        tokens_label=f"tok_s({num} seeds)",
    )
    metric_names = ["train/loss", "train/accuracy"] + [
        f"eval/{es.split}/{m}"
        for es in eval_sets.values()
        for m in ("loss", "accuracy", *es.metrics)
    ]
    book = SeedMetrics(
        labels,
        dirs,
        seed_configs,
        start=start,
        metric_names=metric_names,
        progress=progress,
        diverged=diverged,
        is_main=is_main,
    )
    progress.write(
        single._startup_summary(
            workdir, config, mesh, num_params, task, eval_sets, start, data_check
        )
        + f"\n{members_lib.describe(program)} in one program ({kind}) -> "
        + ", ".join(os.path.relpath(d, workdir) for d in dirs)
        + "\n"
        + seeds_lib.memory_line(train_step, abstract_one, num, kind)
    )
    for i, msg in diverged.items():
        progress.write(f"{labels[i]} diverged before this restart: {msg}")

    def run_eval(params, step: int) -> dict[int, dict[str, float]]:
        cache: dict[Any, Any] = {}

        def stacked(kind, array_or_batch):
            key = (kind, id(array_or_batch))
            if key not in cache:
                if kind == "eval":
                    out = eval_step(params, to_global(array_or_batch))
                else:
                    out = decode(params, to_global({"inputs": array_or_batch})["inputs"])
                cache[key] = jax.device_get(out)
            return cache[key]

        results = {}
        for i in book.live():
            metrics, decodes = evaluation.evaluate(
                None,
                eval_sets,
                eval_step=lambda _, b, i=i: seeds_lib.take(stacked("eval", b), i),
                decode=decode and (lambda _, x, i=i: np.asarray(stacked("decode", x)[i])),
                to_global=lambda b: b,
                tokenizer=task.tokenizer,
                num_decode=config.eval_decode_examples,
            )
            if is_main:
                evaluation.write_decodes(dirs[i], step, decodes)
            book.writers[i].write(step, metrics)
            results[i] = metrics
        return results

    eval_metrics: dict[int, dict[str, float]] = {}
    step, eval_step_done, preempted = start, -1, False
    last_sane, save_failed = (start or None), False
    save_bytes = int(1.2 * single._state_bytes(abstract)) + (1 << 20)
    watch.stage = "training"
    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            while step < config.num_train_steps:
                batch = {
                    k: jax.make_array_from_process_local_data(batch_sharding, v)
                    for k, v in next(streams).items()
                }
                state, device_metrics, alive = train_step(state, batch, alive)
                step += 1
                book.push(step, device_metrics, alive)  # fetches the previous step's
                filesystem.check_saves(mngr)  # a background save that failed stops the run
                do_eval = step % config.eval_every_steps == 0 or step == config.num_train_steps
                do_save = step % config.checkpoint_every_steps == 0 or do_eval
                do_log = step % config.log_every_steps == 0 or do_save
                preempted = watch.reached(step)
                if do_log or preempted:
                    book.log(step)
                if do_eval:
                    eval_metrics, eval_step_done = run_eval(state.params, step), step
                    for i, m in eval_metrics.items():
                        progress.write(f"{labels[i]}: " + single._format_eval(step, m))
                if do_save or preempted:
                    sane_step = {SANE_STEP_METRIC: step if book.sane else -1}
                    with filesystem.checked_save(mngr, step, save_bytes):
                        seeds_lib.save_stacked(
                            mngr,
                            step,
                            state,
                            alive,
                            streams,
                            config,
                            keys,
                            book.named_diverged(),
                            sane_step,
                        )
                    for line in book.insane_warnings(step, last_sane):
                        progress.write(line)
                    last_sane = step if book.sane else last_sane
                if do_eval or do_save:
                    book.end_interval()
                if preempted:
                    filesystem.wait_for_saves(mngr)
                    progress.write(f"preempted: saved step {step} in {mngr.directory}; exiting")
                    break
            watch.stage = "finishing"
            book.drain()
            filesystem.wait_for_saves(mngr)  # the last save's failure is an error too
            if not preempted and eval_step_done != step:
                eval_metrics = run_eval(state.params, step)
    except (filesystem.WorkdirIOError, OSError) as e:
        error = filesystem.write_error(e, workdir, step)
        save_failed = error.save_failed  # orbax would wait 300 s for a failed save: do not
        raise error from None
    finally:
        watch.stage = "finishing"
        progress.close()
        filesystem.close_manager(mngr, save_failed=save_failed)
        book.close()

    # 7. Each finished seed: its own checkpoint and final_metrics.json, as a single run.
    finals: dict[Any, dict[str, Any]] = dict(done_finals)
    seed_bytes = int(1.2 * single._state_bytes(abstract_one)) + (1 << 20)
    for i in book.live():
        if keys[i] in done_finals:  # finished before this rerun (its files were written)
            continue
        result = {
            "step": step,
            "preempted": preempted,
            "train/loss": _last_loss(book.trackers[i], dirs[i]),
            "train/steps_per_sec": book.trackers[i].steady_steps_per_sec,
            "train/seeds_in_program": num,
            "num_params": int(num_params),
            **eval_metrics.get(i, {}),
            **producibility.metrics(data_check),
        }
        if is_main and not preempted:
            seed_mngr = ckpt.make_manager(dirs[i], seed_configs[i])
            sane = i not in book.insane
            saved = {**eval_metrics.get(i, {}), SANE_STEP_METRIC: step if sane else -1}
            with filesystem.checked_save(seed_mngr, step, seed_bytes):
                one = seeds_lib.take(state, i)
                ckpt.save(seed_mngr, step, one, streams.iterators[i], seed_configs[i], saved, vocab)
            filesystem.wait_for_saves(seed_mngr)
            seed_mngr.close()
            path = os.path.join(dirs[i], single.FINAL_METRICS)
            finals[keys[i]] = write_final_metrics(path, result)
        else:
            finals[keys[i]] = {k: strict_json_value(v) for k, v in result.items()}
    named = {keys[i]: msg for i, msg in book.diverged.items()}
    if named and raise_on_divergence and not preempted:
        raise single.TrainingDivergedError(
            "; ".join(named[s] for s in sorted(named))
            + ". The other seeds finished in "
            + ", ".join(dirs[i] for i in book.live())
        )
    return {"step": step, "preempted": preempted, "seeds": finals, "diverged": named}
