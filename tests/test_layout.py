"""The layout's rules: import-linter's contracts hold, nothing grows past the size a reader can
hold, and the login node's commands stay free of torch when run (cycles: test_imports.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env

PKG = REPO / "pipeline"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100


def test_import_contracts_hold() -> None:
    """The layers in pyproject.toml's [tool.importlinter] (stages independent, shared packages
    never importing a stage, the login node's modules free of torch), as CI checks them."""
    res = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], capture_output=True,
                         text=True, cwd=REPO, env=subprocess_env(), timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


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
