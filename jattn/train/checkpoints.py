"""Checkpoints: one orbax CheckpointManager step holds everything a run needs.

Layout of `workdir/checkpoints/<step>/`:

- ``state``: the `TrainState` (params, optimiser state, step, RNG), saved
  asynchronously, restored straight into the target shardings (so a run may
  resume on a different mesh);
- ``data``: the grain iterator state, one JSON file per process;
- ``meta``: the run's resolved config and its compatibility signature.

Saves are atomic: orbax writes into ``<step>.orbax-checkpoint-tmp-*`` and
renames the folder only once every item is complete, so a crash mid-save
leaves the previous steps untouched and a temporary folder that the next
start deletes (`cleanup_tmp_directories`). Retention keeps the last
`keep_checkpoints` steps, the best one by `best_metric` (an eval metric
name such as ``"eval/validation/exact_match"``, `best_mode` "max" or "min")
and the last one whose training loss was sane (`jattn.train.sanity`), so a
divergence never rotates every sane checkpoint out. A finished step is not
checked again by orbax; `jattn.train.recovery` skips one that fails to
restore.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as cm

from jattn.data import checkpoint as data_ckpt
from jattn.train import workdir as files
from jattn.train.config import ConfigError, config_to_dict, model_defaults
from jattn.train.sanity import SANE_STEP_METRIC

__all__ = [
    "COMPAT_KEYS",
    "SCHEDULE_KEYS",
    "check_compatible",
    "incompatibilities",
    "schedule_changes",
    "make_manager",
    "restore",
    "save",
    "save_bytes",
    "signature",
    "state_bytes",
]

CHECKPOINT_DIR = files.CHECKPOINTS

# Keys that fix the shapes of the state or the meaning of the data stream. A
# checkpoint saved under other values of these cannot continue this run.
COMPAT_KEYS = (
    "model",
    "dataset",
    "tokenizer",
    "vocab_size",
    "source_key",
    "target_key",
    "max_len",
    "pack",
    "batch_size",
    "seed",
    "optimizer",
)

# Keys of the learning-rate schedule. A checkpoint saved under other values can
# continue (the state has the same shapes), but the run then follows another
# schedule than the one it started with: refused unless the config says
# `allow_schedule_change=True`.
SCHEDULE_KEYS = ("num_train_steps", "schedule", "warmup_steps", "learning_rate")


def signature(config: ml_collections.ConfigDict | dict[str, Any]) -> dict[str, Any]:
    """The part of a config a checkpoint must agree with to be resumed.

    `input_len` is the effective training input row length (`max_input_len`,
    0 meaning `max_len`): it decides how examples pack into rows, so a run
    cannot continue its data stream under another value.
    """
    flat = config if isinstance(config, dict) else config_to_dict(config)
    sig = {k: flat.get(k) for k in COMPAT_KEYS}
    sig["gradient_clipping"] = bool((flat.get("grad_clip_norm") or 0) > 0)
    sig["input_len"] = flat.get("max_input_len") or flat.get("max_len")
    return sig


def schedule_changes(meta: dict[str, Any], config: ml_collections.ConfigDict) -> list[str]:
    """What differs in `SCHEDULE_KEYS` between a checkpoint's ``meta`` item (its
    ``config``) and `config`, one line each (none for a meta without a config)."""
    saved = meta.get("config") or {}
    return [
        f"{k}: checkpoint {saved[k]!r} != config {config[k]!r}"
        for k in SCHEDULE_KEYS
        if k in saved and saved[k] != config[k]
    ]


def incompatibilities(saved: dict[str, Any], config: ml_collections.ConfigDict) -> list[str]:
    """What differs between a checkpoint's saved signature and `config`'s, one
    line each. Signatures saved before inputs had their own row length lack
    `input_len`: their inputs used `max_len`, which is what they are given.
    Signatures saved before a model field existed lack it: the run used the
    field's default (`TransformerConfig` adds fields with the old behaviour
    as their default), which is what they are given."""
    saved = dict(saved)
    saved.setdefault("input_len", saved.get("max_len"))
    if isinstance(saved.get("model"), dict):
        saved["model"] = {**config_to_dict(model_defaults()), **saved["model"]}
    return _diff(saved, signature(config))


def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: checkpoint {a!r} != config {b!r}")
    return out


def _sane_step(metrics: dict[str, Any]) -> float:
    return float(metrics.get(SANE_STEP_METRIC, -1))


def make_manager(workdir: str, config: ml_collections.ConfigDict) -> ocp.CheckpointManager:
    """The run's CheckpointManager (creates `workdir/checkpoints`)."""
    mode = config.best_mode
    if mode not in ("max", "min"):
        raise ConfigError(f"best_mode={mode!r}: choose 'max' or 'min'")
    policies = [
        cm.LatestN(n=max(int(config.keep_checkpoints), 1)),
        # The last sane checkpoint survives a divergence (see `jattn.train.sanity`).
        cm.BestN(
            get_metric_fn=_sane_step,
            reverse=False,
            n=1,
            keep_checkpoints_without_metrics=False,
        ),
    ]
    if config.best_metric:
        name = config.best_metric
        sign = 1.0 if mode == "max" else -1.0
        policies.append(
            cm.BestN(
                get_metric_fn=lambda m: sign * float(m.get(name, float("-inf") * sign)),
                reverse=False,
                n=1,
                keep_checkpoints_without_metrics=False,
            )
        )
    options = ocp.CheckpointManagerOptions(
        preservation_policy=cm.AnyPreservationPolicy(policies),
        # With a best_fn orbax writes each step's metrics into the step (a `metrics`
        # item), so retention still knows them after a restart; `best_step()` is
        # then the last sane step.
        best_fn=_sane_step,
        enable_async_checkpointing=bool(config.async_checkpointing),
        cleanup_tmp_directories=True,
        create=True,
    )
    directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
    return ocp.CheckpointManager(directory, options=options)


