"""The 15 tasks of Delétang et al. (2023), one pure generator each.

Delétang et al., "Neural Networks and the Chomsky Hierarchy" (ICLR 2023),
tasks as defined by their code (google-deepmind/neural_networks_chomsky_hierarchy,
``tasks/{regular,dcf,cs}/*.py``; the paper's settings from
``experiments/constants.py``: modulus 5, binary strings, bucket sort over 5
symbols, modular arithmetic with brackets using ``+ - *``). Ruoss et al.
(2023), "Randomized Positional Encodings", use the same tasks.

Each generator is ``(rng, length) -> (inputs, targets)``: `length` is the
paper's input length (the number of input tokens; modular arithmetic without
brackets rounds an even length down to the odd one below, as theirs does),
`rng` a `numpy.random.Generator`, and both strings hold one token a character,
so jattn's character tokenizer gives the paper's vocabulary back. Tokens are
the paper's class numbers written as digits where the paper numbers them
(``0``/``1`` bits, the residues ``0``-``4``, the terminator ``2``, the
missing-symbol ``2`` and padding ``3``) and the paper's own notation where it
writes symbols (``+ - * ( ) x =``); the stack actions (``p`` POP, ``a`` PUSH 0,
``b`` PUSH 1) and cycle moves (``-`` left, ``0`` stay, ``+`` right) are
characters chosen here for the paper's input ids.

Where the paper's target has a fixed length with a terminator and padding
(stack manipulation, binary addition and multiplication: the answer, ``2``,
then ``0`` up to the fixed length), the target is that whole string, so its
length says nothing about the answer; the paper's accuracy counts only the
tokens up to and including the terminator (`scored_length`).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["GENERATORS", "LEVELS", "scored_length", "target_tokens"]

MODULUS = 5  # the paper's modulus for every arithmetic task
_TERMINATOR = "2"  # end of the answer in padded targets


def _digits(rng: np.random.Generator, n: int, base: int) -> str:
    """`n` uniform digits below `base` (<= 10) as a string."""
    return (rng.integers(0, base, size=n).astype(np.uint8) + ord("0")).tobytes().decode()


def _bits(rng: np.random.Generator, n: int) -> str:
    return _digits(rng, n, 2)


def _positive_below_power(rng: np.random.Generator, k: int) -> int:
    """Uniform in [1, 2**k - 1] for any k >= 1 (Python ints: k may be 500)."""
    while True:
        value = int(_bits(rng, k), 2)
        if value:
            return value


def _little_endian(value: int, width: int = 0) -> str:
    """`value` in binary, least significant bit first, zero-filled to `width`."""
    return f"{value:b}".zfill(width)[::-1]


# -- regular ---------------------------------------------------------------------------


def even_pairs(rng, length):
    """Even pairs (regular; ``tasks/regular/even_pairs.py``).

    Input: `length` bits. Correct output: one token, ``0`` when the number of
    adjacent unequal pairs (``01`` and ``10``) is even, else ``1``.
    "001110" -> "0" (one 01, one 10).
    """
    s = _bits(rng, length)
    return s, str(sum(a != b for a, b in zip(s, s[1:], strict=False)) % 2)


def parity_check(rng, length):
    """Parity check (regular; ``tasks/regular/parity_check.py``).

    Input: `length` bits. Correct output: one token, the number of ``1`` mod 2.
    "1010100" -> "1".
    """
    s = _bits(rng, length)
    return s, str(s.count("1") % 2)


def cycle_navigation(rng, length):
    """Cycle navigation (regular; ``tasks/regular/cycle_navigation.py``).

    Input: `length` moves on a cycle of 5 states, ``-`` (left), ``0`` (stay)
    or ``+`` (right), starting at state 0. Correct output: one token, the
    final state in ``0``-``4``. "+-0--" -> "3" (1 - 1 + 0 - 1 - 1 = -2 = 3 mod 5).
    """
    moves = rng.integers(0, 3, size=length)  # the paper's ids: move = id - 1
    return "".join("-0+"[m] for m in moves.tolist()), str(int((moves - 1).sum()) % MODULUS)


def _sum_of_products(digits: list[int], ops: list[str]) -> int:
    """`d0 op0 d1 op1 ...` with the usual precedence (* before + and -), mod 5."""
    total, term, sign = 0, digits[0], 1
    for op, d in zip(ops, digits[1:], strict=True):
        if op == "*":
            term *= d
        else:
            total += sign * term
            term, sign = d, (1 if op == "+" else -1)
    return (total + sign * term) % MODULUS


def modular_arithmetic(rng, length):
    """Modular arithmetic without brackets (regular; ``tasks/regular/modular_arithmetic.py``).

    Input: residues ``0``-``4`` alternating with operators ``+ - *``, of odd
    length (an even `length` is rounded down, as the paper does). Correct
    output: one token, the value mod 5 with ``*`` binding before ``+`` and
    ``-``, left to right. "1+2*3" -> "2"; "1-1-1" -> "4".
    """
    if length % 2 == 0:
        length -= 1
    digits = rng.integers(0, MODULUS, size=length // 2 + 1).tolist()
    ops = ["+*-"[o] for o in rng.integers(0, 3, size=length // 2).tolist()]
    text = "".join(str(d) + op for d, op in zip(digits, ops, strict=False)) + str(digits[-1])
    return text, str(_sum_of_products(digits, ops))


# -- deterministic context-free ---------------------------------------------------------

_POP, _PUSH0, _PUSH1 = "p", "a", "b"


def stack_manipulation(rng, length):
    """Stack manipulation (DCF; ``tasks/dcf/stack_manipulation.py``).

    Input: a stack of 1 to `length` - 1 bits given bottom to top, then actions
    ``p`` (POP; ignored on an empty stack), ``a`` (PUSH 0), ``b`` (PUSH 1) up
    to `length` tokens (`length` 1: one bit, no action). Correct output
    (`length` + 1 tokens): the final stack top to bottom, ``2``, then ``0``
    padding. "0110bpp" -> "11020000"; "110ppp" -> "2000000".
    """
    if length == 1:
        bit = _bits(rng, 1)
        return bit, bit + _TERMINATOR
    stack_length = int(rng.integers(1, length))
    stack = list(_bits(rng, stack_length))
    actions = [(_POP, _PUSH0, _PUSH1)[a] for a in rng.integers(0, 3, size=length - stack_length)]
    final = list(stack)
    for action in actions:
        if action == _POP:
            if final:
                final.pop()
        else:
            final.append("0" if action == _PUSH0 else "1")
    answer = "".join(reversed(final)) + _TERMINATOR
    return "".join(stack + actions), answer.ljust(length + 1, "0")


def reverse_string(rng, length):
    """Reverse string (DCF; ``tasks/dcf/reverse_string.py``).

    Input: `length` bits. Correct output: the bits in reverse order. "011010" -> "010110".
    """
    s = _bits(rng, length)
    return s, s[::-1]


def _bracket_expression(rng, length: int, mult: bool) -> tuple[str, int]:
    """A random bracketed expression of exactly `length` characters and its value mod 5.

    The paper's grammar: 1-4 characters are ``d``, ``-d``, ``(d)``, ``(-d)``;
    longer ones are ``(left op right)`` with the left part 1 to `length` - 4
    characters long and op uniform over ``+ -`` (and ``*`` when `mult`).
    """
    if length < 1:
        raise ValueError(f"an expression needs at least 1 character, got {length}")
    if length <= 4:
        d = int(rng.integers(0, MODULUS))
        text = ("{}", "-{}", "({})", "(-{})")[length - 1].format(d)
        return text, (-d if length in (2, 4) else d) % MODULUS
    left_length = int(rng.integers(1, length - 3))
    left, a = _bracket_expression(rng, left_length, mult)
    right, b = _bracket_expression(rng, length - 3 - left_length, mult)
    op = "+-*"[int(rng.integers(0, 3 if mult else 2))]
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"({left}{op}{right})", value % MODULUS


def modular_arithmetic_brackets(rng, length):
    """Modular arithmetic with brackets (DCF; ``tasks/dcf/modular_arithmetic_brackets.py``,
    ``mult=True`` as in the paper's ``constants.py``).

    Input: a bracketed expression of exactly `length` characters over
    ``0``-``4``, ``+ - *``, ``( )`` and unary minus. Correct output: one
    token, its value mod 5. "(-2)" -> "3"; "(1-(3*4))" -> "4".
    """
    text, value = _bracket_expression(rng, length, True)
    return text, str(value)


def solve_equation(rng, length):
    """Solve equation (DCF; ``tasks/dcf/solve_equation.py``).

    Input (`length` >= 3): an expression over ``+ -`` and brackets of
    `length` - 2 characters (no ``*``, so the solution is unique) in which one
    digit is replaced by ``x``, then ``=`` and the expression's value mod 5.
    Correct output: one token, the digit ``x`` stands for. "(x-2)=3" -> "0".
    Lengths 1 and 2: the paper's placeholder, input all ``0``, output ``0``.
    """
    if length < 3:
        return "0" * length, "0"
    expr, value = _bracket_expression(rng, length - 2, False)
    idx = int(rng.integers(0, len(expr)))
    while not expr[idx].isdigit():  # the paper walks right (cyclically) to a digit
        idx = (idx + 1) % len(expr)
    return f"{expr[:idx]}x{expr[idx + 1 :]}={value}", expr[idx]


# -- context-sensitive ------------------------------------------------------------------


def duplicate_string(rng, length):
    """Duplicate string (CS; ``tasks/cs/duplicate_string.py``).

    Input: `length` bits. Correct output: the bits twice. "101" -> "101101".
    """
    s = _bits(rng, length)
    return s, s + s


def missing_duplicate_string(rng, length):
    """Missing duplicate string (CS; ``tasks/cs/missing_duplicate_string.py``).

    Input: a string of `length` // 2 bits written twice with one position
    replaced by ``2``, then ``3`` when `length` is odd. Correct output: one
    token, the bit at the ``2``. "01100210" -> "1"; "1011213" -> "0". Length
    1: the paper's placeholder, "1" -> "1".
    """
    if length == 1:
        return "1", "1"
    s = _bits(rng, length // 2) * 2
    idx = int(rng.integers(0, len(s)))
    return s[:idx] + "2" + s[idx + 1 :] + "3" * (length % 2), s[idx]


def odds_first(rng, length):
    """Odds first (CS; ``tasks/cs/odds_first.py``).

    Input: `length` bits s_0 s_1 s_2 ... Correct output: the bits at odd
    (0-based) indices, then those at even ones: s_1 s_3 ... s_0 s_2 ...
    "00110101" -> "01110100". This is what the paper's code generates; its
    docstring's example ("0100 0111") shows the other order.
    """
    s = _bits(rng, length)
    return s, s[1::2] + s[::2]


def _binary_operation(rng, length, op: str) -> tuple[str, int | None]:
    """The input of binary addition or multiplication and its value (None: no operator)."""
    if length <= 2:  # the paper: one number of `length` bits, from 0 to 2**length - 2
        value = int(rng.integers(0, 2**length - 1))
        return _little_endian(value, length), None
    left_length = int(rng.integers(1, length - 1))
    right_length = length - 1 - left_length
    a = _positive_below_power(rng, left_length)
    b = _positive_below_power(rng, right_length)
    text = _little_endian(a, left_length) + op + _little_endian(b, right_length)
    return text, a + b if op == "+" else a * b


def binary_addition(rng, length):
    """Binary addition (CS; ``tasks/cs/binary_addition.py``).

    Input: ``a+b``, a and b little-endian (least significant bit first),
    positive, with leading (here: trailing) zeros allowed, `length` tokens in
    all. Correct output (`length` + 1 tokens): a + b little-endian without
    trailing zeros, ``2``, then ``0`` padding. "001+01101" -> "0101120000"
    (4 + 22 = 26; the paper's docstring drops one padding ``0``). Lengths 1
    and 2: the paper's placeholder, one number n of `length` bits and no
    ``+``; the output is n the same way ("01" -> "012").
    """
    text, value = _binary_operation(rng, length, "+")
    value = int(text[::-1], 2) if value is None else value
    return text, (_little_endian(value) + _TERMINATOR).ljust(length + 1, "0")


def binary_multiplication(rng, length):
    """Binary multiplication (CS; ``tasks/cs/binary_multiplication.py``).

    Input: ``a*b`` little-endian as binary addition's. Correct output
    (`length` tokens): a * b little-endian without trailing zeros, ``2``, then
    ``0`` padding. "001*01101" -> "000110120" (4 * 22 = 88). Lengths 1 and 2:
    the paper's placeholder, `length` bits and no ``*``; the output is
    `length` - 1 zeros then ``2``.
    """
    text, value = _binary_operation(rng, length, "*")
    answer = "0" * (length - 1) if value is None else _little_endian(value)
    return text, (answer + _TERMINATOR).ljust(length, "0")


def compute_sqrt(rng, length):
    """Compute square root (CS; ``tasks/cs/compute_sqrt.py``).

    Input: a number from 1 to 2**`length` - 1 in `length` big-endian bits
    (leading zeros kept). Correct output: floor(sqrt(n)) in ceil(`length` / 2)
    big-endian bits. "100101" (37) -> "110" (6).
    """
    n = _positive_below_power(rng, length)
    width = math.ceil(length / 2)
    return f"{n:b}".zfill(length), f"{math.isqrt(n):b}".zfill(width)


def bucket_sort(rng, length):
    """Bucket sort (CS; ``tasks/cs/bucket_sort.py``, 5 symbols as in the paper).

    Input: `length` symbols from ``0``-``4``. Correct output: the same symbols
    in increasing order. "10204112" -> "00111224".
    """
    s = _digits(rng, length, MODULUS)
    return s, "".join(sorted(s))


# Task name (the paper's) -> generator, in the paper's order.
GENERATORS = {
    f.__name__: f
    for f in (
        even_pairs,
        modular_arithmetic,
        parity_check,
        cycle_navigation,
        stack_manipulation,
        reverse_string,
        modular_arithmetic_brackets,
        solve_equation,
        duplicate_string,
        missing_duplicate_string,
        odds_first,
        binary_addition,
        binary_multiplication,
        compute_sqrt,
        bucket_sort,
    )
}

# Task name -> its level of the hierarchy ("regular", "dcf", "cs"), as the paper's table.
LEVELS = {
    name: level
    for level, names in (
        ("regular", ("even_pairs", "modular_arithmetic", "parity_check", "cycle_navigation")),
        (
            "dcf",
            (
                "stack_manipulation",
                "reverse_string",
                "modular_arithmetic_brackets",
                "solve_equation",
            ),
        ),
        (
            "cs",
            (
                "duplicate_string",
                "missing_duplicate_string",
                "odds_first",
                "binary_addition",
                "binary_multiplication",
                "compute_sqrt",
                "bucket_sort",
            ),
        ),
    )
    for name in names
}

_TERMINATED = ("stack_manipulation", "binary_addition", "binary_multiplication")


def scored_length(task: str, target: str) -> int:
    """How many leading tokens of `target` the paper's accuracy counts.

    Stack manipulation and binary addition and multiplication pad their
    answer after a terminator ``2``; the paper's `accuracy_mask` scores the
    tokens up to and including it. Every other task scores the whole target.

    Raises:
      ValueError: an unknown task, or a padded target without its terminator.
    """
    if task not in GENERATORS:
        raise ValueError(f"unknown Chomsky task {task!r}; tasks: {sorted(GENERATORS)}")
    if task not in _TERMINATED:
        return len(target)
    if _TERMINATOR not in target:
        raise ValueError(f"{task} target {target!r} has no terminator {_TERMINATOR!r}")
    return target.index(_TERMINATOR) + 1


def target_tokens(task: str, input_length: int) -> int:
    """The target's tokens (its EOS included) for an input of `input_length` symbols.

    Every task's target length is a function of the input length alone (the
    padded targets are padded to it), which is why the paper can tell an
    encoder-only model the output length through its tape: this is the tape
    `jattn decode` gives such a model for a new input, as evaluation gives
    each example its target's.

    Raises:
      ValueError: an unknown task or an input length below 1.
    """
    if task not in GENERATORS:
        raise ValueError(f"unknown Chomsky task {task!r}; tasks: {sorted(GENERATORS)}")
    if input_length < 1:
        raise ValueError(f"{task}: an input has at least one symbol, got {input_length}")
    return len(GENERATORS[task](np.random.default_rng(0), input_length)[1]) + 1
