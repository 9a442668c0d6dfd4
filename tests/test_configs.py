"""The shipped configs, experiments and documented commands in today's spelling.

Configs change spelling (the schemes' options moved from flat model fields
into `model.position_options.<scheme>.<option>`); a command a reader copies
from the docs must still run. So every `jattn train` / `jattn ablate`
command in README.md, docs/results.md and docs/schemes.md is parsed, its
config loaded and each ``--config.KEY=VALUE`` applied as the command line
applies it (an unknown key or a bad value fails here); every run of every
shipped experiment preset those commands name is checked as `jattn ablate`
checks it before training; and every config of configs/ builds its model at
every scheme variant. A saved config in the old spelling resumes.
"""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest
from test_structure import strip_fences

from jattn.analysis import grid
from jattn.models import SCHEMES
from jattn.train.config import (
    ConfigError,
    apply_overrides,
    build_model_config,
    check_config,
    config_to_dict,
    load_config,
)

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/results.md", "docs/schemes.md")
COMMAND = re.compile(r"jattn (train|ablate)\b[^\n`]*")


def _snippets(text: str) -> list[str]:
    """The code of a markdown text: each line of its fenced blocks, and each
    inline code span (a span may wrap over lines: its whitespace is joined)."""
    out = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        out += block.splitlines()
    out += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", strip_fences(text))]
    return out


def documented_commands(names=DOCS) -> list[tuple[str, str, str, list[tuple[str, str]]]]:
    """`(doc, kind, config spec, overrides)` of every `jattn train` / `jattn
    ablate` command in the docs `names` that names a config."""
    found = []
    for name in names:
        for snippet in _snippets((REPO / name).read_text(encoding="utf-8")):
            for match in COMMAND.finditer(snippet):
                words = shlex.split(match.group(0).split(" # ")[0])
                spec, overrides = None, []
                for i, word in enumerate(words):
                    if word == "--config" and i + 1 < len(words):
                        spec = words[i + 1]
                    elif word.startswith("--config.") and "=" in word:
                        key, value = word.removeprefix("--config.").split("=", 1)
                        overrides.append((key, value))
                if spec:
                    found.append((name, match.group(1), spec, overrides))
    return found


COMMANDS = documented_commands()


def test_the_docs_have_the_commands_this_file_checks():
    kinds = {(doc, kind) for doc, kind, _, _ in COMMANDS}
    assert {("README.md", "train"), ("README.md", "ablate"), ("docs/results.md", "ablate")} <= kinds
    assert any(o for doc, _, _, o in COMMANDS if doc == "docs/results.md")  # with overrides
    assert any(o for doc, _, _, o in COMMANDS if doc == "docs/schemes.md")


def test_the_parser_reads_wrapped_spans_fences_and_comments():
    text = (
        "Run `jattn ablate --config\nexperiments/x.py:long --config.grid.seed.values=0,1`.\n"
        "```bash\njattn train --config configs/a.py --config.model.d_model=8  # width\n```\n"
    )
    spans = _snippets(text)
    assert "jattn ablate --config experiments/x.py:long --config.grid.seed.values=0,1" in spans
    assert "jattn train --config configs/a.py --config.model.d_model=8  # width" in spans


@pytest.mark.parametrize(
    "doc, kind, spec, overrides", COMMANDS, ids=[f"{c[0]}:{c[2]}" for c in COMMANDS]
)
def test_every_documented_command_names_keys_its_config_has(doc, kind, spec, overrides):
    config = load_config(str(REPO / spec))
    if kind == "train":
        apply_overrides(config, overrides)
        check_config(config)
        return
    exp = grid.apply_experiment_overrides(config, overrides, str(REPO))
    runs = grid.expand(exp, "/nonexistent")
    assert runs
    grid.checked_configs(exp, runs, str(REPO))  # every run's keys and values, as ablate checks


# A config that needs an argument, with one (the task).
ARGUMENTS = {"chomsky.py": "chomsky.py:reverse_string"}


@pytest.mark.parametrize("path", sorted(p.name for p in (REPO / "configs").glob("[!_]*.py")))
def test_every_config_builds_its_model_at_every_scheme(path):
    for position in SCHEMES:
        config = load_config(str(REPO / "configs" / ARGUMENTS.get(path, path)))
        config.model.position = position
        try:
            build_model_config(config)
        except ConfigError as e:  # a scheme the config's architecture cannot run
            assert "causal-only" in str(e) or "max_len" in str(e), e


def test_an_old_model_key_on_the_command_line_names_its_new_key():
    config = load_config(str(REPO / "configs" / "smoke.py"))
    with pytest.raises(ConfigError) as err:
        apply_overrides(config, [("model.rope_scaling", "yarn")])
    assert str(err.value) == (
        "--config.model.rope_scaling: model.rope_scaling is now "
        "model.position_options.rope.scaling (the scheme's own options)"
    )
    with pytest.raises(ConfigError, match=r"is now model.position_options.rope.max_timescale and "):
        apply_overrides(config, [("model.rope_max_timescale", "500")])
    apply_overrides(config, [("model.position_options.rope.scaling", "yarn")])
    assert build_model_config(config).position_options["rope"].scaling == "yarn"


def test_a_checkpoint_saved_with_the_flat_scheme_fields_resumes_under_the_new_spelling():
    """A run saved before the schemes carried their options has a flat model
    config in its checkpoint's signature: it continues under today's config
    with the same values, and is refused (naming the key) under others."""
    from jattn.models.config import RENAMED  # noqa: PLC0415
    from jattn.train.resume_keys import incompatibilities, signature  # noqa: PLC0415

    config = load_config(str(REPO / "configs" / "smoke.py"))
    config.model.position = "t5"
    config.model.position_options.t5.num_buckets = 16
    saved = signature(config)
    model = saved["model"]
    options = model.pop("position_options")
    # The flat spelling of the same values, as a checkpoint of the old code saved it.
    model["t5_num_buckets"] = options["t5"]["num_buckets"]
    model["rope_max_timescale"] = options["rope"]["max_timescale"]
    model["max_relative_distance"] = options["shaw"]["max_distance"]
    assert {"t5_num_buckets", "rope_max_timescale"} <= set(RENAMED)
    assert incompatibilities(saved, config) == []
    other = load_config(str(REPO / "configs" / "smoke.py"))
    other.model.position = "t5"
    assert incompatibilities(saved, other) == [
        "model.position_options.t5.num_buckets: checkpoint 16 != config 32"
    ]
    assert config_to_dict(config)["model"]["position_options"]["t5"]["num_buckets"] == 16


def test_tensorboard_hparams_name_each_scheme_option():
    """A scheme's options are nested groups; TensorBoard's table gets one column each."""
    from jattn.train.metrics import flat_hparams  # noqa: PLC0415

    config = load_config(str(REPO / "configs" / "smoke.py"))
    config.model.position_options.rope.yarn.convention = "hf"
    flat = flat_hparams(config_to_dict(config))
    assert flat["model.position_options.rope.yarn.convention"] == "hf"
    assert flat["model.position_options.t5.num_buckets"] == 32
    assert flat["model.d_model"] == 32 and "model.position_options" not in flat
