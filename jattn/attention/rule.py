"""What `implementation=None` runs: one rule, a pure function of the call.

`choose(call, platform)` reads only what a `Call` holds (the call's features,
its dtype and sizes) and the platform's name, so every branch is testable on
the CPU by naming another platform. `jattn.dot_product_attention` calls it
where `implementation=None` is resolved and says once per process which path
it took (`announce`).

The rule, in order:

1. CPU and TPU: ``"xla"`` for small problems (fewer dispatches), ``"chunked"``
   once the logits of one (batch, head) reach `CHUNKED_MIN_LOGITS`
   (docs/benchmarks.md). The TPU's Mosaic kernels have never run on a TPU
   (docs/tpu.md), so they are not wanted there.
2. A GPU, a call whose logits over every (batch, head) stay under
   `GPU_SMALL_LOGITS`: ``"xla"``; a few fused XLA kernels, where launches and
   not arithmetic set the time.
3. A larger call on a GPU wants a kernel: cuDNN (jax.nn's
   ``implementation="cudnn"``) where the call fits it (`cudnn_misfit`), the
   Pallas kernels where a feature needs them (float32, segments, Shaw
   tables, score mods, dropout, positions, ...).
4. The wanted kernel runs only if its configuration (`KernelConfig`: family,
   dtype, head dim, features, and which score mod in which form) is in
   `VERIFIED`, the configurations that passed the float64 check on a GPU in a
   committed run (docs/gpu.md).
   Otherwise the call goes to the CPU's choice (chunked, which runs
   wherever XLA does, or xla) and the choice says what it would have used
   and why not.

`VERIFIED` is empty: no kernel configuration has passed the float64 check
on a GPU yet (the one GPU run, 2026-12-04 on an H200, failed its check
before comparing; docs/gpu.md), and cuDNN has not been checked either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys

__all__ = [
    "CHUNKED_MIN_LOGITS",
    "FEATURES",
    "GPU_SMALL_LOGITS",
    "GPU_XLA_MAX_LOGITS",
    "VERIFIED",
    "Call",
    "Choice",
    "KernelConfig",
    "Verified",
    "announce",
    "choose",
    "cudnn_misfit",
    "mod_form",
    "show_choices",
    "verified_problems",
]

# Above this many logits per (batch, head) the chunked path beats
# materialising them on the CPU (see docs/benchmarks.md).
CHUNKED_MIN_LOGITS = 1024 * 1024

# Below this many logits over all (batch, head) pairs a GPU call is launch
# bound: 4 MiB of float32 logits is a few microseconds of HBM traffic, the
# order of one kernel launch. An estimate, not a measurement: the GPU window
# (docs/gpu.md) times both sides of it.
GPU_SMALL_LOGITS = 1 << 20

# On a GPU, xla's logits over all (batch, head) pairs stay under 1 GiB of
# float32 (the backward holds several such arrays); above, chunked.
GPU_XLA_MAX_LOGITS = 1 << 28

# What a call may carry beyond q, k, v. `window_right` is a window with keys
# to the right of the query in a non-causal call (cuDNN has only left windows).
FEATURES = (
    "causal",
    "segments",
    "positions",
    "window",
    "window_right",
    "lengths",
    "mask",
    "bias",
    "shaw",
    "score_mod",
    "row_col",
    "dropout",
    "traced_scale",
)

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
_CUDNN_DTYPES = ("bfloat16", "float16")
_CUDNN_MAX_HEAD_DIM = 128  # 256 on Hopper and later; the rule does not know the device
_CUDNN_FEATURES = ("causal", "window", "lengths", "mask", "bias")  # what jax.nn hands it


@dataclasses.dataclass(frozen=True)
class Call:
    """What the rule reads of one attention call.

    `t`, `s`: query and key lengths; `head_dim`, `value_head_dim`: H and Hv;
    `batch_heads`: B times the query heads N; `dtype`: the query's dtype name;
    `features`: the names of `FEATURES` the call uses; `score_mod`: which mod, in
    which form (`mod_form`), when `features` has "score_mod": each mod is its own
    kernel code, so a GPU pass of one admits no other.
    """

    t: int
    s: int
    head_dim: int
    value_head_dim: int
    batch_heads: int
    dtype: str
    features: frozenset[str] = frozenset()
    score_mod: str = ""

    def __post_init__(self):
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise ValueError(f"Call: unknown features {sorted(unknown)}; known: {FEATURES}")
        object.__setattr__(self, "features", frozenset(self.features))
        if self.score_mod and "score_mod" not in self.features:
            raise ValueError(f"Call: score_mod={self.score_mod!r} without the score_mod feature")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """A kernel configuration as the float64 check on a GPU names it."""

    family: str  # "cudnn" or "pallas"
    dtype: str
    head_dim: int
    features: tuple[str, ...]  # sorted
    score_mod: str = ""  # `mod_form`'s: "t5 (distance tiles)", "alibi_causal (per logit)"

    def __str__(self) -> str:
        feats = "+".join(self.features) or "plain"
        mod = f" [{self.score_mod}]" if self.score_mod else ""
        return f"{self.family} {self.dtype} head dim {self.head_dim} {feats}{mod}"


def mod_form(name: str, distance: bool) -> str:
    """How `Call.score_mod` names a score mod: its name and the form its kernels
    compute it in, from distance tiles (a distance mod at default positions) or
    per logit (`jattn.attention.pallas.distance_tiles.applies`), two kernel codes."""
    return f"{name} ({'distance tiles' if distance else 'per logit'})"


def mod_name(form: str) -> str:
    """The score mod's name in a `mod_form` string ("" for none): its inverse's first half."""
    return form.partition(" (")[0]


@dataclasses.dataclass(frozen=True)
class Verified:
    """One configuration that passed the float64 check on a GPU.

    `run`: the committed CSV of that run, relative to the repository root
    (under docs/gpu_runs/); `cell`: its check cell (``stage/cell`` as the CSV's
    first two columns), every row of which passed (``PASS``: each backward the
    cell ran); `impl`: where a cell checks several kernels (a score mods cell:
    one row set per mod, ``pallas_alibi``, ``pallas_t5``), the rows of this one
    (the CSV's ``impl``); `device`: the GPU, as docs/gpu.md names it.
    """

    config: KernelConfig
    run: str
    cell: str
    device: str
    impl: str = ""


# The configurations in the rule. Empty: none has passed on a GPU yet.
VERIFIED: tuple[Verified, ...] = ()


@dataclasses.dataclass(frozen=True)
class Choice:
    """What the rule chose and why; `wanted` (the kernel configuration),
    `why_wanted` and `why_not` are set when it routed around a kernel."""

    name: str
    reason: str
    wanted: KernelConfig | None = None
    why_wanted: str | None = None
    why_not: str | None = None

    def message(self, call: Call, platform: str) -> str:
        """One line naming the path, the call's shape and, when routed around,
        what was wanted and why not."""
        shape = (
            f"{call.dtype} T={call.t} S={call.s} H={call.head_dim} "
            f"B*N={call.batch_heads} on {platform}"
        )
        line = f"jattn: attention implementation=None -> {self.name!r} ({self.reason}; {shape})"
        if self.wanted is not None:
            line += f"; would have used {self.wanted} ({self.why_wanted}) but {self.why_not}"
        return line


def cudnn_misfit(call: Call, platform: str) -> str | None:
    """Why jax.nn's cuDNN path cannot take `call` on `platform` (None: it can)."""
    if platform == "rocm" or platform not in GPU_PLATFORMS:
        return f"cuDNN is NVIDIA's ({platform})"
    if call.dtype not in _CUDNN_DTYPES:
        return f"cuDNN takes bf16/fp16, not {call.dtype}"
    if call.head_dim != call.value_head_dim:
        return "cuDNN here takes equal key and value head dims"
    if call.head_dim % 8 or call.head_dim > _CUDNN_MAX_HEAD_DIM:
        return f"cuDNN takes head dims that are multiples of 8 up to {_CUDNN_MAX_HEAD_DIM}"
    extra = sorted(call.features - set(_CUDNN_FEATURES))
    if extra:
        return f"jax.nn's cuDNN path cannot take {', '.join(extra)}"
    if "bias" in call.features and (call.t % 2 or call.s % 2):
        return "cuDNN's bias needs even lengths in training"
    return None


def _portable(call: Call, gpu: bool) -> tuple[str, str]:
    """The path that runs wherever XLA does: xla, or chunked where memory needs tiling."""
    if call.t * call.s >= CHUNKED_MIN_LOGITS:
        return "chunked", f"T*S >= {CHUNKED_MIN_LOGITS}: tiled for memory"
    if gpu and call.batch_heads * call.t * call.s >= GPU_XLA_MAX_LOGITS:
        return "chunked", f"B*N*T*S >= {GPU_XLA_MAX_LOGITS}: tiled for GPU memory"
    return "xla", f"T*S < {CHUNKED_MIN_LOGITS}: small enough to materialise"


def _is_verified(config: KernelConfig, verified) -> bool:
    return any(entry.config == config for entry in verified)


def choose(call: Call, platform: str, verified: tuple[Verified, ...] = VERIFIED) -> Choice:
    """The implementation `implementation=None` runs for `call` on `platform`
    (``jax.default_backend()``'s name: "cpu", "gpu", "cuda", "rocm", "tpu").

    `verified`: the kernel configurations allowed (default `VERIFIED`).
    """
    gpu = platform in GPU_PLATFORMS
    portable, why = _portable(call, gpu)
    if not gpu:
        kernels = "the Mosaic kernels never ran on a TPU" if platform == "tpu" else "the CPU"
        return Choice(portable, f"{why} ({kernels})")
    logits = call.batch_heads * call.t * call.s
    if logits < GPU_SMALL_LOGITS:
        return Choice("xla", f"B*N*T*S < {GPU_SMALL_LOGITS}: launch bound")
    misfit = cudnn_misfit(call, platform)
    family = "pallas" if misfit else "cudnn"
    features = tuple(sorted(call.features))
    config = KernelConfig(family, call.dtype, call.head_dim, features, call.score_mod)
    reason = "fits cuDNN" if family == "cudnn" else f"{misfit}: the Pallas kernels"
    if _is_verified(config, verified):
        return Choice(family, f"{reason}, verified on a GPU")
    return Choice(
        portable,
        why,
        wanted=config,
        why_wanted=reason,
        why_not="that configuration has not passed the float64 check on a GPU (docs/gpu.md)",
    )


_ANNOUNCED: set[tuple] = set()
LOGGER = logging.getLogger("jattn.attention")


def announce(choice: Choice, call: Call, platform: str, seen: set | None = None) -> None:
    """Says once per process per path which implementation `implementation=None`
    took: a warning when it routed around a kernel (printed wherever Python
    logging is not configured), an info record otherwise (shown by `jattn
    train`). `seen`: the paths already said (default: this process's)."""
    seen = _ANNOUNCED if seen is None else seen
    key = (choice.name, choice.wanted, platform)
    if key in seen:
        return
    seen.add(key)
    if choice.wanted is not None:
        LOGGER.warning(choice.message(call, platform))
    else:
        LOGGER.info(choice.message(call, platform))


class _Collect(logging.Handler):
    """Keeps each record's message in `lines` (`collected_paths`)."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def collected_paths():
    """Within: every path `announce` says is appended, afresh, to the yielded
    list (this process's once-per-path memory set aside, no handler or root
    logger reached); after: the memory, the logger's level and its
    propagation as they were. `jattn configs --paths` reads a config's paths so."""
    handler = _Collect(logging.INFO)
    seen, level, propagate = set(_ANNOUNCED), LOGGER.level, LOGGER.propagate
    _ANNOUNCED.clear()
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False
    try:
        yield handler.lines
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)
        LOGGER.propagate = propagate
        _ANNOUNCED.clear()
        _ANNOUNCED.update(seen)


