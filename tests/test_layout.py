"""The layout's rules, checked on the source: stages stay apart, nothing grows past the size a
reader can hold, and the login node's commands stay free of torch (cycles: test_imports.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env

PKG = REPO / "pipeline"
#: The stages: no module outside a stage imports that stage's internals. (render is not in the
#: list: its pure ``render_run`` is also the workflow's start-up pre-flight.)
STAGES = ("pipeline.train", "pipeline.tokenize", "pipeline.consolidate", "pipeline.evaluate")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every pipeline module ``path`` imports, at module level or inside functions."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t in known:
                out.add(t)
    return out - {name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(path, name, known) for name, path in mods.items()}


def _stage_of(module: str) -> str | None:
    for stage in STAGES:
        if module == stage or module.startswith(stage + "."):
            return stage
    return None


def test_no_module_reaches_into_another_stage() -> None:
    bad = []
    for mod, deps in _graph().items():
        for dep in deps:
            stage = _stage_of(dep)
            if stage is not None and _stage_of(mod) != stage:
                bad.append(f"{mod} imports {dep}")
    assert not bad, "stages talk through files, not imports:\n" + "\n".join(sorted(bad))


def test_files_and_functions_stay_small() -> None:
    long_files, long_functions = [], []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        n = len(text.splitlines())
        if n > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(REPO)}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(REPO)}:{node.lineno} "
                                          f"{node.name}: {length} lines")
    assert not long_files and not long_functions, "\n".join(long_files + long_functions)


@pytest.mark.parametrize("argv", [
    ["-m", "pipeline.status", "--help"],
    ["-m", "pipeline.train", "launch", "--help"],
    ["-m", "pipeline.config", "--help"],
])
def test_login_node_commands_do_not_import_torch(argv: list[str]) -> None:
    res = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True,
                         text=True, cwd=REPO, env=subprocess_env(), timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in res.stderr.splitlines()
                if line.startswith("import time:")}
    assert "usage" in res.stdout
    assert "torch" not in imported, f"{argv} imports torch"
    assert "pipeline.errors" in imported  # the check saw the command's own imports
