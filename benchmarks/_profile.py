"""Where a compiled step's time goes: a `jax.profiler` trace, classified by the HLO it ran.

A helper of `jattn bench train --peak` (benchmarks/train.py). The CPU
profiler of jax 0.10 writes an XSpace protobuf (`*.xplane.pb`, read with
`jax.profiler.ProfileData`, no tensorboard plugin needed): every XLA thunk
the CPU runtime executes is one event with its HLO instruction's name
(`hlo_op`) and module (`hlo_module`), nested inside a `ThunkExecutor::Execute`
event per program run. The instruction names are looked up in the compiled
module's text (`compiled.as_text()`), whose metadata says what produced each
instruction: the jax name stack (`op_name`, e.g. ``.../self_attention._attend/
dot_general``) and the Python stack (`stack_frame_id` into the module's
FileNames/FileLocations/StackFrames tables: optax's files mark the optimizer).

Every event's exclusive time (less the events nested in it, e.g. a while
loop's body) goes to categories (`CATEGORIES`): a fusion's time is split
over the categories of the instructions fused in it, weighted by their
output elements (a dot in a fusion takes all of it). Time in a program run
that no op covers is the runtime's ("XLA runtime between ops"); time in the
traced window outside every program run is the host's (Python dispatch,
argument handling). The rows add up to the window, so to 100%.
"""

from __future__ import annotations

import glob
import math
import re
from dataclasses import dataclass, field

DROPOUT = "dropout random bits"
OPTIMIZER = "optimizer update (optax)"
DENSE = "dense matmuls (projections, MLP, logits)"
ATTN_DOT = "attention dots (QK^T, PV)"
ATTN_REST = "attention softmax, masks, biases"
ELEMENTWISE = "elementwise and layer norms"
LAYOUT = "copies, transposes, slices"
GATHER = "gathers and scatters (embeddings)"
OTHER = "other (unclassified ops)"
RUNTIME = "XLA runtime between ops"
HOST = "host (dispatch, outside XLA)"

CATEGORIES = (
    DENSE,
    ATTN_DOT,
    ATTN_REST,
    ELEMENTWISE,
    DROPOUT,
    OPTIMIZER,
    LAYOUT,
    GATHER,
    OTHER,
    RUNTIME,
    HOST,
)
# What a flop counter counts: everything else is the cost that is not arithmetic.
ARITHMETIC = (DENSE, ATTN_DOT)

