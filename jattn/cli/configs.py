"""`jattn configs`: what there is to run.

    jattn configs
    jattn configs --paths [FILE[:VARIANT,...] ...]

Lists the training configs (``configs/*.py``, with the data set, steps and
positional scheme each sets), the ``:VARIANT`` items every config built with
`jattn.train.apply_variant` takes, the data sets ``config.dataset`` may name,
the experiment files of `jattn ablate` (``experiments/*.py``) and the
benchmark scripts (``benchmarks/*.py``, run from a checkout). Files are looked up in the current
directory, then in the checkout jattn was installed from.

``--paths`` prints instead which attention path each config's training takes
on this machine: `implementation=None`'s rule (`jattn.attention.rule`) for
every attention call of its model at its training shapes, traced with
`jax.eval_shape` (nothing compiled or run; no data read). The GPU window's
probe runs it, so a GPU says what `jattn train` would run there.
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Sequence
from pathlib import Path

from jattn.cli.common import checkout_root, normalize_flags

__all__ = ["attention_paths", "configs_command", "describe"]

PROG = "jattn configs"


def _root(folder: str) -> Path:
    """The current directory when it has `folder`, else the jattn checkout."""
    here = Path.cwd()
    return here if (here / folder).is_dir() else checkout_root()


def _first_line(path: Path) -> str:
    """The first line of a python file's module docstring ("" if none or unreadable)."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    except (OSError, SyntaxError, ValueError):
        return ""
    return (doc or "").strip().splitlines()[0] if doc else ""


