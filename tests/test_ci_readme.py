"""The README's test command is what CI runs, and it installs the Slurm packages itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO

INSTALL = REPO / "tests" / "cluster" / "install.sh"


def readme_test_command() -> str:
    """The one command of the README's "Install and run the tests" block."""
    text = (REPO / "README.md").read_text()
    section = text.split("**2. Install and run the tests**", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_readme_test_command_installs_the_cluster_packages_first():
    assert readme_test_command().startswith("bash tests/cluster/install.sh && ")
    assert readme_test_command().endswith(".venv/bin/python -m pytest")


def test_ci_runs_exactly_the_readme_command_and_no_second_install():
    ci = (REPO / ".ci" / "run").read_text()
    code = [line for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert readme_test_command() in code
    assert sum("install.sh" in line for line in code) == 1, code
    res = subprocess.run(["bash", "-n", str(REPO / ".ci" / "run")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def _path_without_slurm(tmp_path: Path, *, keep_apt: bool) -> str:
    """A PATH with the tools install.sh uses but not slurmctld (so it wants to install)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    bin_dir.chmod(0o755)
    for tool in ("id", "printf", "sort", "bash", "cat", "dd", "ip", "hostname", "nsenter",
                 "unshare", "munged", "slurmd", *(("apt-get",) if keep_apt else ())):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_install_as_non_root_prints_why_and_succeeds():
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) not found")
    # A world-readable folder (pytest's tmp_path is root's own) for the script and the PATH.
    work = Path(tempfile.mkdtemp(prefix="zs-install-"))
    try:
        work.chmod(0o755)
        script = work / "install.sh"
        shutil.copy(INSTALL, script)
        script.chmod(0o755)
        path = _path_without_slurm(work, keep_apt=True)
        res = subprocess.run(
            [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "bash", str(script)],
            capture_output=True, text=True, env={"PATH": path}, timeout=30,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert res.returncode == 0, res.stderr
    assert "needs root" in res.stderr and "slurm-wlm" in res.stderr
    assert "Slurm tests will skip" in res.stderr


def test_install_without_apt_prints_why_and_succeeds(tmp_path):
    path = _path_without_slurm(tmp_path, keep_apt=False)
    res = subprocess.run([shutil.which("bash"), str(INSTALL)], capture_output=True, text=True,
                         env={"PATH": path}, timeout=30)
    assert res.returncode == 0, res.stderr
    assert "slurm-wlm" in res.stderr
    assert any(why in res.stderr for why in ("apt-get not found", "needs root", "not a Debian"))
