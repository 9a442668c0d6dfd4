"""Where a compiled step's time goes: a `jax.profiler` trace, classified by the HLO it ran.

For `train.py --peak`. Each XLA thunk run is a trace event naming its HLO
instruction and module; the instruction's metadata in the compiled module's
text says what made it (the jax name stack, and the Python stack: optax's
files mark the optimizer). Each event's exclusive time goes to `CATEGORIES`, a
fusion's split over its instructions by their output elements (a dot takes
all of it); time in a program run no op covers is the runtime's, in the traced
window outside every run the host's. The rows add up to the window.
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

CATEGORIES = (DENSE, ATTN_DOT, ATTN_REST, ELEMENTWISE, DROPOUT, OPTIMIZER, LAYOUT, GATHER, OTHER)
CATEGORIES += (RUNTIME, HOST)
# What a flop counter counts: everything else is the cost that is not arithmetic.
ARITHMETIC = (DENSE, ATTN_DOT)

RANDOM_KEYS = ("threefry", "random_bits", "_bernoulli", "_uniform", "random_fold_in", "rng_bit")
ATTENTION_KEYS = ("._attend", "dot_product_attention", "flash_attention")
ATTENTION_FILES = ("/jattn/attention/", "/jattn/masks.py", "/jattn/score_mod.py")
LAYOUT_OPS = {"copy", "transpose", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate"}
LAYOUT_OPS |= {"pad", "reverse", "broadcast", "reshape", "iota"}
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
    return math.prod(int(d) for d in m.group(1).split(",") if d) if m else 1


def _frames(lines: list[str]) -> dict[int, tuple[str, ...]]:
    """stack frame id -> the source files of it and its callers (the module's tables)."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        m = re.match(r"^(\d+) (.*)$", line)
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and m:
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
        loc, par = (re.search(rf"{x}=(\d+)", v) for x in ("file_location_id", "parent_frame_id"))
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
            op, op_name, frame = _OPCODE.match(after), _OP_NAME.search(rest), _FRAME.search(rest)
            instructions[name] = Instruction(
                name, op.group(1) if op else "", op_name.group(1) if op_name else "",
                frames.get(int(frame.group(1)), ()) if frame else (),
                _elements(rest[: len(rest) - len(after)]), _CALLS.findall(rest),
            )  # fmt: skip
            current.append(name)
        elif c := _COMPUTATION.match(line):
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
    first_file = ins.files[:1]
    attention = any(k in ins.op_name for k in ATTENTION_KEYS)
    attention |= any(a in f for f in first_file for a in ATTENTION_FILES)
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


def op_shares(ins: Instruction, instructions: dict, computations: dict) -> dict[str, float]:
    """How one executed instruction's time splits over categories (fractions summing to 1)."""
    if ins.opcode != "fusion":
        cat = leaf_category(ins)
        if ins.opcode in ("while", "conditional", "call") and cat == OTHER:
            # A loop's own time (its body's ops are events of their own): what it loops for.
            cat = DROPOUT if any(k in ins.op_name for k in RANDOM_KEYS) else OTHER
        return {cat or LAYOUT: 1.0}
    fused = [instructions[n] for c in ins.calls for n in computations.get(c, [])]
    if dot := next((f for f in fused if f.opcode in ("dot", "convolution")), None):
        return {leaf_category(dot): 1.0}
    weights: dict[str, float] = {}
    for f in fused:
        if (cat := leaf_category(f)) is not None:
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
    """Per-step nanoseconds by category, from the trace of `steps` runs of module
    `module` (`hlo_text` its `compiled.as_text()`) under `log_dir`: ``ns``,
    ``window_ns``, ``ops`` matched, ``unknown`` ops, and the `top_ops` costliest
    instructions (ns a step, name, category, op_name). RuntimeError: no trace or op."""
    from jax.profiler import ProfileData  # noqa: PLC0415

    files = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)
    if not files:
        raise RuntimeError(f"jax.profiler wrote no *.xplane.pb under {log_dir}")
    instructions, computations = parse_hlo(hlo_text)
    per_thread: dict[str, list[tuple[int, int, str]]] = {}
    executes, dispatch = [], []
    for plane in ProfileData.from_file(max(files)).planes:
        for line in plane.lines:
            for ev in line.events:
                stats, span = dict(ev.stats), (ev.start_ns, ev.end_ns)
                if stats.get("hlo_module") == module and "hlo_op" in stats:
                    per_thread.setdefault(f"{plane.name}/{line.name}", []).append(
                        (*span, str(stats["hlo_op"]))
                    )
                elif ev.name == "ThunkExecutor::Execute":
                    executes.append(span)
                elif ev.name.startswith("PjitFunction("):
                    dispatch.append(span)
    if not per_thread:
        raise RuntimeError(f"the trace under {log_dir} has no op of module {module!r}")
    ops = [e for evs in per_thread.values() for e in _exclusive(evs)]
    op_start, op_end = min(e[0] for e in ops), max(e[1] for e in ops)
    executes = [e for e in executes if e[1] > op_start and e[0] < op_end]

    def shares(name):
        ins = instructions.get(name)
        return op_shares(ins, instructions, computations) if ins else {OTHER: 1.0}

    ns, by_op = dict.fromkeys(CATEGORIES, 0.0), {}
    for _, _, name, excl in ops:
        by_op[name] = by_op.get(name, 0.0) + excl
        for cat, share in shares(name).items():
            ns[cat] += excl * share
    top = []
    for name, t in sorted(by_op.items(), key=lambda kv: -kv[1])[:top_ops]:
        where = instructions[name].op_name if name in instructions else "?"
        top.append((t / steps, name, max(shares(name), key=shares(name).get), where))
    busy, op_total = _union([(s, e) for s, e, _, _ in ops]), sum(ns.values())
    if op_total > busy:  # ops overlapped on several threads: scale them to the busy time
        ns = {cat: v * busy / op_total for cat, v in ns.items()}
    in_runs = _union(executes) if executes else busy
    start = min([op_start, *(s for s, _ in executes), *(s for s, _ in dispatch)])
    window = max([op_end, *(e for _, e in executes)]) - start
    ns[RUNTIME], ns[HOST] = max(in_runs - busy, 0), max(window - max(in_runs, busy), 0)
    unknown = sum(name not in instructions for _, _, name, _ in ops)
    ns = {k: v / steps for k, v in ns.items()}
    return dict(ns=ns, window_ns=window / steps, ops=len(ops), unknown=unknown, top=top)
