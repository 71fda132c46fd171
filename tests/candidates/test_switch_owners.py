"""Candidates own their switches: an attribute a candidate module sets on the object it patches
(``engine.camera_modulation``, ``out.copy_out``, ``engine.cache`` …) is set nowhere else in the
harness except by that object on itself (``self.…``, its own initial value). An experiment that
wants a candidate goes through ``EnginePatches`` like a worker does (DESIGN §6)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "harness"
CANDIDATES = ROOT / "candidates"
#: (attribute, receiver) pairs that only share a switch's name: a session record's own KV/conv
#: cache (``VaeSession.cache``, the vLLM-Omni session's) is not H6d's ``engine.cache``
SAME_NAME_ONLY = {("cache", "session")}


def _assigned(tree: ast.AST) -> list[ast.Attribute]:
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            out += [e for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Attribute)]
    return out


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else None


def switches() -> set[str]:
    """Attribute names candidate modules assign on something other than their own objects."""
    return {a.attr for p in CANDIDATES.glob("*.py") for a in _assigned(ast.parse(p.read_text()))
            if _root(a.value) != "self"}


def foreign_sets(root: Path, names: set[str]) -> list[str]:
    """``x.name = …`` outside ``candidates/`` for a switch ``name``, where x is not ``self``."""
    out = []
    for p in sorted(root.rglob("*.py")):
        if CANDIDATES in p.parents:
            continue
        for a in _assigned(ast.parse(p.read_text())):
            root_name = _root(a.value)
            if a.attr in names and root_name != "self" and (a.attr, root_name) not in SAME_NAME_ONLY:
                out.append(f"{p.relative_to(root.parent)}:{a.lineno}: {ast.unparse(a)} = …")
    return out


def test_the_scan_finds_the_candidates_switches():
    assert {"camera_modulation", "copy_out", "convert", "cache"} <= switches()


def test_nothing_outside_candidates_flips_a_candidates_switch():
    bad = foreign_sets(ROOT, switches())
    assert not bad, "a candidate's switch set outside harness/candidates (use EnginePatches):\n" + "\n".join(bad)


def test_the_scan_catches_a_foreign_flip(tmp_path):
    pkg = tmp_path / "harness"
    (pkg / "experiments").mkdir(parents=True)
    (pkg / "experiments" / "check.py").write_text(
        "def f(eng, out, session):\n    eng.camera_modulation = object\n    out.copy_out, x = print, 1\n"
        "    session.cache = eng.cache = None\n\n\n"
        "class E:\n    def __init__(self):\n        self.camera_modulation = None\n")
    found = foreign_sets(pkg, {"camera_modulation", "copy_out", "cache"})
    assert found == ["harness/experiments/check.py:2: eng.camera_modulation = …",
                     "harness/experiments/check.py:3: out.copy_out = …",
                     "harness/experiments/check.py:4: eng.cache = …"]
