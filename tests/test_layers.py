"""The import structure the README's "What is here" shows: layers whose arrows point one way.

Every import of a harness module — at module level or inside a function — is an arrow. An arrow
may point into the importer's own package or to a lower layer, never up and never between two
sibling packages of one layer; and no set of modules imports itself round (a circle). An import
inside a function must say why it is not at the top (start-up time, an optional dependency, a
process that must configure itself first) in a comment on its line or the line above.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "harness"

#: top to bottom: (layer, the packages or top-level modules in it); the packages of one layer do not
#: import each other, the top-level modules of one layer form one unit
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("commands", ("cli", "__main__")),
    ("experiments", ("experiments",)),
    ("serving", ("serving",)),
    ("drivers", ("drivers",)),
    ("workers", ("workers",)),
    ("candidates", ("candidates",)),
    ("engine, pipeline", ("engine", "pipeline")),
    ("hooks", ("hooks",)),
    ("measure", ("measure",)),
    ("config", ("config", "limits", "errors", "")),  # "": the harness package's own __init__
]
UNITS = {"commands": "commands", "config": "config"}  # layers whose modules are one unit


def modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = ["harness", *p.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _targets(mod: str, is_pkg: bool, node: ast.AST, known: dict[str, Path]) -> list[str]:
    """The harness modules an import statement binds (``from harness import x`` → harness.x)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, *([node.module] if node.module else [])])
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    return sorted({n for n in names if n in known})


@functools.cache  # two tests read the same walk
def arrows() -> tuple[tuple[str, str, bool, int, Path], ...]:
    """(importer, imported, inside a function, line, file) for every import of a harness module."""
    known, out = modules(), []
    for mod, path in known.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, path.name == "__init__.py", node, known):
                    if t != mod:
                        out.append((mod, t, id(node) not in top, node.lineno, path))
    return tuple(out)


def layer_of(mod: str) -> tuple[int, str]:
    """(height of the module's layer, the unit within it that may import itself)."""
    parts = mod.split(".")
    head = parts[1] if len(parts) > 1 else ""
    for i, (layer, names) in enumerate(LAYERS):
        if head in names:
            return len(LAYERS) - i, UNITS.get(layer, head)
    raise AssertionError(f"{mod}: a package the layer table does not know; add it to LAYERS and the README")


def wrong_way(importer: str, imported: str) -> str | None:
    (li, pi), (lt, pt) = layer_of(importer), layer_of(imported)
    if lt > li:
        return "upward"
    if lt == li and pi != pt:
        return "sideways"
    return None


def circles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_every_arrow_points_down():
    bad = sorted({f"{a} → {b} ({why}, {p.relative_to(ROOT.parent)}:{line})"
                  for a, b, _, line, p in arrows() if (why := wrong_way(a, b))})
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_import_circle():
    found = circles([(a, b) for a, b, *_ in arrows()])
    assert not found, "import circles:\n" + "\n".join(" ⇄ ".join(c) for c in found)


def test_imports_inside_functions_say_why():
    silent = [f"{p.relative_to(ROOT.parent)}:{line}" for p in ROOT.rglob("*.py") for line in silent_imports(p)]
    assert not silent, "imports inside functions without a comment saying why:\n" + "\n".join(silent)


def _guarded(tree: ast.AST, node: ast.AST) -> bool:
    """An import probed for under ``try: … except ImportError`` (an optional dependency) explains itself."""
    for t in ast.walk(tree):
        if isinstance(t, ast.Try) and any(node is n for b in t.body for n in ast.walk(b)) \
                and any(_catches_import_error(h.type) for h in t.handlers):
            return True
    return False


