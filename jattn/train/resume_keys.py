"""Which config keys a resumed run may change, and how a change is told.

A resume compares every key of the config with the checkpoint's saved config
(`jattn.train.checkpoints.check_compatible`, and `check_saved_config` before
the data set is even loaded):

- `COMPAT_KEYS` fix the state's shapes or the data stream: never changed
  (the saved `signature` holds them);
- `SCHEDULE_KEYS` change the learning-rate schedule: only with
  `allow_schedule_change=True` (or named in `allow_config_change`);
- `RESUME_SAFE_KEYS` change no training step: freely (and so may the model
  fields of `MODEL_RESUME_SAFE_KEYS`, which change a step at most in rounding);
- any other key changes the optimisation (a loss, an optimiser constant):
  only when `allow_config_change` names it (`config_changes` finds them).

Keys a checkpoint's saved config lacks (added to jattn after it was saved)
are not compared. Nothing here reads a checkpoint: these are pure functions
of two configs, each a plain dict (a run's `Parts.record`, a checkpoint's
saved config) or, from a caller outside a run, a `ConfigDict`.
"""

from __future__ import annotations

import difflib
from typing import Any

import ml_collections

from jattn.train.parts import ConfigError, config_to_dict, model_defaults

__all__ = [
    "COMPAT_KEYS",
    "MODEL_RESUME_SAFE_KEYS",
    "RESUME_SAFE_KEYS",
    "SCHEDULE_KEYS",
    "allowed_changes",
    "check_allowed_changes",
    "config_changes",
    "incompatibilities",
    "schedule_changes",
    "signature",
]

