"""Names that match (DESIGN §11): a command's module carries the command's name, and no two modules
of the harness share a basename, so that a file name, a traceback line or an editor tab names one
module. Read from the source tree (ast), nothing imported but the command table."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from harness.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]

#: command → why its module is named otherwise (none today: add one only with its reason)
COMMAND_EXCEPTIONS: dict[str, str] = {}
#: basenames that may repeat: a package's own files, whose name is the package's
SHARED_BASENAMES = frozenset({"__init__.py", "__main__.py"})


def module_file(dotted: str) -> Path | None:
    """The file of a dotted module: ``a/b.py`` or the package's ``a/b/__init__.py``."""
    base = ROOT.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def misnamed_commands(commands: dict[str, str]) -> list[str]:
    """Commands (name → ``module:function``) whose module's last name is not the command's, '-' → '_'."""
    return [f"{name} → {target}" for name, target in commands.items()
            if name not in COMMAND_EXCEPTIONS and target.partition(":")[0].rsplit(".", 1)[-1] != name.replace("-", "_")]


def repeated_basenames(package: Path) -> dict[str, list[str]]:
    """Basenames of more than one module under ``package`` (the shared ones aside), with their paths."""
    seen: dict[str, list[str]] = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        if path.name not in SHARED_BASENAMES:
            seen[path.name].append(str(path.relative_to(package)))
    return {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_every_command_runs_from_the_module_named_after_it():
    targets = {name: target for name, (_, _, target) in COMMANDS.items()}
    assert misnamed_commands(targets) == []
    for name, target in targets.items():
        module, _, function = target.partition(":")
        path = module_file(module)
        assert path is not None, f"{name}: no module {module}"
        assert function in top_level_names(path), f"{name}: {module} defines no {function}"
    assert set(COMMAND_EXCEPTIONS) <= set(targets), "an exception for a command that does not exist"


def test_the_rule_refuses_a_misnamed_command():
    # the shapes the rule was written against: ab-engine served by engine_ab, gate by rundirs
    assert misnamed_commands({"ab-engine": "harness.experiments.engine_ab:main",
                              "gate": "harness.experiments.rundirs:gate_main",
                              "gpu-checks": "harness.experiments.gpu_checks:main"}) == [
        "ab-engine → harness.experiments.engine_ab:main", "gate → harness.experiments.rundirs:gate_main"]


def test_no_two_harness_modules_share_a_basename():
    assert repeated_basenames(ROOT / "harness") == {}


def test_a_repeated_basename_is_found(tmp_path):
    for rel in ("a/report.py", "b/c/report.py", "a/__init__.py", "b/__init__.py", "b/c/__init__.py", "a/other.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert repeated_basenames(tmp_path) == {"report.py": ["a/report.py", "b/c/report.py"]}