RANDOM_KEYS = ("threefry", "random_bits", "_bernoulli", "_uniform", "random_fold_in", "rng_bit")
ATTENTION_KEYS = ("._attend", "dot_product_attention", "flash_attention")
ATTENTION_FILES = ("/jattn/attention/", "/jattn/masks.py", "/jattn/score_mod.py")
LAYOUT_OPS = {
    "copy",
    "transpose",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "concatenate",
    "pad",
    "reverse",
    "broadcast",
    "reshape",
    "iota",
}
FREE_OPS = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all"}

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")
_CALLS = re.compile(r"\b(?:calls|body|condition|to_apply)=%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


@dataclass
class Instruction:
    """One HLO instruction of the compiled module: what the trace's `hlo_op` names."""

    name: str
    opcode: str
    op_name: str
    files: tuple[str, ...]
    elements: int
    calls: list[str] = field(default_factory=list)


def _skip_type(rest: str) -> str:
    """`rest` after an instruction's result type (a shape or a parenthesised tuple)."""
    if not rest.startswith("("):
        return rest.split(" ", 1)[1] if " " in rest else ""
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[i + 1 :].lstrip()
    return ""


def _elements(result_type: str) -> int:
    """Elements of the first array in an instruction's result type (1 for a scalar)."""
    m = _SHAPE.search(result_type)
    if not m:
        return 1
    return math.prod(int(d) for d in m.group(1).split(",") if d) if m.group(1) else 1


def _frames(lines: list[str]) -> dict[int, tuple[str, ...]]:
    """stack frame id -> the source files of it and its callers (the module's tables)."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        m = re.match(r"^(\d+) (.*)$", line)
        if current is not None and m:
            current[int(m.group(1))] = m.group(2)
        elif line.strip():
            current = None
    names = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    loc_file = {
        k: names.get(int(re.search(r"file_name_id=(\d+)", v).group(1)), "")
        for k, v in tables.get("FileLocations", {}).items()
        if "file_name_id=" in v
    }
    parent, frame_file = {}, {}
    for k, v in tables.get("StackFrames", {}).items():
        loc = re.search(r"file_location_id=(\d+)", v)
        par = re.search(r"parent_frame_id=(\d+)", v)
        frame_file[k] = loc_file.get(int(loc.group(1)), "") if loc else ""
        parent[k] = int(par.group(1)) if par else 0
    out = {}
    for k in frame_file:
        chain, seen, f = [], set(), k
        while f in frame_file and f not in seen:
            seen.add(f)
            chain.append(frame_file[f])
            f = parent[f]
        out[k] = tuple(chain)
    return out


def parse_hlo(text: str) -> tuple[dict[str, Instruction], dict[str, list[str]]]:
    """The compiled module's instructions by name, and each computation's instruction names."""
    lines = text.splitlines()
    frames = _frames(lines)
    instructions: dict[str, Instruction] = {}
    computations: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines:
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            name, rest = m.groups()
            after = _skip_type(rest)
            op = _OPCODE.match(after)
            op_name = _OP_NAME.search(rest)
            frame = _FRAME.search(rest)
            instructions[name] = Instruction(
                name=name,
                opcode=op.group(1) if op else "",
                op_name=op_name.group(1) if op_name else "",
                files=frames.get(int(frame.group(1)), ()) if frame else (),
                elements=_elements(rest[: len(rest) - len(after)]),
                calls=_CALLS.findall(rest),
            )
            current.append(name)
            continue
        c = _COMPUTATION.match(line)
        if c:
            current = computations.setdefault(c.group(1), [])
        elif line.startswith("}"):
            current = None
    return instructions, computations


def leaf_category(ins: Instruction) -> str | None:
    """The category of one unfused instruction (None: free, e.g. a bitcast)."""
    if ins.opcode in FREE_OPS:
        return None
    if ins.opcode == "rng-bit-generator" or any(k in ins.op_name for k in RANDOM_KEYS):
        return DROPOUT
    if any("/optax/" in f for f in ins.files):
        return OPTIMIZER
    attention = any(k in ins.op_name for k in ATTENTION_KEYS) or any(
        a in f for f in ins.files[:1] for a in ATTENTION_FILES
    )
    if ins.opcode in ("dot", "convolution"):
        return ATTN_DOT if attention else DENSE
    if attention:
        return ATTN_REST
    if ins.opcode in LAYOUT_OPS:
        return LAYOUT
    if ins.opcode in ("gather", "scatter"):
        return GATHER
    if ins.opcode in ("custom-call", "while", "conditional", "call", "all-reduce", "infeed"):
        return OTHER
    return ELEMENTWISE


def op_shares(
    ins: Instruction,
    instructions: dict[str, Instruction],
    computations: dict[str, list[str]],
) -> dict[str, float]:
    """How one executed instruction's time splits over categories (fractions summing to 1)."""
    if ins.opcode != "fusion":
        cat = leaf_category(ins)
        if ins.opcode in ("while", "conditional", "call") and cat == OTHER:
            # A loop's own time (its body's ops are events of their own): what it loops for.
            cat = DROPOUT if any(k in ins.op_name for k in RANDOM_KEYS) else OTHER
        return {cat or LAYOUT: 1.0}
    fused = [instructions[n] for c in ins.calls for n in computations.get(c, [])]
    for f in fused:
        if f.opcode in ("dot", "convolution"):
            return {leaf_category(f): 1.0}
    weights: dict[str, float] = {}
    for f in fused:
        cat = leaf_category(f)
        if cat is not None:
            weights[cat] = weights.get(cat, 0.0) + f.elements
    total = sum(weights.values())
    if not total:
        return {leaf_category(ins) or LAYOUT: 1.0}
    return {k: v / total for k, v in weights.items()}


def _exclusive(events: list[tuple[int, int, str]]) -> list[tuple[int, int, str, int]]:
    """(start, end, hlo_op, exclusive ns) of one thread's events, nesting subtracted."""
    events = sorted(events, key=lambda e: (e[0], -e[1]))
    out: list[list] = []
    stack: list[int] = []
    for start, end, name in events:
        while stack and out[stack[-1]][1] <= start:
            stack.pop()
        if stack:
            parent = out[stack[-1]]
            parent[3] -= min(end, parent[1]) - start
        out.append([start, end, name, end - start])
        stack.append(len(out) - 1)
    return [tuple(e) for e in out]


def _union(intervals: list[tuple[int, int]]) -> int:
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            total += (cur_e - cur_s) if cur_e is not None else 0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0)