def _catches_import_error(kind: ast.expr | None) -> bool:
    names = [kind] if not isinstance(kind, ast.Tuple) else list(kind.elts)
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def silent_imports(path: Path) -> list[str]:
    """Imports inside functions of ``path`` with no comment on their line, their run's first line,
    or the line above the run."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    top = {id(n) for n in tree.body}
    silent = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top and not _guarded(tree, node):
            first = node.lineno - 1  # a run of imports shares the comment of its first line
            while first > 0 and lines[first - 1].strip().startswith(("import ", "from ")):
                first -= 1
            above = lines[first - 1].strip() if first > 0 else ""
            if "#" not in lines[node.lineno - 1] and "#" not in lines[first] and "#" not in above:
                silent.append(f"{node.lineno}: {lines[node.lineno - 1].strip()}")
    return silent


def test_the_checks_catch_what_they_guard(tmp_path):
    """The rules are not vacuous: an upward, a sideways and a circular arrow, and an unexplained
    import inside a function, are each caught."""
    assert wrong_way("harness.measure.stats", "harness.engine.dit") == "upward"
    assert wrong_way("harness.engine.dit", "harness.pipeline.ring") == "sideways"
    assert wrong_way("harness.experiments.compare", "harness.measure.stats") is None
    assert wrong_way("harness.engine.dit", "harness.engine.kvcache") is None
    assert wrong_way("harness.config", "harness.limits") is None and wrong_way("harness.__main__", "harness.cli") is None
    assert circles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]
    assert circles([("a", "b"), ("b", "c")]) == []
    code = tmp_path / "m.py"
    code.write_text("def f():\n    import json\n\n\ndef g():\n    # why: an optional dependency\n    import ray\n\n\n"
                    "def h():\n    try:\n        import av\n    except ImportError:\n        return None\n\n\n"
                    "def k():\n    try:\n        import numpy\n    except ValueError:\n        return None\n")
    assert silent_imports(code) == ["2: import json", "19: import numpy"]


# ---- modules named by string --------------------------------------------------------------------
#: modules that call ``importlib.import_module`` on a package outside the harness only (optional
#: extras found by name), so they hold no table of harness modules
EXTERNAL_LOADERS = {"harness.engine.fa3", "harness.engine.omni.compat", "harness.experiments.replay.op_backends"}


def string_registries() -> dict[str, list[tuple[str, str]]]:
    """importer → the (module, attribute) pairs its table names and imports by string; the
    layer walk above sees no import statement for them."""
    # imported here, not at the top: the other tests of this file read source only, no harness code
    from harness import candidates, cli
    from harness.drivers import launcher
    from harness.engine import backends

    def split(target: str) -> tuple[str, str]:
        module, _, attr = target.partition(":")
        return module, attr

    return {
        "harness.cli": [split(target) for _, _, target in cli.COMMANDS.values()],
        "harness.drivers.launcher": [(m, "main") for m in launcher.WORKERS.values()],
        "harness.engine.backends": [split(t) for t in backends.DIT_BACKENDS.values()],
        "harness.candidates": [(f"harness.candidates.{m}", "CANDIDATE") for m in candidates.MODULES.values()],
    }


def string_loaders() -> set[str]:
    """Modules of the harness whose code calls ``import_module`` (``importlib.import_module`` or a
    bare ``import_module``)."""
    out = set()
    for mod, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name == "import_module":
                    out.add(mod)
    return out


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {e.id for e in ast.walk(t) if isinstance(e, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def test_every_string_registry_is_known_to_this_test():
    loaders = string_loaders()
    assert set(string_registries()) | EXTERNAL_LOADERS <= loaders  # the scan sees the ones listed
    unknown = loaders - set(string_registries()) - EXTERNAL_LOADERS
    assert not unknown, f"modules importing by string that no registry check covers: {sorted(unknown)}"


def test_modules_named_by_string_exist_and_point_down():
    known, bad = modules(), []
    for importer, targets in string_registries().items():
        for module, attr in targets:
            if module not in known:
                bad.append(f"{importer} names {module}, which does not exist")
            elif attr and attr not in top_level_names(known[module]):
                bad.append(f"{importer} names {module}:{attr}, which the module does not define")
            elif why := wrong_way(importer, module):
                bad.append(f"{importer} → {module} ({why}, by string)")
    assert not bad, "\n".join(bad)
