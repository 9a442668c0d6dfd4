"""Which modules read a run's raw `ml_collections.ConfigDict`, in order: a tracer for
issue 51's measure of how far the config travels.

`traced_reads(config)` patches `ConfigDict`'s reading methods for the duration of
a ``with`` block and records, for every read of `config` or of a ConfigDict
inside it (``config.model``), the jattn module that made it: the first frame
outside ml_collections and this file, or, when that frame is not jattn's (the
standard library's `json`, `copy`), the first jattn frame above it. Reads by
code outside jattn (a test) are not recorded.

A *stop* is a run of consecutive reads by one module; a *return* is a stop in a
module an earlier stop was in (the config left that module and came back).

    python tests/config_reads.py            # one step of configs/smoke.py, traced

prints the stops, the modules and the returns of one `train_and_evaluate`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator

from ml_collections import config_dict

# The ConfigDict methods that read what the config holds (a field, the keys, all of it).
READERS = (
    "__getattr__",
    "__getitem__",
    "__contains__",
    "__iter__",
    "get",
    "items",
    "keys",
    "values",
    "to_dict",
    "to_json",
    "copy_and_resolve_references",
)
_HERE = os.path.abspath(__file__)
_ML_COLLECTIONS = os.path.dirname(os.path.abspath(config_dict.__file__))


@dataclasses.dataclass
class Reads:
    """The modules that read a traced config, one entry a read, in order."""

    modules: list[str] = dataclasses.field(default_factory=list)

    @property
    def stops(self) -> list[str]:
        """The module of each run of consecutive reads by one module."""
        return [m for i, m in enumerate(self.modules) if i == 0 or self.modules[i - 1] != m]

    @property
    def readers(self) -> list[str]:
        """The modules that read the config, each once, in the order of their first read."""
        return list(dict.fromkeys(self.modules))

    @property
    def returns(self) -> int:
        """Stops in a module that an earlier stop was in."""
        stops = self.stops
        return sum(1 for i, m in enumerate(stops) if m in stops[:i])

    def summary(self) -> str:
        return (
            f"{len(self.modules)} reads, {len(self.stops)} stops in {len(self.readers)} "
            f"modules, {self.returns} of them returns"
        )


def _reader() -> str | None:
    """The jattn module that made the read being traced (None: no jattn frame)."""
    frame = sys._getframe(2)
    first = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and not path.startswith(_ML_COLLECTIONS):
            name = frame.f_globals.get("__name__", "")
            if first is None:
                first = name
            if name.split(".")[0] == "jattn":
                return name
            if first.split(".")[0] not in ("json", "copy", "dataclasses", "contextlib"):
                return None
        frame = frame.f_back
    return None


def _tree(config: config_dict.ConfigDict) -> set[int]:
    """The ids of `config` and of every ConfigDict inside it."""
    ids = {id(config)}
    for value in config._fields.values():
        if isinstance(value, config_dict.ConfigDict):
            ids |= _tree(value)
    return ids


@contextlib.contextmanager
def traced_calls(config: config_dict.ConfigDict) -> Iterator[Reads]:
    """Records every call of a jattn function that receives `config` (or a ConfigDict
    inside it) as an argument, by the function's module: where the config travels,
    read there or handed on."""
    tracked, calls = _tree(config), Reads()
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if name.split(".")[0] != "jattn":
            return
        code = frame.f_code
        count = code.co_argcount + code.co_kwonlyargcount
        names = code.co_varnames[:count]
        if any(id(frame.f_locals.get(n)) in tracked for n in names):
            calls.modules.append(name)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


@contextlib.contextmanager
def traced_reads(config: config_dict.ConfigDict) -> Iterator[Reads]:
    """Records every read of `config` (and the ConfigDicts in it) by a jattn module."""
    tracked, reads = _tree(config), Reads()
    originals = {name: getattr(config_dict.ConfigDict, name) for name in READERS}
    depth = [0]  # reads inside a read (`to_dict` reading its fields) are the outer one's

    def wrap(name, method):
        def read(self, *args, **kwargs):
            if depth[0] == 0 and id(self) in tracked:
                module = _reader()
                if module is not None:
                    reads.modules.append(module)
            depth[0] += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        read.__name__ = name
        return read

    try:
        for name, method in originals.items():
            setattr(config_dict.ConfigDict, name, wrap(name, method))
        yield reads
    finally:
        for name, method in originals.items():
            setattr(config_dict.ConfigDict, name, method)


def smoke_config(**overrides):
    """configs/smoke.py for one step that evaluates and saves (no splits, no bar)."""
    from jattn.train.config import apply_overrides, load_config  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(_HERE))
    config = load_config(os.path.join(root, "configs", "smoke.py"))
    settings = {
        "num_train_steps": "1",
        "eval_every_steps": "1",
        "checkpoint_every_steps": "1",
        "progress_bar": "false",
        **overrides,
    }
    return apply_overrides(config, list(settings.items()))


def main() -> None:
    import tempfile  # noqa: PLC0415

    from jattn.train import train_and_evaluate  # noqa: PLC0415

    config = smoke_config()
    with tempfile.TemporaryDirectory() as workdir, traced_reads(config) as reads:
        with traced_calls(config) as calls:
            train_and_evaluate(config, workdir)
    for what, trace in (("handed to", calls), ("read by", reads)):
        print(f"-- the config {what}:")
        for i, module in enumerate(trace.stops):
            print(f"{i + 1:3d} {module}")
        print(trace.summary().replace("reads", "calls" if trace is calls else "reads"))
        print("modules:", ", ".join(trace.readers))


if __name__ == "__main__":
    main()