def _ran(config: KernelConfig, impl: str) -> bool:
    """Whether a check row's `impl` ("pallas", "pallas_shaw", "pallas_alibi",
    "cudnn") is `config`'s kernel: its family, then Shaw's tables or which mod
    (a mod's name extends the cell's: "alibi_causal" is an "alibi")."""
    family, _, kind = impl.partition("_")
    ran = "shaw" if "shaw" in config.features else mod_name(config.score_mod)
    return family == config.family and (ran == kind or (kind != "" and ran.startswith(kind + "_")))


def verified_problems(entries, root, tracked: set[str], gpu_doc: str) -> list[str]:
    """What is wrong with `entries` (`Verified`): a run not committed (`tracked`:
    the repository's tracked paths), not named in docs/gpu.md (`gpu_doc`: its
    text), without a float64 check row for the cell (and `impl`), with one
    that did not pass (the check stage writes ``PASS`` or ``FAIL ...`` a row),
    or whose rows name another dtype, head dim, causality or kernel (family,
    Shaw's tables, which mod) than the entry's configuration. Empty: every
    entry holds."""
    import csv  # noqa: PLC0415
    import pathlib  # noqa: PLC0415

    problems = []
    for entry in entries:
        where = f"{entry.config} ({entry.run}, {entry.cell})"
        if not entry.run.startswith("docs/gpu_runs/") or entry.run not in tracked:
            problems.append(f"{where}: the run is not a committed file under docs/gpu_runs/")
            continue
        if entry.run.removeprefix("docs/") not in gpu_doc or entry.device not in gpu_doc:
            problems.append(f"{where}: docs/gpu.md does not name the run and its device")
        with open(pathlib.Path(root) / entry.run, newline="") as f:
            rows = [
                r
                for r in csv.DictReader(f)
                if f"{r.get('stage')}/{r.get('cell')}" == entry.cell
                and (not entry.impl or r.get("impl") == entry.impl)
            ]
        failed = [r for r in rows if not str(r.get("status")).startswith(("PASS", "ok"))]
        # What the rows say the cell ran, against the entry's configuration.
        c = entry.config
        want = dict(dtype=c.dtype, head_dim=str(c.head_dim), causal=str("causal" in c.features))
        other = {f"{k} {r[k]}" for r in rows for k, v in want.items() if r.get(k) and r[k] != v}
        other |= {f"impl {r['impl']}" for r in rows if r.get("impl") and not _ran(c, r["impl"])}
        if not rows or not entry.cell.startswith("check/"):
            problems.append(f"{where}: the run has no float64 check row for the cell")
        elif failed:
            what = ", ".join(f"{r.get('backward') or '-'}: {r.get('status')}" for r in failed)
            problems.append(f"{where}: the cell's float64 check did not pass ({what})")
        elif other:
            said = ", ".join(sorted(other))
            problems.append(f"{where}: the cell ran another configuration ({said})")
    return problems


class _Stderr(logging.Handler):
    """Writes to whatever `sys.stderr` is at the time (a test's capture, a
    job's log file), not the stream of the moment it was made."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def show_choices() -> None:
    """Print `announce`'s lines, info included, to stderr: what `jattn train`
    calls so that a run says which path its attention took."""
    if not any(isinstance(h, _Stderr) for h in LOGGER.handlers):
        LOGGER.addHandler(_Stderr())
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False  # one line, not one more from a root handler