def _rel(path: Path) -> str:
    """`path` relative to the current directory when it is below it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _config_files(root: Path) -> list[Path]:
    """The training configs: `configs/*.py` not starting with `_` (their helpers)."""
    return sorted(p for p in (root / "configs").glob("*.py") if not p.name.startswith("_"))


def _config_lines(root: Path) -> list[str]:
    from jattn.train.config import ConfigError, load_config  # noqa: PLC0415

    lines = ["configs  (jattn train --config FILE[:VARIANT,...]):"]
    files = _config_files(root)
    for path in files:
        try:
            c = load_config(str(path))
            facts = f"dataset {c.dataset}, {c.num_train_steps} steps, position {c.model.position}"
        except (ConfigError, AttributeError, KeyError) as e:
            facts = f"does not load: {e}"
        takes = "apply_variant" in path.read_text()
        lines.append(f"  {_rel(path)}")
        lines.append(f"      {_first_line(path)}")
        lines.append(f"      {facts}" + ("; takes :VARIANT" if takes else ""))
    if not files:
        lines.append(f"  none found in {root / 'configs'}")
    return lines


def _variant_lines() -> list[str]:
    from jattn.attention import IMPLEMENTATIONS  # noqa: PLC0415
    from jattn.models import SCHEMES  # noqa: PLC0415

    return [
        "variants  (comma-separated after ':', e.g. configs/numbers.py:rope,chunked):",
        f"  position:  {', '.join(sorted(SCHEMES))}",
        f"  attention: {', '.join(sorted(IMPLEMENTATIONS))}",
        "  other:     bf16 (bfloat16 compute), greedy, beam (decoding)",
    ]


def _dataset_lines() -> list[str]:
    lines = ["datasets  (--config.dataset=NAME[/CONFIG]):"]
    try:
        from jattn.data.registry import BUILDERS  # noqa: PLC0415
    except ImportError as e:  # the data stack is optional for this listing
        return [*lines, f"  (jattn.data does not import here: {e})"]
    for name, (cls, default) in BUILDERS.items():
        configs = [c.name for c in cls.BUILDER_CONFIGS]
        doc = (cls.__doc__ or "").strip().splitlines()
        lines.append(f"  {name}/{{{','.join(configs)}}}  (default {default})")
        if doc:
            lines.append(f"      {doc[0]}")
    lines.append("  or a tfds translation data set, e.g. wmt14_translate/de-en (configs/base.py)")
    return lines


def _experiment_lines(root: Path) -> list[str]:
    lines = ["experiments  (jattn ablate --config FILE[:PRESET]):"]
    folder = root / "experiments"
    files = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    for path in files:
        lines.append(f"  {_rel(path)}")
        lines.append(f"      {_first_line(path)}")
    if not files:
        lines.append(f"  none found in {folder}")
    return lines


def _bench_lines(root: Path) -> list[str]:
    """The benchmark scripts: `benchmarks/*.py` not starting with `_` (their helpers)."""
    names = sorted(p.stem for p in (root / "benchmarks").glob("*.py") if not p.name.startswith("_"))
    return [f"benchmarks  (python benchmarks/NAME.py): {', '.join(names) or 'none found'}"]


def describe() -> str:
    """The text `jattn configs` prints."""
    parts = [
        _config_lines(_root("configs")),
        _variant_lines(),
        _dataset_lines(),
        _experiment_lines(_root("experiments")),
        _bench_lines(_root("benchmarks")),
    ]
    return "\n\n".join("\n".join(p) for p in parts)


def attention_paths(config) -> list[str]:
    """`rule.announce`'s line for each distinct path of `config`'s training
    attention calls on jax's default backend: the model initialised, then
    applied with ``train=True`` (dropout and all), under `jax.eval_shape` at
    ``[batch_size, max_input_len]`` inputs and ``[batch_size, max_len]``
    targets. The vocabulary is a placeholder (256): it shapes no attention."""
    import jax  # noqa: PLC0415 -- jax only for --paths
    import jax.numpy as jnp  # noqa: PLC0415

    from jattn.attention import rule  # noqa: PLC0415
    from jattn.models import Transformer  # noqa: PLC0415
    from jattn.train.config import build_model_config, input_lengths  # noqa: PLC0415

    model = Transformer(build_model_config(config, tokenizer_vocab=256))
    rows, key = config.batch_size, jax.random.key(0)
    inputs = jax.ShapeDtypeStruct((rows, input_lengths(config)[0]), jnp.int32)
    targets = jax.ShapeDtypeStruct((rows, config.max_len), jnp.int32)
    with rule.collected_paths() as lines:
        init = lambda i, t: model.init({"params": key}, i, t, train=False)["params"]
        params = jax.eval_shape(init, inputs, targets)
        apply = lambda p, i, t: model.apply({"params": p}, i, t, train=True, rngs={"dropout": key})
        jax.eval_shape(apply, params, inputs, targets)
    return lines


def paths_text(specs: Sequence[str]) -> str:
    """What `jattn configs --paths` prints: each config (default: every
    ``configs/*.py`` as it loads with no variant), then its paths' lines."""
    import jax  # noqa: PLC0415

    from jattn.train.config import ConfigError, load_config  # noqa: PLC0415

    specs = list(specs) or [_rel(p) for p in _config_files(_root("configs"))]
    out = [f"attention paths of training on {jax.default_backend()} ({jax.devices()[0]}):"]
    for spec in specs:
        out.append(f"  {spec}")
        try:
            config = load_config(spec)
        except ConfigError as e:
            out.append(f"      does not load: {str(e).splitlines()[0][:300]}")
            continue
        try:
            out += [f"      {line}" for line in attention_paths(config)] or ["      (none)"]
        except (ValueError, TypeError, KeyError) as e:
            out.append(f"      cannot trace: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    return "\n".join(out)


def configs_command(argv: Sequence[str]) -> int:
    """`jattn configs`: prints the listing (or, with ``--paths``, each config's
    attention paths), returns 0."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--paths",
        nargs="*",
        metavar="CONFIG",
        help="the attention path each config's training takes here (default: every config)",
    )
    args = parser.parse_args(normalize_flags(argv))
    print(describe() if args.paths is None else paths_text(args.paths))
    return 0
