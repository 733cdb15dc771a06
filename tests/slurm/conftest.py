"""Fixtures for tests that run on a real Slurm cluster.

``slurm_cluster`` (session scope) starts the local test cluster from ``tests/cluster`` (root,
Debian's slurm-wlm + munge: ``tests/cluster/install.sh``) and stops it at the end, or, when
``ZEROSNAKE_SLURM_PARTITION`` is set, uses the site's cluster as is (``ZEROSNAKE_SLURM_ACCOUNT``,
``ZEROSNAKE_GLOO_SOCKET_IFNAME`` optional; ``ZEROSNAKE_SLURM_SHARED_DIR`` must name a folder
every compute node sees). Every test in this folder is marked ``slurm``.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_CLUSTER_DIR = Path(__file__).resolve().parents[1] / "cluster"
if str(_CLUSTER_DIR) not in sys.path:
    sys.path.insert(0, str(_CLUSTER_DIR))

import slurmcluster  # noqa: E402  (tests/cluster is not a package)

SHARED_DIR_ENV = "ZEROSNAKE_SLURM_SHARED_DIR"
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees every collected item of the session: mark only the ones in this folder.
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slurm)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurmcluster.ClusterInfo]:
    """The cluster the tests submit to; SLURM_CONF is exported for the whole session."""
    site = slurmcluster.site_cluster_from_env()
    if site is not None:
        yield site
        return
    reason = slurmcluster.missing_requirements()
    if reason:
        pytest.skip(
            f"no Slurm cluster for the tests: {reason}. Or point the tests at a real cluster "
            f"with {slurmcluster.SITE_PARTITION_ENV}=<partition> (and {SHARED_DIR_ENV})."
        )
    cluster = slurmcluster.TestCluster(tmp_path_factory.mktemp("slurmcluster"))
    info = cluster.start()
    previous = os.environ.get("SLURM_CONF")
    os.environ.update(info.client_env())
    try:
        yield info
    finally:
        cluster.stop()
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
    # Teardown is part of the contract: no daemon, namespace or link may outlive the session.
    rest = cluster.leftovers()
    if rest:
        pytest.fail(f"test cluster left behind: {rest}")


@pytest.fixture
def slurm_workdir(slurm_cluster: slurmcluster.ClusterInfo, tmp_path: Path) -> Path:
    """A fresh folder that the submitting host and every compute node see.

    Locally the nodes' mount namespaces are copies of the host's, so tmp_path works. On a site
    cluster, /tmp is node-local: use a fresh folder under ZEROSNAKE_SLURM_SHARED_DIR."""
    if slurm_cluster.managed:
        return tmp_path
    shared = os.environ.get(SHARED_DIR_ENV)
    if not shared:
        pytest.skip(f"site cluster: set {SHARED_DIR_ENV} to a folder every compute node sees")
    path = Path(shared) / f"zerosnake-test-{uuid.uuid4().hex[:12]}"
    path.mkdir(parents=True)
    return path
