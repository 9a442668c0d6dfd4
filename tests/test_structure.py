"""The package's structure, read from the source with `ast` (nothing is imported).

Three rules of docs/design.md's house style, checked over jattn/, benchmarks/ and
experiments/ (the second also over tests/):

- no import cycle between jattn modules. Every import counts, a deferred one
  (inside a function) as much as one at module level: a deferred import only
  postpones a cycle to the first call (that is how `loop -> seed_loop -> loop`
  hid), so a cycle through one fails too. The parent packages a module import
  runs on the way (`jattn/train/__init__.py` for `jattn.train.loop`) are not
  edges; importing a package's `__init__` by name (`from jattn.train import
  ConfigError`) is. Imports under `if TYPE_CHECKING:` never run and are not edges.
- no private name (`_x`) imported across modules: neither ``from jattn.m import
  _x`` nor ``m._x`` on a jattn module bound by an import.
- the core (jattn/*.py and jattn/attention/) imports, at module level, no
  flax, optax, orbax, tfds, grain or ml_collections and no jattn module above
  it (models, train, data, analysis, cli): `import jattn` runs exactly those
  imports. A deferred import of flax is allowed (`flax_attention_fn` asks
  flax for `nnx` only when a flax module records the weights).

The last tests feed the checker small made-up packages, so each rule is seen
to fail on what it forbids. The guards further down follow the same pattern:
models picked by architecture, scheme options in their schemes, one einsum
legend, the README's shape, the docs' links naming a file and a heading there,
every module opening on what it holds, import
aliases that read as their modules, files over 500 lines split or saying why;
and two that run one training step: the modules from the command to the loss,
and the run's config read once, at the top, by the config modules alone.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SCANNED = ("jattn", "benchmarks", "experiments")
HEAVY = ("flax", "optax", "orbax", "tensorflow_datasets", "tfds", "grain", "ml_collections")
ABOVE_CORE = ("jattn.models", "jattn.train", "jattn.data", "jattn.analysis", "jattn.cli")


@dataclasses.dataclass(frozen=True)
class Import:
    """One imported module (and, for ``from m import name``, the name) of a file."""

    source: str  # the importing module, e.g. "jattn.train.loop"
    target: str  # the imported module, e.g. "jattn.train.steps"
    name: str | None  # the imported name when it is not a module, e.g. "ConfigError"
    deferred: bool  # inside a function or method
    line: int


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_modules(root: pathlib.Path, tops=SCANNED) -> dict[str, tuple[pathlib.Path, ast.Module]]:
    """Module name -> (path relative to `root`, parsed source), for every .py under
    `root`/`tops`."""
    out = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            out[module_name(path, root)] = (path.relative_to(root), tree)
    return out


def _absolute(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = source.split(".") if is_package else source.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): its body never runs."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(tree: ast.AST, deferred: bool = False):
    """Every node that runs, with whether it sits inside a function (the bodies of
    `if TYPE_CHECKING:` blocks are left out: annotations only, never imported)."""
    for child in ast.iter_child_nodes(tree):
        if _type_checking_only(child):
            for other in child.orelse:
                yield other, deferred
                yield from _walk(other, deferred)
            continue
        yield child, deferred
        inner = deferred or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _walk(child, inner)


def imports(modules) -> list[Import]:
    """Every import of a jattn module in `modules`, resolved to the module it loads."""
    out = []
    for source, (path, tree) in modules.items():
        is_package = path.name == "__init__.py"
        for node, deferred in _walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    out.append(Import(source, alias.name, None, deferred, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(source, is_package, node)
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:  # `from pkg import module`
                        out.append(Import(source, sub, None, deferred, node.lineno))
                    else:
                        out.append(Import(source, target, alias.name, deferred, node.lineno))
    return out


def cycles(modules, edges: list[Import]) -> list[list[str]]:
    """The import cycles among `modules` (each once, as a path that returns to its start)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        if e.source in graph and e.target in graph and e.target != e.source:
            graph[e.source].add(e.target)
    found, state = [], {}  # state: 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return found


def private_imports(modules, edges: list[Import]) -> list[str]:
    """``file:line name`` for every private jattn name used outside its module."""
    out = [
        f"{modules[e.source][0]}:{e.line} from {e.target} import {e.name}"
        for e in edges
        if e.name
        and e.name.startswith("_")
        and not e.name.startswith("__")
        and e.target.startswith("jattn")
        and e.target != e.source
    ]
    for source, (path, tree) in modules.items():
        bound = {}  # local name -> the jattn module it names
        for node, _ in _walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("jattn") and a.asname:
                        bound[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(source, path.name == "__init__.py", node)
                for a in node.names:
                    if f"{target}.{a.name}" in modules:
                        bound[a.asname or a.name] = f"{target}.{a.name}"
        for node, _ in _walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and bound[node.value.id] != source
            ):
                out.append(f"{path}:{node.lineno} {bound[node.value.id]}.{node.attr}")
    return out


def core_violations(modules, edges: list[Import]) -> list[str]:
    """Module-level imports of the core that `import jattn` must not need."""
    out = []
    for e in edges:
        if not is_core(modules, e.source) or e.deferred:
            continue
        top = e.target.split(".")[0]
        if top in HEAVY or any(e.target == a or e.target.startswith(a + ".") for a in ABOVE_CORE):
            out.append(f"{e.source}:{e.line} imports {e.target}")
    return out


def is_core(modules, name: str) -> bool:
    """jattn/__init__.py, a jattn/*.py module, or anything in jattn/attention/."""
    path = modules[name][0]
    return path.parts[0] == "jattn" and (len(path.parts) == 2 or path.parts[1] == "attention")


def load(root: pathlib.Path, tops=SCANNED):
    modules = read_modules(root, tops)
    return modules, imports(modules)


@pytest.fixture(scope="module")
def repo():
    return load(REPO)


def test_no_import_cycle_between_jattn_modules(repo):
    modules, edges = repo
    jattn_modules = {m: v for m, v in modules.items() if m.split(".")[0] == "jattn"}
    found = cycles(jattn_modules, edges)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_private_name_is_imported_across_modules(repo):
    found = private_imports(*repo)
    assert not found, "private names used outside their module:\n" + "\n".join(found)