def _vocabulary_changed(meta: dict[str, Any], vocab: str | None) -> str | None:
    saved = meta.get("vocab_sha256")
    if saved is None or vocab is None or saved == vocab:
        return None
    return f"tokenizer vocabulary: checkpoint {saved} != data set's {vocab}"


def saved_meta(mngr: ocp.CheckpointManager, step: int) -> dict[str, Any] | None:
    """The ``meta`` item of checkpoint `step` (None if it has none)."""
    path = os.path.join(str(mngr.directory), str(step), "meta", "metadata")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_compatible(
    mngr: ocp.CheckpointManager,
    workdir: str,
    config: ml_collections.ConfigDict,
    vocab: str | None = None,
) -> int | None:
    """Checks that the latest checkpoint in `workdir` can continue under `config`.

    `vocab` is the hash of the tokenizer's vocabulary
    (`jattn.data.tokenizers.vocab_hash`): the tokenizer's name is in the
    signature, its contents here (the same characters in another order are
    another experiment).

    Returns:
      The latest step, or None for a fresh workdir.

    Raises:
      ConfigError: one line listing what differs (the workdir is left alone); a
        changed `SCHEDULE_KEYS` value is refused unless
        `config.allow_schedule_change` is True.
    """
    step = mngr.latest_step()
    if step is None:
        return None
    meta = saved_meta(mngr, step)
    if meta is None:
        saved_config = files.read_json(os.path.join(workdir, files.CONFIG))
        if saved_config is None:
            return step
        meta = {"signature": signature(saved_config), "config": saved_config}
    diffs = incompatibilities(meta["signature"], config)
    diffs += [d for d in [_vocabulary_changed(meta, vocab)] if d]
    if diffs:
        raise ConfigError(
            f"workdir {workdir!r} holds a checkpoint (step {step}) of an incompatible config: "
            + "; ".join(diffs)
            + ". Use a new --workdir (nothing was overwritten)."
        )
    changes = schedule_changes(meta, config)
    if changes and not config.get("allow_schedule_change", False):
        raise ConfigError(
            f"workdir {workdir!r} holds a checkpoint (step {step}) trained under another "
            "schedule: " + "; ".join(changes) + ". Pass --config.allow_schedule_change=True "
            "to continue it under the new one, or use a new --workdir (nothing was overwritten)."
        )
    return step


def save(
    mngr: ocp.CheckpointManager,
    step: int,
    state: Any,
    data_iter: Any,
    config: ml_collections.ConfigDict,
    metrics: dict[str, float] | None = None,
    vocab: str | None = None,
    diverged: dict[str, str] | None = None,
) -> None:
    """Starts an (async) save of `state` and the data iterator at `step`.

    `metrics` are what retention ranks by (`best_metric`, `SANE_STEP_METRIC`);
    `vocab` (the tokenizer's vocabulary hash) is recorded in ``meta``, and so
    are the members of the program that diverged by `step` (``{str(key):
    message}``, `jattn.train.recovery.restore_members`), when there are any.
    """
    meta = {"config": config_to_dict(config), "signature": signature(config), "step": int(step)}
    if vocab is not None:
        meta["vocab_sha256"] = vocab
    if diverged:
        meta["diverged"] = dict(diverged)
    mngr.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=data_ckpt.save_args(data_iter),
            meta=ocp.args.JsonSave(meta),
        ),
        metrics=metrics,
        force=True,
    )


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state: Any, data_iter: Any) -> Any:
    """Restores checkpoint `step` into `abstract_state`'s shardings and `data_iter`.

    Args:
      abstract_state: the state as `jax.ShapeDtypeStruct` leaves with shardings.
      data_iter: a fresh iterator of the same loader; its position is set in place.

    Returns:
      The restored state.
    """
    try:
        restored = mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=data_ckpt.restore_args(data_iter),
            ),
        )
    except ValueError as e:
        if "process_" in str(e):
            raise ConfigError(
                f"checkpoint step {step} in {mngr.directory} was written by a different number "
                f"of processes ({e})"
            ) from None
        raise
    return restored.state


def state_bytes(abstract) -> int:
    """Bytes of a checkpoint's state (parameters, optimiser state), a save's size."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abstract))


def save_bytes(abstract) -> int:
    """The free space a save of `abstract` asks for: its bytes, a fifth more, and 1 MiB."""
    return int(1.2 * state_bytes(abstract)) + (1 << 20)