def breakdown(log_dir: str, hlo_text: str, module: str, steps: int, top_ops: int = 8) -> dict:
    """Per-step nanoseconds by category, from the trace under `log_dir`.

    Args:
      log_dir: what `jax.profiler.trace` wrote (searched for `*.xplane.pb`).
      hlo_text: `compiled.as_text()` of the traced program.
      module: its module name (the text's `HloModule` name, e.g. ``jit_train_step``).
      steps: how many runs of the program the trace holds.
      top_ops: how many of the costliest instructions to list.

    Returns:
      ``{"ns": {category: ns a step}, "window_ns": ns a step, "ops": events
      matched, "unknown": events whose op is not in the module, "top": the
      `top_ops` costliest instructions as (ns a step, name, main category,
      jax op_name)}``.

    Raises:
      RuntimeError: no trace file, or no event of `module` in it.
    """
    from jax.profiler import ProfileData  # noqa: PLC0415

    files = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)
    if not files:
        raise RuntimeError(f"jax.profiler wrote no *.xplane.pb under {log_dir}")
    instructions, computations = parse_hlo(hlo_text)
    data = ProfileData.from_file(max(files))
    per_thread: dict[str, list[tuple[int, int, str]]] = {}
    executes, dispatch = [], []
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                if stats.get("hlo_module") == module and "hlo_op" in stats:
                    key = f"{plane.name}/{line.name}"
                    per_thread.setdefault(key, []).append(
                        (ev.start_ns, ev.end_ns, str(stats["hlo_op"]))
                    )
                elif ev.name == "ThunkExecutor::Execute":
                    executes.append((ev.start_ns, ev.end_ns))
                elif ev.name.startswith("PjitFunction("):
                    dispatch.append((ev.start_ns, ev.end_ns))
    if not per_thread:
        raise RuntimeError(f"the trace under {log_dir} has no op of module {module!r}")
    ops = [e for evs in per_thread.values() for e in _exclusive(evs)]
    op_start, op_end = min(e[0] for e in ops), max(e[1] for e in ops)
    executes = [e for e in executes if e[1] > op_start and e[0] < op_end]
    ns = dict.fromkeys(CATEGORIES, 0.0)
    unknown = 0
    by_op: dict[str, float] = {}
    for _, _, name, excl in ops:
        by_op[name] = by_op.get(name, 0.0) + excl
        ins = instructions.get(name)
        if ins is None:
            unknown += 1
            ns[OTHER] += excl
            continue
        for cat, share in op_shares(ins, instructions, computations).items():
            ns[cat] += excl * share
    top = []
    for name, t in sorted(by_op.items(), key=lambda kv: -kv[1])[:top_ops]:
        ins = instructions.get(name)
        shares = op_shares(ins, instructions, computations) if ins else {OTHER: 1.0}
        where = ins.op_name if ins else "?"
        top.append((t / steps, name, max(shares, key=shares.get), where))
    busy = _union([(s, e) for s, e, _, _ in ops])
    op_total = sum(ns.values())
    if op_total > busy:  # ops overlapped on several threads: scale them to the busy time
        for cat in ns:
            ns[cat] *= busy / op_total
    in_runs = _union(executes) if executes else busy
    start = min([op_start, *(s for s, _ in executes), *(s for s, _ in dispatch)])
    window = max([op_end, *(e for _, e in executes)]) - start
    ns[RUNTIME] = max(in_runs - busy, 0)
    ns[HOST] = max(window - max(in_runs, busy), 0)
    return {
        "ns": {k: v / steps for k, v in ns.items()},
        "window_ns": window / steps,
        "ops": len(ops),
        "unknown": unknown,
        "top": top,
    }