def test_the_tests_use_no_private_jattn_name():
    """The tests hold jattn to its public names too (kernel-level ones such as
    `flash_attention.flash_core` are public in their module), so a refactor
    that keeps the public API keeps the tests."""
    found = private_imports(*load(REPO, (*SCANNED, "tests")))
    assert not found, "private jattn names used by tests:\n" + "\n".join(found)


def test_the_core_imports_no_flax_optax_orbax_tfds_grain_or_ml_collections(repo):
    modules, edges = repo
    assert "jattn.attention.xla" in modules and "jattn.masks" in modules  # the core is scanned
    found = core_violations(modules, edges)
    assert not found, "the core imports what `import jattn` must not need:\n" + "\n".join(found)


def test_every_jattn_import_names_a_module_that_exists(repo):
    """The checker resolves what it reads: a typo'd or moved module would be an edge to
    nothing, and a cycle through it would go unseen."""
    modules, edges = repo
    missing = sorted(
        {f"{e.source}:{e.line} {e.target}" for e in edges if e.target.startswith("jattn")}
        - {f"{e.source}:{e.line} {e.target}" for e in edges if e.target in modules}
    )
    assert not missing, missing


# -- the checker fails on what it forbids -----------------------------------------------


def _package(tmp_path: pathlib.Path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return load(tmp_path, ("jattn",))


def test_the_checker_finds_a_cycle_hidden_by_a_deferred_import(tmp_path):
    modules, edges = _package(
        tmp_path,
        {
            "jattn/__init__.py": "",
            "jattn/train/__init__.py": "",
            "jattn/train/loop.py": "def run():\n    from jattn.train import seeds\n",
            "jattn/train/seeds.py": "from jattn.train.loop import run\n",
            "jattn/train/other.py": "from jattn.train import seeds\n",
        },
    )
    assert cycles(modules, edges) == [["jattn.train.loop", "jattn.train.seeds", "jattn.train.loop"]]


def test_an_import_for_type_annotations_only_is_no_cycle(tmp_path):
    header = "from typing import TYPE_CHECKING\n"
    modules, edges = _package(
        tmp_path,
        {
            "jattn/__init__.py": "",
            "jattn/models/__init__.py": "",
            "jattn/models/config.py": "from jattn.models.schemes import get\n",
            "jattn/models/schemes.py": header
            + "if TYPE_CHECKING:\n    from jattn.models.config import Config\n",
            "jattn/models/other.py": header
            + "if TYPE_CHECKING:\n    pass\nelse:\n    from jattn.models.config import Config\n",
        },
    )
    assert cycles(modules, edges) == []
    assert [(e.source, e.target) for e in edges if e.target == "jattn.models.config"] == [
        ("jattn.models.other", "jattn.models.config")
    ]


def test_the_checker_finds_private_names_imported_or_used_across_modules(tmp_path):
    modules, edges = _package(
        tmp_path,
        {
            "jattn/__init__.py": "",
            "jattn/a.py": "def _helper(): ...\ndef ok(): return _helper()\n",
            "jattn/b.py": "from jattn.a import _helper, ok\n",
            "jattn/c.py": "from jattn import a as one\n\ndef f():\n    return one._helper()\n",
        },
    )
    assert sorted(private_imports(modules, edges)) == [
        "jattn/b.py:1 from jattn.a import _helper",
        "jattn/c.py:4 jattn.a._helper",
    ]


def test_the_checker_finds_flax_and_upper_layers_in_the_core(tmp_path):
    modules, edges = _package(
        tmp_path,
        {
            "jattn/__init__.py": "import jax\n",
            "jattn/masks.py": "import flax.linen as nn\n",
            "jattn/attention/__init__.py": "from jattn.train import config\n",
            "jattn/lazy.py": "def f():\n    from flax import nnx\n",  # deferred: allowed
            "jattn/train/__init__.py": "",
            "jattn/train/config.py": "import ml_collections\n",  # not the core: allowed
        },
    )
    assert sorted(core_violations(modules, edges)) == [
        "jattn.attention:1 imports jattn.train.config",
        "jattn.masks:1 imports flax.linen",
    ]


def test_no_function_in_train_is_over_80_lines(repo):
    """The training package reads top to bottom: one loop (`jattn.train.loop.drive`),
    and no stage of the program longer than a screenful."""
    modules, _ = repo
    long = [
        f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, (path, tree) in modules.items()
        if name.startswith("jattn.train.")
        for node, _ in _walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long, long


def test_the_attention_layers_call_reads_in_a_screenful(repo):
    """Issue 51: `Attention.__call__` (89 lines before the models were split) stays
    under 80; its pieces are pure functions beside it."""
    modules, _ = repo
    _, tree = modules["jattn.models.attention_layer"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Attention")
    call = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__call__")
    assert call.end_lineno - call.lineno + 1 < 80


def test_a_step_from_the_command_to_the_loss_opens_at_most_6_modules(tmp_path, monkeypatch):
    """Issues 34 and 51's measure of a readable training path: the jattn modules on
    the call stack when `jattn train` (one step of the smoke config) reaches the
    loss (`jattn.train.steps.cross_entropy`); today `cli/__init__`, `cli/train`,
    `train/run`, `train/loop`, `train/steps` (docs/training.md, "From `jattn
    train` to the loss")."""
    import inspect  # noqa: PLC0415

    import jattn.cli  # noqa: PLC0415
    from jattn.train import steps  # noqa: PLC0415

    stacks = []
    cross_entropy = steps.cross_entropy

    def spy(*args, **kwargs):
        files = [f.filename for f in inspect.stack()]
        stacks.append(sorted({f.split("/jattn/", 1)[1] for f in files if "/jattn/" in f}))
        return cross_entropy(*args, **kwargs)

    monkeypatch.setattr(steps, "cross_entropy", spy)
    status = jattn.cli.main(
        ["train", "--config", str(REPO / "configs" / "smoke.py"), "--workdir", str(tmp_path),
         "--config.num_train_steps=1", "--config.eval_every_steps=1",
         "--config.checkpoint_every_steps=1", "--config.eval_splits=()",
         "--config.best_metric=", "--config.progress_bar=false", "--compilation-cache-dir="]
    )  # fmt: skip
    assert status == 0 and stacks
    assert "cli/train.py" in stacks[0] and "train/steps.py" in stacks[0], stacks[0]
    assert len(stacks[0]) <= 6, stacks[0]


# The modules that may read a run's `ml_collections.ConfigDict`: where it is checked
# (`checks`) and read, once, into the pieces the run's parts take (`config.read_parts`,
# `parts`). Issue 51: followed from `train_and_evaluate` it was handed to 12 modules
# (39 stops, 27 of them returns to a module it had left) and read in 11 (31 stops).
CONFIG_READERS = {"jattn.train.config", "jattn.train.checks", "jattn.train.parts"}


def test_the_run_config_is_read_once_at_the_top(tmp_path):
    """Followed from `train_and_evaluate` (one step of configs/smoke.py that evaluates,
    decodes and saves), the ConfigDict is read only by `CONFIG_READERS`, in one pass
    (no return to a module it had left), and handed to no other function but
    `train_and_evaluate` itself; every other module takes the piece it reads
    (`jattn.train.parts`). The tracer is tests/config_reads.py."""
    from config_reads import smoke_config, traced_calls, traced_reads  # noqa: PLC0415

    from jattn.train import train_and_evaluate  # noqa: PLC0415
    from jattn.train.resume_keys import allowed_changes  # noqa: PLC0415

    config = smoke_config()
    with traced_reads(config) as reads, traced_calls(config) as calls:
        final = train_and_evaluate(config, str(tmp_path))
    assert final["step"] == 1 and "eval/validation/exact_match" in final
    assert set(reads.readers) <= CONFIG_READERS, reads.summary() + f": {reads.readers}"
    assert reads.returns == 0 and "jattn.train.config" in reads.readers, reads.stops
    assert set(calls.readers) <= CONFIG_READERS | {"jattn.train.run"}, calls.readers
    assert calls.stops.count("jattn.train.run") == 1, calls.stops  # train_and_evaluate
    # The tracer sees a read anywhere else in jattn, and the function it is handed to.
    with traced_reads(config) as reads, traced_calls(config) as calls:
        allowed_changes(config)
    assert reads.readers == calls.readers == ["jattn.train.resume_keys"]


def test_train_has_at_most_20_files():
    """One run, one process: `jattn/train/` stays a package one reads in an afternoon
    (issue 34)."""
    files = sorted(p.name for p in (REPO / "jattn" / "train").glob("*.py"))
    assert len(files) <= 20, files


# -- the lab outside the library: the benchmarks share one harness ---------------------

# Issue 51's budget. The Mosaic GPU AOT target and window cells took benchmarks/ to 3,124
# lines; the GPU window's separate host-data child gave way to the loop's own
# `train/input_wait_ms` and score_mod.py's one-off `--tile-pieces` was retired (2,999).
# Issue 50's ALiBi and T5 headline cells (their <= 1.3x goal had no cell; T5's with its
# table's gradient, as training has it) took it to 3,011; its float64 gate's missing cells
# (KERPLE and Shaw's bias, score mods per logit at training's packed shape, cuDNN with a
# window, lengths, a mask and a bias: what the rule sends it) to 3,051. Cells, not harness.
# gpu.py's and score_mod.py's `--only` refusing a name that matches no cell (a window's
# renamed cell was dropped silently): 3,058. train.py's arms of other schemes (their
# parameters differ, and comparing the states crashed the table): 3,061. attention.py's
# CoPE's two forms with the lookup by gathers, the peers of the flat lookup's speed: 3,067.
# attention.py's Shaw cells with the key term read by take_along_axis, the peers of
# `scores.rel_gather`'s own derivative: 3,072.
BENCHMARK_LINES = 3072


def benchmark_lines(root: pathlib.Path = REPO) -> int:
    """Lines of `benchmarks/**/*.py`, as `find benchmarks -name '*.py' | xargs wc -l` counts."""
    return sum(p.read_bytes().count(b"\n") for p in (root / "benchmarks").rglob("*.py"))


def test_benchmarks_stay_within_their_line_budget():
    """Issue 51: the benchmarks share one harness (benchmarks/_harness.py: the flags, a
    timer, a child process with a timeout, tables) instead of writing it in each script
    (4,840 lines then, half of them harness), so they stay a lab one reads."""
    n = benchmark_lines()
    assert n <= BENCHMARK_LINES, f"benchmarks/ has {n} lines, over {BENCHMARK_LINES}"


def test_the_benchmark_count_is_wc_l_and_sees_an_overrun(tmp_path):
    (tmp_path / "benchmarks" / "sub").mkdir(parents=True)
    (tmp_path / "benchmarks" / "a.py").write_text("x = 1\n" * BENCHMARK_LINES)
    (tmp_path / "benchmarks" / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "benchmarks" / "notes.md").write_text("not counted\n" * 50)
    assert benchmark_lines(tmp_path) == BENCHMARK_LINES + 1 > BENCHMARK_LINES


def test_the_library_keeps_no_record_of_the_lab_machine():
    """Issue 51: what a grid cost on this lab's machine (sessions, wall time, load) is
    the lab's record (lab/grid.py, lab/sessions.py); jattn reads no load average and
    writes no sessions file, and the reports carry the record through their appendix."""
    found = [
        p.relative_to(REPO).as_posix()
        for p in sorted((REPO / "jattn").rglob("*.py"))
        if re.search(r"getloadavg|sessions\.jsonl", p.read_text())
    ]
    assert not found, found
    assert not (REPO / "jattn" / "analysis" / "sessions.py").exists()
    assert (REPO / "lab" / "sessions.py").exists() and "lab/grid.py" in (
        REPO / "scripts" / "run.sh"
    ).read_text()


def test_one_run_is_one_seed_no_seed_programs():
    """Issue 51: several seeds are several runs (a grid's seed axis, `jattn ablate
    --jobs N`), never one program: no module for a program's members or seed groups,
    and no config key that asks for several seeds or swept values in one run (they
    are refused by name, `jattn.train.config.REMOVED_KEYS`)."""
    from jattn.train.config import REMOVED_KEYS, default_config  # noqa: PLC0415

    names = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "jattn").rglob("*.py"))
    programs = [n for n in names if re.search(r"member|seed_(group|program)|seeds\.py", n)]
    assert not programs, programs
    keys = set(default_config().keys())
    assert "seeds" in REMOVED_KEYS and "seed" in keys
    assert not keys & set(REMOVED_KEYS), keys & set(REMOVED_KEYS)
    assert not (REPO / "benchmarks" / "seeds.py").exists()


# -- models are picked by architecture, not by comparing names ---------------------------

# The one place that may compare a config's architecture with a name: the base
# class checking that the registered model it dispatched to is the config's.
ARCHITECTURE_SEAM = ("jattn.models.architectures", "jattn.models.transformer")
ARCHITECTURE_NAMES = ("encoder_decoder", "decoder_only", "encoder_only")
ARCHITECTURE_ATTRS = ("decoder_only", "encoder_only")


def architecture_comparisons(modules) -> list[str]:
    """`module:line` of every comparison (``==``, ``!=``, ``in``, ``not in``, ``is``)
    with an architecture's name (a string literal) or a ``.decoder_only`` /
    ``.encoder_only`` attribute on either side, outside the registry's seam:
    such a switch is what the registry replaces (each architecture's
    behaviour lives in its `Architecture` entry and its model class).
    Comparing two names neither of which is spelled out (listing the other
    architectures beside this one) is not a switch."""
    found = []
    for name, (_, tree) in sorted(modules.items()):
        if name in ARCHITECTURE_SEAM:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            for side in (node.left, *node.comparators):
                named = isinstance(side, ast.Constant) and side.value in ARCHITECTURE_NAMES
                attr = isinstance(side, ast.Attribute) and side.attr in ARCHITECTURE_ATTRS
                if named or attr:
                    found.append(f"{name}:{node.lineno}")
                    break
    return found


def test_no_architecture_switch_outside_the_registry(repo):
    modules, _ = repo
    assert "jattn.models.decoder_only" in modules  # the models are scanned
    found = architecture_comparisons(modules)
    assert not found, "architecture compared by name outside the registry:\n" + "\n".join(found)


def test_the_architecture_check_finds_a_switch(tmp_path):
    modules, _ = _package(
        tmp_path,
        {
            "jattn/__init__.py": "",
            "jattn/models/__init__.py": "",
            "jattn/models/transformer.py": 'def f(c):\n    return c.architecture != "x"\n',
            "jattn/train/steps.py": (
                "def f(cfg):\n"
                '    if cfg.model.architecture == "decoder_only":\n'
                "        return 1\n"
                "    x = cfg.decoder_only is not False\n"
                '    return "encoder_only" in cfg.names or x\n'
                "def g(cfg, name):\n"
                "    return cfg.width == 3 or name != cfg.architecture\n"
            ),
        },
    )
    assert architecture_comparisons(modules) == [
        "jattn.train.steps:2",
        "jattn.train.steps:4",
        "jattn.train.steps:5",
    ]


# -- schemes carry their options: no TransformerConfig field belongs to one scheme ---------

CONFIG_MODULE = "jattn.models.config"
SCHEMES_MODULE = "jattn.models.schemes"  # the registry


def scheme_modules(modules) -> set[str]:
    """The registry and the modules that hold its components, one per kind:
    every jattn.models module named `*schemes` (`rotary_schemes`, `data_schemes`, ...)."""
    return {m for m in modules if m.startswith("jattn.models.") and m.endswith("schemes")}


def config_fields(modules) -> list[str]:
    """The annotated fields of `TransformerConfig`, read from its source."""
    _, tree = modules[CONFIG_MODULE]
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TransformerConfig":
            return [
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
    raise AssertionError(f"{CONFIG_MODULE} defines no TransformerConfig")


def scheme_words(modules) -> set[str]:
    """The words of the registered schemes' names (the string first arguments of
    the calls in the module-level `for` that registers them) and of their
    `options_key`s (in the registry and every module of components):
    "transformer_xl" gives "transformer" and "xl"."""
    names = set()
    nodes = [n for m in sorted(scheme_modules(modules)) for n in modules[m][1].body]
    for node in nodes:
        if isinstance(node, ast.For):
            for call in ast.walk(node.iter):
                if isinstance(call, ast.Call) and call.args:
                    first = call.args[0]
                    if isinstance(first, ast.Constant) and isinstance(first.value, str):
                        names.add(first.value)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if (
                    isinstance(item, ast.Assign)
                    and any(getattr(t, "id", None) == "options_key" for t in item.targets)
                    and isinstance(item.value, ast.Constant)
                ):
                    names.add(item.value.value)
    return {w for name in names for w in name.replace("+", "_").split("_") if w}


def fields_for_one_scheme(modules) -> list[str]:
    """`TransformerConfig` fields that belong to one scheme: a field whose name
    has a word of a scheme's name or options key (`rope_scaling`,
    `xl_max_distance`), or a field that only the scheme components (the
    classes of `scheme_modules`) read (`cfg.max_relative_distance`, read by
    Shaw alone; the base class `Scheme` reads for every scheme and does not
    count); such an option belongs in the scheme's `Options`."""
    words = scheme_words(modules)
    components = scheme_modules(modules)
    fields = config_fields(modules)
    found = [f for f in fields if set(f.split("_")) & words]
    reads: dict[str, set[str]] = {f: set() for f in fields}  # field -> where it is read
    for name, (_, tree) in modules.items():
        if not name.startswith("jattn") or name == CONFIG_MODULE:
            continue
        classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        inside = {id(a): c.name for c in classes for a in ast.walk(c)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in reads:
                component = name in components and inside.get(id(node), "Scheme") != "Scheme"
                reads[node.attr].add("scheme" if component else name)
    found += [f for f, where in reads.items() if where == {"scheme"} and f not in found]
    return found


def test_no_transformer_config_field_belongs_to_one_scheme(repo):
    modules, _ = repo
    fields = config_fields(modules)
    assert {"position", "position_options", "max_len", "relative_cross"} <= set(fields)
    assert {SCHEMES_MODULE, "jattn.models.rotary_schemes"} <= scheme_modules(modules)
    assert {"shaw", "rope", "t5", "xpos", "alibi", "fire", "xl", "kerple"} <= scheme_words(modules)
    found = fields_for_one_scheme(modules)
    assert not found, (
        f"TransformerConfig fields that belong to one scheme: {found}; move them into the "
        "scheme's Options (its component's module, docs/schemes.md)"
    )


def test_the_scheme_field_check_finds_a_field_named_or_read_for_one_scheme(tmp_path):
    modules, _ = _package(
        tmp_path,
        {
            "jattn/__init__.py": "",
            "jattn/models/__init__.py": "",
            "jattn/models/config.py": (
                "class TransformerConfig:\n"
                "    d_model: int = 8\n"
                "    rope_base: float = 1.0\n"
                "    clip: int = 3\n"
                "    max_len: int = 4\n"
            ),
            "jattn/models/rotary_schemes.py": (
                "class Rope:\n"
                '    options_key = "rotary"\n'
                "    def rotate(self, cfg):\n"
                "        return cfg.rope_base, cfg.d_model\n"
            ),
            "jattn/models/schemes.py": (
                "class Shaw:\n"
                "    def shaw(self, cfg):\n"
                "        return cfg.clip, cfg.max_len\n"
                'for s in (Rope("rope"), Shaw("shaw")):\n'
                "    pass\n"
            ),
            "jattn/models/layers.py": "def f(cfg):\n    return cfg.d_model + cfg.max_len\n",
        },
    )
    assert scheme_words(modules) == {"rope", "shaw", "rotary"}
    assert fields_for_one_scheme(modules) == ["rope_base", "clip"]


# -- one einsum vocabulary: every letter of every einsum string is in the legend ---------

LEGEND = "jattn.attention.legend"
EINSUM_PACKAGES = ("jattn.attention", "jattn.models")


def legend_letters(modules) -> set[str]:
    """The keys of `EINSUM_LETTERS` in the legend module, read from its source."""
    _, tree = modules[LEGEND]
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(getattr(t, "id", None) == "EINSUM_LETTERS" for t in targets):
                return set(ast.literal_eval(node.value))
    raise AssertionError(f"{LEGEND} defines no EINSUM_LETTERS")


def einsum_specs(modules, packages=EINSUM_PACKAGES) -> list[tuple[str, int, str]]:
    """`(module, line, spec)` for every `einsum("spec", ...)` call (jnp.einsum,
    np.einsum, a bare einsum) whose first argument is a string literal."""
    found = []
    for name, (_, tree) in sorted(modules.items()):
        if not any(name == p or name.startswith(p + ".") for p in packages):
            continue
        for node in ast.walk(tree):
            func = getattr(node, "func", None)
            called = getattr(func, "attr", None) or getattr(func, "id", None)
            if isinstance(node, ast.Call) and called == "einsum" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    found.append((name, node.lineno, first.value))
    return found


def unknown_letters(spec: str, letters: set[str]) -> list[str]:
    """The axis letters of an einsum spec that the legend does not define."""
    return sorted({c for c in spec if c.isalpha() and c not in letters})


def test_every_einsum_letter_is_in_the_legend(repo):
    modules, _ = repo
    letters = legend_letters(modules)
    assert {"E", "V"} <= letters  # the value head dim and the vocabulary: two letters
    specs = einsum_specs(modules)
    assert len(specs) >= 20, specs  # the scan reads the implementations' einsums
    assert {m for m, _, _ in specs} >= {"jattn.attention.xla", "jattn.models.layers"}
    bad = [
        f"{m}:{line} {spec!r} uses {unknown_letters(spec, letters)}"
        for m, line, spec in specs
        if unknown_letters(spec, letters)
    ]
    assert not bad, "einsum letters missing from jattn/attention/legend.py:\n" + "\n".join(bad)


def test_the_einsum_check_finds_a_letter_the_legend_lacks(tmp_path):
    modules, _ = _package(
        tmp_path,
        {
            "jattn/__init__.py": "",
            "jattn/attention/__init__.py": "",
            "jattn/attention/legend.py": 'EINSUM_LETTERS: dict = {"B": "b", "T": "t", "E": "e"}\n',
            "jattn/attention/xla.py": (
                "import jax.numpy as jnp\n"
                "def f(x, y):\n"
                '    a = jnp.einsum("BT,BT->B", x, y)\n'
                "    return jnp.einsum(\n"
                '        "BTV,BT->BE", x, y\n'
                "    )\n"
            ),
            "jattn/train/other.py": 'import numpy as np\nnp.einsum("QZ->Q", 0)\n',
        },
    )
    letters = legend_letters(modules)
    assert letters == {"B", "T", "E"}
    specs = einsum_specs(modules)
    assert specs == [
        ("jattn.attention.xla", 3, "BT,BT->B"),
        ("jattn.attention.xla", 4, "BTV,BT->BE"),
    ]
    assert [unknown_letters(s, letters) for _, _, s in specs] == [[], ["V"]]


def test_the_readme_opens_on_the_library_and_its_tables_are_short():
    """The README says what jattn is, then installs and imports it within its first 45
    lines; its tables (the main job's, the published comparisons) have no cell over 100
    characters: detail lives in docs/results.md and the reports."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    first_code = next(i for i, line in enumerate(lines, 1) if line.startswith("```"))
    first_import = next(i for i, line in enumerate(lines, 1) if line.startswith("import jattn"))
    assert first_code <= 45 and first_import <= 45, (first_code, first_import)
    long = [
        (i, cell[:60])
        for i, line in enumerate(lines, 1)
        if line.startswith("|")
        for cell in line.strip().strip("|").split(" | ")
        if len(cell.strip()) > 100
    ]
    assert not long, f"README table cells over 100 characters (line, start): {long}"


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, every character but
    letters, digits, spaces, hyphens and underscores dropped, spaces to hyphens."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def strip_fences(text: str) -> str:
    """Markdown text without its fenced code blocks (tests/test_configs.py's too)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def prose(path: pathlib.Path) -> str:
    """A markdown file's text outside its code fences."""
    return strip_fences(path.read_text(encoding="utf-8"))


@functools.cache
def anchors_of(path: pathlib.Path) -> frozenset[str]:
    """The anchors of a markdown file's headings (outside code fences); a repeated
    heading's later copies get GitHub's ``-1``, ``-2``. Read once a file: a long page
    is the target of many links."""
    text = prose(path)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#+\s+(.*)$", text, flags=re.M):
        slug = heading_anchor(heading)
        seen[slug] = seen.get(slug, -1) + 1
        anchors.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
    return frozenset(anchors)


def test_every_link_of_the_docs_names_a_file_and_a_heading_there():
    """A moved file or a renamed heading breaks every link to it without a sound:
    each relative link of README.md and docs/**/*.md names a file that exists, and
    a link to a section (``file.md#anchor``, ``#anchor``) a heading of that file."""
    assert heading_anchor("Reverse at 3,600 steps: the forget gate and RoPE") == (
        "reverse-at-3600-steps-the-forget-gate-and-rope"
    )
    assert heading_anchor("Several runs at once: `--jobs`") == "several-runs-at-once---jobs"
    assert heading_anchor("The main job: reversing (Ontañón et al. 2022)") == (
        "the-main-job-reversing-ontañón-et-al-2022"
    )
    broken = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = prose(doc)
        for target, anchor in re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", text):
            if re.match(r"[a-z]+:", target) or not (target or anchor):
                continue  # a URL
            path = (doc.parent / target).resolve() if target else doc
            if not path.exists() or anchor and anchor not in anchors_of(path):
                broken.append(f"{doc.relative_to(REPO)}: {target}#{anchor}")
    assert not broken, broken


def unresolved_jattn_names(text: str) -> list[str]:
    """The `` `jattn.a.b` `` names of a markdown text that are no module, or no
    attribute of one, in the code as it is (imported, so a re-export counts)."""
    missing = []
    for name in re.findall(r"`(jattn(?:\.[A-Za-z_]\w*)+)", text):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, missing)
        if obj is missing:
            missing.append(name)
    return missing


def test_every_jattn_name_the_docs_cite_exists():
    """A function moved or renamed leaves the docs pointing at nothing: every
    `jattn.x.y` name that README.md and docs/**/*.md cite resolves."""
    stale = [
        f"{doc.relative_to(REPO)}: {name}"
        for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
        for name in unresolved_jattn_names(doc.read_text())
    ]
    assert not stale, stale


def test_the_name_check_finds_a_module_or_attribute_the_code_lacks():
    text = "`jattn.attention.scores.rel_gather`, `jattn.dot_product_attention(q, k, v)`"
    assert unresolved_jattn_names(text) == []
    text += ", `jattn.analysis.sessions`, `jattn.attention.scores.no_such`, `jattn.flash_attention`"
    assert unresolved_jattn_names(text) == [
        "jattn.analysis.sessions",
        "jattn.attention.scores.no_such",
        "jattn.flash_attention",
    ]


def _table_after(lines: list[str], header_start: str) -> list[str]:
    """The lines of the markdown table whose header row starts with `header_start`."""
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    return table


def test_the_readme_main_table_is_the_main_job_report_and_its_text_its_csv():
    """The main job's table in the README is the Groups table of the report it
    links (docs/results/results.md), its columns shortened, cell for cell (and
    docs/results.md's copy is that table), and the per-seed range the text
    gives for ALiBi's validation exact match is the report's results.csv (so a
    rerun that moves a number fails here until the README follows)."""
    import csv
    import re

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    report = (REPO / "docs" / "results" / "results.md").read_text(encoding="utf-8")
    ours = _table_after(readme.splitlines(), "| scheme | seeds | test_longer exact match |")
    theirs = _table_after(report.splitlines(), "| group | seeds | eval/test_longer/exact_match |")
    assert len(ours) == len(theirs) == 10, "the header, its rule and the 8 schemes"
    columns = ["eval/test_longer/exact_match", "eval/validation/exact_match",
               "eval/test_longer/length_match"]  # fmt: skip

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split(" | ")]

    results = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    full = "| group | seeds | eval/test_longer/exact_match |"
    assert _table_after(results.splitlines(), full) == theirs, "docs/results.md's copy"
    header = cells(theirs[0])
    for mine, report_row in zip(ours[2:], theirs[2:], strict=True):
        row = cells(report_row)
        expected = [row[0].removeprefix("position="), row[1]]
        expected += [row[header.index(c)] for c in columns] + [row[-1]]
        assert cells(mine) == expected

    with open(REPO / "docs" / "results" / "results.csv", encoding="utf-8") as f:
        alibi = [
            float(r["eval/validation/exact_match"])
            for r in csv.DictReader(f)
            if r["position"] == "alibi" and r["status"] == "finished"
        ]
    said = re.search(r"ALiBi's\s+seeds\s+(\d\.\d+)–(\d\.\d+)", readme)
    assert said, "the README gives ALiBi's per-seed validation range"
    assert len(alibi) == 3
    assert (float(said.group(1)), float(said.group(2))) == (
        round(min(alibi), 3),
        round(max(alibi), 3),
    )


def test_no_file_cites_a_design_document_the_repository_lacks():
    """The public contract in the repository is docs/design.md; the shared
    design file's bare name points a reader at a file the repository lacks."""
    cited = []
    for top in ("jattn", "tests", "benchmarks", "experiments", "configs"):
        for path in sorted((REPO / top).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"(?<![/\w])DESIGN\.md", line):
                    cited.append(f"{path.relative_to(REPO)}:{n}")
    assert not cited, "cites the shared design file, not docs/design.md:\n" + "\n".join(cited)


# -- every module says what it holds, in names that read as what they are ----------------

# First words that make a module docstring's first sentence an instruction, not a
# statement of what the module holds ("Count the representation you are ...").
IMPERATIVES = {
    "aggregate", "build", "call", "check", "compute", "count", "do", "make", "note",
    "read", "rebuild", "run", "see", "todo", "use", "write",
}  # fmt: skip
# A version note or a measurement: "jaxlib 0.10.2", "0.63 / 0.56", "17.8 MB", "1.5x".
VERSION_OR_MEASURE = re.compile(
    r"\bjax(lib)?\s+\d|\b\d+\.\d+\.\d+|\b\d+(\.\d+)?\s*(ms|µs|MB|MiB|GB|GiB|KB|x)\b|\d\s*%"
)


def first_sentence(docstring: str) -> str:
    """The docstring's first sentence: its first paragraph up to the first full stop
    that ends a sentence (not "e.g." or "et al."), or the whole paragraph."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    match = re.search(r"(?<!e\.g)(?<!i\.e)(?<!et al)[.?!](\s|$)", paragraph)
    return paragraph[: match.end()].strip() if match else paragraph


def docstring_problems(modules) -> list[str]:
    """``module: why`` for every jattn module whose docstring does not open on a
    sentence about what it holds: none at all, a question, an instruction (its
    first word in `IMPERATIVES`), or a version note or a measurement."""
    out = []
    for name, (_, tree) in sorted(modules.items()):
        if name.split(".")[0] != "jattn":
            continue
        doc = ast.get_docstring(tree)
        if not doc or not doc.strip():
            out.append(f"{name}: no module docstring")
            continue
        sentence = first_sentence(doc)
        word = re.sub(r"[^a-z']", "", sentence.split()[0].lower())
        if sentence.endswith("?"):
            out.append(f"{name}: opens on a question: {sentence!r}")
        elif word in IMPERATIVES:
            out.append(f"{name}: opens on an instruction: {sentence!r}")
        elif VERSION_OR_MEASURE.search(sentence):
            out.append(f"{name}: opens on a version or a measurement: {sentence!r}")
    return out


def test_every_module_opens_on_what_it_holds(repo):
    """House style (docs/design.md): every module's first docstring line says what
    it holds, so a reader skimming the tree's first lines gets a true table of
    contents (issue 51: memory.py opened on jaxlib-version measurements)."""
    modules, _ = repo
    problems = docstring_problems(modules)
    assert not problems, "\n".join(problems)


def test_the_docstring_check_finds_what_is_not_a_statement_of_contents(tmp_path):
    modules, _ = _package(
        tmp_path,
        {
            "jattn/__init__.py": '"""jattn: attention, e.g. flash attention. More."""\n',
            "jattn/a.py": '"""Count the bytes you are materialising."""\n',
            "jattn/b.py": '"""Did each group fit?\n\nMore."""\n',
            "jattn/c.py": '"""Measured on jaxlib 0.10.2: it holds 1.06 of the count."""\n',
            "jattn/d.py": "x = 1\n",
            "jattn/e.py": '"""The shape legend: one letter per dimension, in every\neinsum."""\n',
            "jattn/f.py": '"""Speed: 17.8 MB held at T = 512."""\n',
        },
    )
    assert first_sentence('"e.g. this" and et al. that. Then more.') == (
        '"e.g. this" and et al. that.'
    )
    assert [p.split(":")[0] for p in docstring_problems(modules)] == [
        "jattn.a", "jattn.b", "jattn.c", "jattn.d", "jattn.f",
    ]  # fmt: skip


# Short forms an import may take, each the field's or the project's usual name for
# the module (numpy as np) or a name qualified by what it is (`data_ckpt`: the data
# iterator's checkpointing). Any other alias must be the imported name itself, a
# tail of its words (`mosaic_distance_grad as distance_grad`) or the name qualified
# by a word before or after it (`mesh as mesh_lib`, `TASKS as CHOMSKY_TASKS`).
SHORT_FORMS = {
    "numpy": "np",
    "jax.numpy": "jnp",
    "flax.linen": "nn",
    "jax.sharding.PartitionSpec": "P",
    "jax.experimental.pallas": "pl",
    "jax.experimental.pallas.tpu": "pltpu",
    "jax.experimental.pallas.triton": "pltriton",
    "jax.experimental.pallas.mosaic_gpu": "plgpu",
    "jax.extend.core": "jex_core",
    "orbax.checkpoint": "ocp",
    "orbax.checkpoint.checkpoint_managers": "cm",
    "tensorflow_datasets": "tfds",
    "sentencepiece": "spm",
    "matplotlib.pyplot": "plt",
    "jattn.train.checkpoints": "ckpt",
    "jattn.data.checkpoint": "data_ckpt",
    "jattn.positions": "pos_lib",
}


def alias_reads_as_its_module(full: str, alias: str) -> bool:
    """Whether `import full as alias` (or ``from a import b as alias``, `full` =
    "a.b") binds a name that reads as what it imports."""
    name = full.split(".")[-1]
    if alias == name or SHORT_FORMS.get(full) == alias:
        return True
    low, low_name = alias.lower(), name.lower()
    return (
        low_name.endswith("_" + low)
        or low.startswith(low_name + "_")
        or low.endswith("_" + low_name)
    )


def misleading_aliases(modules) -> list[str]:
    """``module:line import ... as alias`` for every alias in jattn that does not
    read as what it imports (`alias_reads_as_its_module`)."""
    out = []
    for source, (path, tree) in sorted(modules.items()):
        if source.split(".")[0] != "jattn":
            continue
        for node, _ in _walk(tree):
            if isinstance(node, ast.Import):
                pairs = [(a.name, a.asname) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(source, path.name == "__init__.py", node)
                pairs = [(f"{base}.{a.name}", a.asname) for a in node.names]
            else:
                continue
            out += [
                f"{source}:{node.lineno} {full} as {alias}"
                for full, alias in pairs
                if alias and not alias_reads_as_its_module(full, alias)
            ]
    return out


def test_import_aliases_read_as_their_modules(repo):
    """An alias names what it imports (issue 51: `workdir as files`, `distance_tiles as
    dt` and `tile_math as ft` read as other things)."""
    modules, _ = repo
    found = misleading_aliases(modules)
    assert not found, "aliases that read as something else:\n" + "\n".join(found)


def test_the_alias_check_finds_an_alias_that_reads_as_something_else(tmp_path):
    modules, _ = _package(
        tmp_path,
        {
            "jattn/__init__.py": "",
            "jattn/train/__init__.py": "",
            "jattn/train/run.py": (
                "import numpy as np\n"
                "from jattn.train import workdir as files\n"
                "from jattn.train import mesh as mesh_lib\n"
                "def f():\n"
                "    from jattn.attention.pallas import tile_math as ft\n"
                "    from jattn.attention.pallas import triton_distance_grad as distance_grad\n"
                "    from jattn.cli.slurm import DEFAULTS as SLURM_DEFAULTS\n"
            ),
        },
    )
    assert misleading_aliases(modules) == [
        "jattn.train.run:2 jattn.train.workdir as files",
        "jattn.train.run:5 jattn.attention.pallas.tile_math as ft",
    ]


# -- a file over 500 lines is split by concern, or says why it is one file ----------------

MAX_LINES = 500
# The paragraph of a module docstring that says why the file is long.
LENGTH_NOTE = re.compile(r"^One file of \d+ lines:", re.MULTILINE)


def long_files(root: pathlib.Path) -> dict[str, int]:
    """``{path: lines}`` of every .py file under `root`/jattn over `MAX_LINES`."""
    return {
        path.relative_to(root).as_posix(): n
        for path in sorted((root / "jattn").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }


def unexplained_long_files(root: pathlib.Path) -> list[str]:
    """The files of `long_files` whose module docstring has no paragraph starting
    "One file of N lines:" (why it is not split)."""
    out = []
    for path, n in long_files(root).items():
        doc = ast.get_docstring(ast.parse((root / path).read_text())) or ""
        if not LENGTH_NOTE.search(doc):
            out.append(f"{path} ({n} lines)")
    return out


def test_a_file_over_500_lines_is_split_or_says_why():
    """Issue 51: one concern a file; a file over 500 lines is split by concern or
    its docstring says why it is one file ("One file of N lines: ..."). None is
    left pending: the models' three long files (decoding, layers, schemes) were
    split by concern."""
    assert not unexplained_long_files(REPO), unexplained_long_files(REPO)


def test_the_length_check_finds_a_long_file_that_does_not_say_why(tmp_path):
    body = "x = 1\n" * MAX_LINES
    _package(
        tmp_path,
        {
            "jattn/__init__.py": "",
            "jattn/long.py": '"""Many things."""\n' + body,
            "jattn/said.py": '"""Many things.\n\nOne file of 503 lines: why."""\n' + body,
            "jattn/short.py": '"""A few things."""\nx = 1\n',
        },
    )
    assert unexplained_long_files(tmp_path) == ["jattn/long.py (501 lines)"]


# -- no function takes more than 12 parameters ------------------------------------------

MAX_PARAMETERS = 12
# The two drop-in entry points keep the signatures they stand in for (docs/design.md):
# `jax.nn.dot_product_attention`'s, and flax's `attention_fn` (which `flax_attention_fn`
# returns). Everything else passes visibility as one `jattn.visibility.Visibility`.
DROP_INS = (
    "jattn.attention.dot_product_attention",
    "jattn.flax_attention.flax_attention_fn.attention_fn",
)


def functions(tree: ast.AST, prefix: str):
    """`(qualified name, node)` of every function and method in `tree`, nested
    ones named after their parents (`module.Class.method`, `module.f.inner`)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}.{node.name}"
            yield name, node
            yield from functions(node, name)
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}.{node.name}")
        else:
            yield from functions(node, prefix)


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Every parameter a caller may pass, `*args` and `**kwargs` one each; a
    method's `self` or `cls` does not count."""
    a = node.args
    named = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    if named and named[0].arg in ("self", "cls"):
        named = named[1:]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def wide_functions(modules) -> list[str]:
    """``file:line name (n parameters)`` for every jattn function over `MAX_PARAMETERS`."""
    return [
        f"{path}:{node.lineno} {name} ({parameter_count(node)} parameters)"
        for module, (path, tree) in modules.items()
        if module == "jattn" or module.startswith("jattn.")
        for name, node in functions(tree, module)
        if parameter_count(node) > MAX_PARAMETERS and name not in DROP_INS
    ]