# Keys that fix the shapes of the state or the meaning of the data stream. A
# checkpoint saved under other values of these cannot continue this run
# (`vocab_multiple` rounds the model's vocabulary: another value may give the
# embedding another shape).
COMPAT_KEYS = (
    "model",
    "dataset",
    "tokenizer",
    "vocab_size",
    "vocab_multiple",
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
# `allow_schedule_change=True` (or names the key in `allow_config_change`).
SCHEDULE_KEYS = ("num_train_steps", "schedule", "warmup_steps", "learning_rate")

# Keys a resumed run may change freely: where the data lies (its contents are
# checked by the data set's manifest and the vocabulary's hash), how the run is
# sharded (a checkpoint restores into any mesh), how often it logs, evaluates
# and saves, what it evaluates and decodes, which checkpoints it keeps, where
# it reports, and the two flags below. None of them changes a training step.
# (A saved config's keys this jattn no longer has, such as an earlier release's
# `seeds`, are not compared: `config_changes`.)
RESUME_SAFE_KEYS = (
    "data_dir",
    "mesh_shape",
    "logical_axis_rules",
    "eval_every_steps",
    "eval_splits",
    "eval_batch_size",
    "eval_max_len",
    "eval_max_input_len",
    "eval_max_batches",
    "eval_decode_examples",
    "decode",
    "beam_size",
    "beam_alpha",
    "decode_max_len",
    "checkpoint_every_steps",
    "keep_checkpoints",
    "best_metric",
    "best_mode",
    "async_checkpointing",
    "log_every_steps",
    "progress_bar",
    "wandb",
    "wandb_project",
    "allow_schedule_change",
    "allow_config_change",
)

# Model fields a resumed run may change freely: they fix no shape and no data,
# and change a step's arithmetic at most in float32 rounding (the signature
# leaves them out of its `model`).
MODEL_RESUME_SAFE_KEYS = ("attention_assume_finite",)

# Keys the signature compares by their effect: `max_input_len` 0 and
# `max_input_len` = `max_len` are the same rows (`input_len`).
_BY_SIGNATURE = ("max_input_len",)


Config = ml_collections.ConfigDict | dict[str, Any]


def _plain(config: Config) -> dict[str, Any]:
    return config if isinstance(config, dict) else config_to_dict(config)


def signature(config: Config) -> dict[str, Any]:
    """The part of a config a checkpoint must agree with to be resumed.

    `input_len` is the effective training input row length (`max_input_len`,
    0 meaning `max_len`): it decides how examples pack into rows, so a run
    cannot continue its data stream under another value.
    """
    flat = _plain(config)
    sig = {k: flat.get(k) for k in COMPAT_KEYS}
    if isinstance(sig["model"], dict):
        sig["model"] = _model_signature(sig["model"])
    sig["gradient_clipping"] = bool((flat.get("grad_clip_norm") or 0) > 0)
    sig["input_len"] = flat.get("max_input_len") or flat.get("max_len")
    return sig


def _model_signature(model: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model.items() if k not in MODEL_RESUME_SAFE_KEYS}


def allowed_changes(config: Config) -> set[str]:
    """The keys `allow_config_change` names."""
    return set(config.get("allow_config_change", ()) or ())


def schedule_changes(meta: dict[str, Any], config: Config) -> dict[str, str]:
    """What differs in `SCHEDULE_KEYS` between a checkpoint's ``meta`` item (its
    ``config``) and `config`: ``{key: "key: checkpoint A != config B"}`` (none
    for a meta without a config)."""
    saved = meta.get("config") or {}
    return {
        k: f"{k}: checkpoint {saved[k]!r} != config {config[k]!r}"
        for k in SCHEDULE_KEYS
        if k in saved and saved[k] != config[k]
    }


def config_changes(meta: dict[str, Any], config: Config) -> dict[str, str]:
    """Every top-level key outside `COMPAT_KEYS`, `SCHEDULE_KEYS` and
    `RESUME_SAFE_KEYS` whose value differs between a checkpoint's saved config
    (``meta["config"]``) and `config`: ``{key: "key: checkpoint A != config B"}``.

    Only keys the saved config has are compared (a key added to jattn since
    the checkpoint was saved has nothing to compare with); a meta without a
    config compares nothing.
    """
    saved = meta.get("config") or {}
    now = _plain(config)
    skip = set(COMPAT_KEYS) | set(SCHEDULE_KEYS) | set(RESUME_SAFE_KEYS) | set(_BY_SIGNATURE)
    return {
        k: f"{k}: checkpoint {saved[k]!r} != config {now[k]!r}"
        for k in sorted(saved)
        if k not in skip and k in now and saved[k] != now[k]
    }


def check_allowed_changes(config: Config) -> None:
    """`allow_config_change` names top-level keys a resume may change.

    Raises:
      ConfigError: a name that is not a config key, or a key that can never
        change (`COMPAT_KEYS`) or never needs allowing (`RESUME_SAFE_KEYS`).
    """
    keys = list(config.keys())
    for name in config.get("allow_config_change", ()) or ():
        if name not in keys:
            close = difflib.get_close_matches(str(name), keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"config.allow_config_change: {name!r} is not a config key{hint}")
        if name in COMPAT_KEYS or name in _BY_SIGNATURE:
            raise ConfigError(
                f"config.allow_config_change: {name!r} fixes the state's shapes or the data "
                "stream and cannot change on resume; use a new --workdir"
            )
        if name in RESUME_SAFE_KEYS:
            raise ConfigError(
                f"config.allow_config_change: {name!r} may change on resume without it; "
                "leave it out"
            )


def incompatibilities(
    saved: dict[str, Any],
    config: Config,
    saved_config: dict[str, Any] | None = None,
) -> list[str]:
    """What differs between a checkpoint's saved signature and `config`'s, one
    line each. Signatures saved before inputs had their own row length lack
    `input_len`: their inputs used `max_len`, which is what they are given.
    Signatures saved before a model field existed lack it: the run used the
    field's default (`TransformerConfig` adds fields with the old behaviour
    as their default), which is what they are given. Signatures saved before a
    key joined `COMPAT_KEYS` lack it: it is read from the checkpoint's saved
    config (`saved_config`), and not compared when that lacks it too."""
    saved = dict(saved)
    saved.setdefault("input_len", saved.get("max_len"))
    now = signature(config)
    for key in COMPAT_KEYS:
        if key not in saved:
            saved[key] = (saved_config or {}).get(key, now[key])
    if isinstance(saved.get("model"), dict):
        saved["model"] = _model_signature(_with_defaults(saved["model"]))
    return _diff(saved, now)


def _with_defaults(model: dict[str, Any]) -> dict[str, Any]:
    """A saved model config in today's spelling (`upgrade_saved`: the schemes'
    options moved into `position_options`), every field it lacks at its
    default, `position_options` merged key by key."""
    from jattn.models.config import upgrade_saved  # noqa: PLC0415

    model = upgrade_saved(model)
    defaults = config_to_dict(model_defaults())
    options = defaults["position_options"]
    for key, given in (model.get("position_options") or {}).items():
        options[key] = _merged(options.get(key, {}), given)
    return {**defaults, **model, "position_options": options}


def _merged(base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in given.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def _diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: checkpoint {a!r} != config {b!r}")
    return out
