"""docs/schemes.md shows the repository's code and names every hook and option.

The guide to adding a scheme drifted from the code once (a 10-line `_fire`
that was not FIRE, a hook missing from its list). So every python block of
the doc names, on its first line, the file it is taken from, and must be found
there word for word; the hook table names every method of
`jattn.models.scheme.Scheme`; the scheme table names every option of every
registered scheme.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

from jattn.models.scheme import option_groups

REPO = pathlib.Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "schemes.md"


def python_blocks(text: str) -> list[tuple[str, str]]:
    """`(source path, code)` of every python block: the path from its first
    line (``# jattn/...``), the code after it without surrounding blank lines."""
    out = []
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        first, _, rest = block.partition("\n")
        path = first.removeprefix("# ").strip() if first.startswith("# ") else ""
        out.append((path, rest.strip("\n")))
    return out


def scheme_hooks() -> list[str]:
    """The methods of `Scheme`, read from jattn/models/scheme.py."""
    tree = ast.parse((REPO / "jattn" / "models" / "scheme.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Scheme":
            return [n.name for n in node.body if isinstance(n, ast.FunctionDef)]
    raise AssertionError("jattn/models/scheme.py defines no Scheme")


def test_every_python_block_of_the_doc_is_in_the_file_it_names():
    blocks = python_blocks(DOC.read_text(encoding="utf-8"))
    assert len(blocks) >= 6
    for path, code in blocks:
        assert path, f"a python block of docs/schemes.md names no source file:\n{code[:200]}"
        source = (REPO / path).read_text(encoding="utf-8")
        assert code in source, f"docs/schemes.md shows code that is not in {path}:\n{code}"
    named = {path for path, _ in blocks}
    worked_example = {  # FIRE: its formula, its component, its line in the registry
        "jattn/positions/fire.py",
        "jattn/models/score_mod_schemes.py",
        "jattn/models/schemes.py",
    }
    assert worked_example <= named


def test_the_block_check_fails_on_code_the_source_lacks(tmp_path):
    text = "```python\n# jattn/x.py\ndef f():\n    return 2\n```\n"
    [(path, code)] = python_blocks(text)
    assert (path, code) == ("jattn/x.py", "def f():\n    return 2")
    assert code not in "def f():\n    return 1\n"


def test_the_doc_names_every_hook_of_a_scheme():
    text = DOC.read_text(encoding="utf-8")
    hooks = scheme_hooks()
    assert {"embed", "rotate", "shift_queries", "score_mod", "shaw", "stack_state"} <= set(hooks)
    missing = [h for h in hooks if f"`{h}(" not in text]
    assert not missing, f"docs/schemes.md's hook table lacks {missing}"


def test_the_doc_names_every_option_of_every_scheme():
    text = DOC.read_text(encoding="utf-8")
    groups = option_groups()
    assert {"rope", "t5", "shaw", "fire", "alibi", "xpos", "transformer_xl"} <= set(groups)
    missing = [
        f"{key}.{field.name}"
        for key, cls in groups.items()
        for field in dataclasses.fields(cls)
        if f"{key}.{field.name}" not in text
    ]
    assert not missing, f"docs/schemes.md's scheme table lacks the options {missing}"