def test_no_function_in_jattn_takes_more_than_12_parameters(repo):
    """Issue 51: a call's visibility (causal, window, lengths, segment ids,
    positions) travels as one value, not ~10 keywords re-declared by every
    function on its way; only the two drop-in entry points keep the wide
    signatures of the libraries they stand in for."""
    modules, _ = repo
    wide = wide_functions(modules)
    assert not wide, "\n".join(wide)
    names = {name for m, (_, tree) in modules.items() for name, _ in functions(tree, m)}
    assert set(DROP_INS) <= names, "an exempt entry point was renamed: update DROP_INS"


def test_the_parameter_check_finds_a_wide_function(tmp_path):
    params = lambda n: ", ".join(f"a{i}" for i in range(n))  # noqa: E731
    modules, _ = _package(
        tmp_path,
        {
            "jattn/__init__.py": "",
            "jattn/attention/__init__.py": f"def dot_product_attention({params(22)}): ...\n",
            "jattn/wide.py": (
                f"def fine({params(11)}, **kw): ...\n"
                f"def wide({params(12)}, *more): ...\n"
                "class Layer:\n"
                f"    def __call__(self, {params(12)}): ...\n"
                f"    def call(self, {params(13)}): ...\n"
                "def outer():\n"
                "    if True:\n"
                f"        def inner(*, {params(13)}): ...\n"
            ),
        },
    )
    assert sorted(wide_functions(modules)) == [
        "jattn/wide.py:2 jattn.wide.wide (13 parameters)",
        "jattn/wide.py:5 jattn.wide.Layer.call (13 parameters)",
        "jattn/wide.py:8 jattn.wide.outer.inner (13 parameters)",
    ]
