"""A real Slurm cluster on this one machine, for the test suite (and by hand).

slurmctld runs on the host ("login node"); each compute node is one slurmd inside its own
network namespace (a veth pair on a private bridge, 10.99.0.0/24 by default, no route out of
the machine), its own UTS namespace (``hostname`` says ``sn1``, ``sn2``, ...) and a private
mount namespace that bind-mounts the node's ``/etc/hosts``, ``/etc/resolv.conf`` and
``/etc/slurm``. Daemons come from Debian's ``slurm-wlm`` and ``munge``
(``tests/cluster/install.sh``). Everything is started with argument lists, stopped by PID, and
every start cleans the leftovers of an earlier run first.

Site mode: when ``ZEROSNAKE_SLURM_PARTITION`` is set (optionally ``ZEROSNAKE_SLURM_ACCOUNT``,
``ZEROSNAKE_GLOO_SOCKET_IFNAME``), nothing is started and the site's cluster is used as is.

Standard library only, so it also runs without the project's virtualenv::

    python tests/cluster/slurmcluster.py start  --workdir /tmp/zs-slurm
    python tests/cluster/slurmcluster.py status --workdir /tmp/zs-slurm
    python tests/cluster/slurmcluster.py stop   --workdir /tmp/zs-slurm
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Names of everything this module makes outside the work folder. Fixed, so that a later start
# can find and remove what a crashed run left behind. All fit Linux's 15-character limit.
BRIDGE = "zsbr0"
NETNS_PREFIX = "zs_"  # network namespace of node sn1 is zs_sn1 (/run/netns/zs_sn1)
VETH_HOST_PREFIX = "zsv_"  # host end of node sn1's veth pair: zsv_sn1 (enslaved to BRIDGE)
VETH_TMP_PREFIX = "zsp_"  # node end before it moves into the namespace and becomes NODE_IFNAME
NODE_IFNAME = "eth0"  # the node's interface inside its namespace: GLOO_SOCKET_IFNAME / NCCL_...
NODE_PREFIX = "sn"
SUBNET_PREFIX = "10.99.0"  # private to this machine; the host is .1, node i is .(10+i)
PARTITION = "debug"
REGISTRY = Path("/run/zerosnake-slurm/cluster.json")  # where the running cluster is recorded
# Held (flock) by whoever runs the cluster, so that two test sessions on one machine take turns
# instead of tearing down each other's cluster (names, addresses and ports are fixed).
LOCK = Path("/run/zerosnake-slurm/lock")
SLURMCTLD_PORT = 6817
SLURMD_PORT = 6818

SITE_PARTITION_ENV = "ZEROSNAKE_SLURM_PARTITION"
SITE_ACCOUNT_ENV = "ZEROSNAKE_SLURM_ACCOUNT"
SITE_IFNAME_ENV = "ZEROSNAKE_GLOO_SOCKET_IFNAME"


class ClusterError(RuntimeError):
    """The test cluster could not be started or queried; the message carries the log tails."""


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """What a test needs to submit to the cluster (the local test cluster or a site's)."""

    partition: str
    account: str | None
    nodes: tuple[str, ...]  # node (and host) names, in order; nodes[0] is the head of -N2 jobs
    managed: bool  # True: started by this module (and stopped by stop()); False: a site cluster
    slurm_conf: str | None = None  # exported as SLURM_CONF for every client (sbatch, srun, ...)
    workdir: str | None = None
    node_addrs: tuple[str, ...] = ()  # node i's address on the bridge (managed cluster only)
    controller_host: str | None = None
    controller_addr: str | None = None  # the bridge's host address; slurmctld listens there
    socket_ifname: str | None = None  # interface for GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME in jobs
    cpus_per_node: int | None = None
    mem_mb: int | None = None
    start_seconds: float | None = None  # wall time of start(), until every node was idle

    def client_env(self) -> dict[str, str]:
        """Environment additions for Slurm clients (sbatch, srun, squeue, submitit)."""
        return {"SLURM_CONF": self.slurm_conf} if self.slurm_conf else {}

    def job_env(self) -> dict[str, str]:
        """Environment additions for distributed jobs: which interface Gloo/NCCL should use.
        Pass to the job only (srun/sbatch env), not to the host's own processes."""
        if not self.socket_ifname:
            return {}
        return {"GLOO_SOCKET_IFNAME": self.socket_ifname, "NCCL_SOCKET_IFNAME": self.socket_ifname}

    def sbatch_args(self) -> list[str]:
        """Partition/account options for sbatch, srun and salloc."""
        args = [f"--partition={self.partition}"]
        if self.account:
            args.append(f"--account={self.account}")
        return args

    def submitit_parameters(self) -> dict[str, str]:
        """Partition/account for submitit's ``AutoExecutor.update_parameters``."""
        params = {"slurm_partition": self.partition}
        if self.account:
            params["slurm_account"] = self.account
        return params

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterInfo:
        data = json.loads(text)
        for key in ("nodes", "node_addrs"):
            data[key] = tuple(data.get(key) or ())
        return cls(**data)


def site_cluster_from_env(env: os._Environ[str] | dict[str, str] | None = None) -> ClusterInfo | None:
    """The site's cluster when ZEROSNAKE_SLURM_PARTITION is set, else None."""
    env = os.environ if env is None else env
    partition = env.get(SITE_PARTITION_ENV)
    if not partition:
        return None
    out = _run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N"], check=True)
    nodes = tuple(dict.fromkeys(line.strip() for line in out.splitlines() if line.strip()))
    return ClusterInfo(
        partition=partition,
        account=env.get(SITE_ACCOUNT_ENV) or None,
        nodes=nodes,
        managed=False,
        slurm_conf=env.get("SLURM_CONF"),
        socket_ifname=env.get(SITE_IFNAME_ENV) or None,
    )


# --------------------------------------------------------------------------------------------
# small helpers


def _run(cmd: list[str], *, check: bool = True, env: dict[str, str] | None = None,
         timeout: float = 60) -> str:
    """Run an argument list; return stdout. Raises ClusterError with stderr on failure."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"{cmd!r} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def _quiet(cmd: list[str]) -> bool:
    """Run an argument list for cleanup; True if it succeeded. Never raises."""
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) counts as gone.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


def _pid_comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _kill_pids(pids: list[int], timeout: float = 10.0) -> None:
    """SIGTERM, wait up to `timeout`, then SIGKILL whatever is left."""
    pids = [p for p in pids if p > 1 and p != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _our_netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(NETNS_PREFIX)]


def _our_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    links = []
    for line in out.splitlines():
        # "12: zsv_sn1@if11: <...>" -> "zsv_sn1"
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if name == BRIDGE or name.startswith((VETH_HOST_PREFIX, VETH_TMP_PREFIX)):
                links.append(name)
    return links


def missing_requirements() -> str | None:
    """Why a local cluster cannot start here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, bind mounts, slurmd)"
    for tool in ("slurmctld", "slurmd", "sinfo", "munged", "munge", "ip", "nsenter", "unshare"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"{tool} not found: run tests/cluster/install.sh (slurm-wlm, munge, iproute2)"
    return None


# --------------------------------------------------------------------------------------------
# the cluster


class TestCluster:
    """One local Slurm cluster: ``TestCluster(workdir).start()`` ... ``.stop()``."""

    __test__ = False  # a helper, not a pytest test class

    def __init__(self, workdir: str | os.PathLike[str], nodes: int = 2, cpus_per_node: int = 2,
                 mem_mb: int = 4000, subnet_prefix: str = SUBNET_PREFIX) -> None:
        if not 1 <= nodes <= 9:
            raise ValueError("nodes must be 1..9 (addresses .11 to .19)")
        self.workdir = Path(workdir).resolve()
        self.n_nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.mem_mb = mem_mb
        self.subnet_prefix = subnet_prefix
        self.node_names = [f"{NODE_PREFIX}{i}" for i in range(1, nodes + 1)]
        self.node_addrs = [f"{subnet_prefix}.{10 + i}" for i in range(1, nodes + 1)]
        self.controller_addr = f"{subnet_prefix}.1"
        # slurmctld compares its own short host name with SlurmctldHost.
        self.controller_host = socket.gethostname().split(".")[0]
        self.info: ClusterInfo | None = None
        self.pids: dict[str, int] = {}  # daemon -> pid, for stop() and leftover checks
        self._lock_fd: int | None = None

    # paths ----------------------------------------------------------------------------------
    @property
    def etc(self) -> Path:
        return self.workdir / "etc"  # slurm.conf; bind-mounted over /etc/slurm in every node

    @property
    def conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def ctld_pidfile(self) -> Path:
        return self.workdir / "run" / "slurmctld.pid"

    def slurmd_pidfile(self, node: str) -> Path:
        return self.workdir / "run" / f"slurmd-{node}.pid"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # start ----------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0, lock_timeout: float = 900.0) -> ClusterInfo:
        """Start the cluster (cleaning whatever an earlier run left) and wait until every node
        is idle. Waits up to `lock_timeout` for another session's cluster to stop first."""
        reason = missing_requirements()
        if reason:
            raise ClusterError(reason)
        self._acquire_lock(lock_timeout)
        t0 = time.monotonic()
        cleanup_leftovers()
        self._write_files()
        munged_started = _ensure_munged()
        self._record(munged_started=munged_started)  # before anything runs: crash-safe cleanup
        try:
            self._make_network()
            self._start_slurmctld()
            for name, addr in zip(self.node_names, self.node_addrs, strict=True):
                self._start_slurmd(name, addr)
            self._wait_idle(timeout=timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise
        self.pids["slurmctld"] = _read_pid(self.ctld_pidfile) or 0
        for n in self.node_names:
            self.pids[f"slurmd-{n}"] = _read_pid(self.slurmd_pidfile(n)) or 0
        self.info = ClusterInfo(
            partition=PARTITION,
            account=None,
            nodes=tuple(self.node_names),
            managed=True,
            slurm_conf=str(self.conf),
            workdir=str(self.workdir),
            node_addrs=tuple(self.node_addrs),
            controller_host=self.controller_host,
            controller_addr=self.controller_addr,
            socket_ifname=NODE_IFNAME,
            cpus_per_node=self.cpus_per_node,
            mem_mb=self.mem_mb,
            start_seconds=round(time.monotonic() - t0, 3),
        )
        (self.workdir / "cluster.json").write_text(self.info.to_json())
        self._record(munged_started=munged_started)
        return self.info

    def _write_files(self) -> None:
        w = self.workdir
        # A fresh state dir per start: job ids restart at 1, so anything keyed on %j (submitit
        # folders) must be fresh too. Logs are kept for post-mortems of the previous start.
        for sub in ("state", "spool", "run"):
            shutil.rmtree(w / sub, ignore_errors=True)
        for sub in ("etc", "state", "run", "log", *(f"spool/{n}" for n in self.node_names)):
            (w / sub).mkdir(parents=True, exist_ok=True)
        # slurmd runs job scripts from its spool dir: 755 (slurm.conf(5)).
        for n in self.node_names:
            (w / "spool" / n).chmod(0o755)
        self.conf.write_text(self._slurm_conf())
        (self.etc / "plugstack.conf").write_text("")  # no SPANK plugins from the host's /etc/slurm
        hosts = ["127.0.0.1 localhost", f"{self.controller_addr} {self.controller_host}"]
        hosts += [f"{a} {n}" for n, a in zip(self.node_names, self.node_addrs, strict=True)]
        (self.etc / "hosts").write_text("\n".join(hosts) + "\n")
        # No DNS server is reachable from a node: fail every lookup at once instead of after the
        # resolver's default 5 s x 2 attempts (a reverse lookup made torchrun 30 s slower).
        (self.etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def _slurm_conf(self) -> str:
        w = self.workdir
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={self.cpus_per_node} "
            f"RealMemory={self.mem_mb} State=UNKNOWN"
            for n, a in zip(self.node_names, self.node_addrs, strict=True)
        )
        return f"""\
# Written by tests/cluster/slurmcluster.py for the zerosnake test cluster. Do not edit: every
# start rewrites it. tests/cluster/README.md explains each setting.
ClusterName=zerosnake
# The controller runs on this machine; clients and nodes reach it on the bridge address.
SlurmctldHost={self.controller_host}({self.controller_addr})
SlurmctldPort={SLURMCTLD_PORT}
SlurmdPort={SLURMD_PORT}
# Root runs every daemon: no slurm user or munge-less auth to set up for a test machine.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Job credentials expire after 5 s (default 120 s): a requeued job may start again only once its
# old credential expired, so this cuts the requeue wait from ~2 min to a few seconds. Read only
# at daemon start (scontrol reconfigure does not apply it).
AuthInfo=cred_expire=5

# No cgroups in this VM (no systemd, no delegated cgroup tree): track processes by parent pid
# and bind no tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd: sacct says "accounting storage is disabled"; status comes from squeue/scontrol.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
PlugStackConfig={self.etc}/plugstack.conf
# Use the configured CPUs/RealMemory even where the hardware differs (several nodes share this
# machine's cores and memory).
SlurmdParameters=config_overrides

# Allocate cores (not whole nodes); memory is not a consumable, so jobs need no --mem.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Schedule every 2 s and backfill every 1 s (defaults 60 s / 30 s): requeued and new jobs start
# within seconds.
SchedulerParameters=sched_interval=2,bf_interval=1
# Jobs may be requeued (submitit's checkpoint/requeue, node failures).
JobRequeue=1
# Keep finished jobs visible to squeue/scontrol for 10 min: without accounting that is the only
# place a job's final state can be read (Snakemake's slurm plugin needs >= 120 s).
MinJobAge=600
# A node that was DOWN (e.g. slurmd restarted) comes back by itself once it registers.
ReturnToService=2
# No limit on how long srun/salloc may sit idle.
InactiveLimit=0
# No mail server here; the default /bin/mail is missing and slurmctld logs an error for it.
MailProg=/bin/true

# Everything lives under the work folder: several clusters (one at a time) never share state.
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool/%n
SlurmctldPidFile={self.ctld_pidfile}
SlurmdPidFile={w}/run/slurmd-%n.pid
SlurmctldLogFile={w}/log/slurmctld.log
SlurmdLogFile={w}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info

{nodes}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _make_network(self) -> None:
        # A bridge on the host holds the controller's address; each node's namespace is joined
        # to it by a veth pair. No default route in the nodes: nothing leaves this machine.
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.controller_addr}/24", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        for name, addr in zip(self.node_names, self.node_addrs, strict=True):
            ns, host_end, node_end = NETNS_PREFIX + name, VETH_HOST_PREFIX + name, VETH_TMP_PREFIX + name
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end])
            _run(["ip", "link", "set", node_end, "netns", ns])
            _run(["ip", "-n", ns, "link", "set", node_end, "name", NODE_IFNAME])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", NODE_IFNAME])
            _run(["ip", "-n", ns, "link", "set", NODE_IFNAME, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "set", host_end, "master", BRIDGE])
            _run(["ip", "link", "set", host_end, "up"])

    def _start_slurmctld(self) -> None:
        # -i: ignore unreadable state (the state dir is fresh anyway). slurmctld daemonizes.
        proc = subprocess.run([_sbin("slurmctld"), "-i", "-f", str(self.conf)], env=self.env,
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise ClusterError(f"slurmctld failed ({proc.returncode}): {proc.stderr}\n"
                               f"{_tail(self.workdir / 'log' / 'slurmctld.log')}")
        self._wait_pidfile(self.ctld_pidfile, "slurmctld", self.workdir / "log" / "slurmctld.log")

    def _start_slurmd(self, name: str, addr: str) -> None:
        # nsenter, not `ip netns exec`: the latter remounts /sys, and slurmd then fails with
        # "No filesystem mounted on /sys/fs/cgroup". unshare gives the node its own host name
        # (UTS) and a private mount namespace for the bind mounts below.
        cmd = [
            "nsenter", f"--net=/run/netns/{NETNS_PREFIX}{name}", "--",
            "unshare", "--uts", "--mount", "--propagation", "private", "--",
            sys.executable, str(Path(__file__).resolve()), "_node-exec",
            "--hostname", name,
            "--bind", str(self.etc / "hosts"), "/etc/hosts",
            "--bind", str(self.etc / "resolv.conf"), "/etc/resolv.conf",
            # Clients inside a job that lost SLURM_CONF (Snakemake's jobstep plugin strips it)
            # find the configuration at the default path.
            "--bind", str(self.etc), "/etc/slurm",
            "--", _sbin("slurmd"), "-N", name, "-f", str(self.conf),
        ]
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        log = self.workdir / "log" / f"slurmd-{name}.log"
        if proc.returncode != 0:
            raise ClusterError(f"slurmd {name} failed ({proc.returncode}): {proc.stderr}\n{_tail(log)}")
        self._wait_pidfile(self.slurmd_pidfile(name), "slurmd", log)

    def _wait_pidfile(self, path: Path, comm: str, log: Path, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = _read_pid(path)
            if pid and _pid_alive(pid) and _pid_comm(pid).startswith(comm):
                return pid
            time.sleep(0.05)
        raise ClusterError(f"{comm} did not come up ({path}):\n{_tail(log)}")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %T"],
                                 env=self.env, capture_output=True, text=True).stdout
            states = dict(line.split(None, 1) for line in out.splitlines() if " " in line)
            if all(states.get(n, "").startswith("idle") for n in self.node_names):
                return
            time.sleep(0.1)
        logs = "\n".join(f"--- {p.name}\n{_tail(p)}" for p in sorted((self.workdir / "log").glob("*.log")))
        raise ClusterError(f"nodes not idle after {timeout:.0f} s: {states}\n{logs}")

    def _record(self, munged_started: bool) -> None:
        REGISTRY.parent.mkdir(parents=True, exist_ok=True)
        REGISTRY.write_text(json.dumps({
            "workdir": str(self.workdir),
            "nodes": self.node_names,
            "munged_started": munged_started,
        }))

    # stop -----------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the daemons and jobs, remove namespaces and bridge. Safe to call twice."""
        try:
            cleanup_leftovers(extra_workdirs=[self.workdir])
        finally:
            self._release_lock()

    def leftovers(self) -> list[str]:
        """What is still there after stop(): namespaces, links, this cluster's daemons."""
        alive = [f"{name} pid {pid}" for name, pid in self.pids.items() if pid and _pid_alive(pid)]
        return leftovers() + alive

    def _acquire_lock(self, timeout: float) -> None:
        if self._lock_fd is not None:
            return
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise ClusterError(f"another session holds {LOCK} (its test cluster is "
                                       f"running) after waiting {timeout:.0f} s") from None
                time.sleep(1)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def status(self) -> str:
        lines = [f"workdir: {self.workdir}", f"SLURM_CONF={self.conf}"]
        ctld = _read_pid(self.ctld_pidfile)
        lines.append(f"slurmctld: {f'pid {ctld}' if ctld and _pid_alive(ctld) else 'not running'}")
        for n in self.node_names:
            pid = _read_pid(self.slurmd_pidfile(n))
            lines.append(f"slurmd {n}: {f'pid {pid}' if pid and _pid_alive(pid) else 'not running'}")
        if ctld and _pid_alive(ctld):
            lines.append(_run(["sinfo", "-N", "-o", "%N %T %c %m %P"], check=False, env=self.env))
            lines.append(_run(["squeue"], check=False, env=self.env))
        return "\n".join(lines)


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _munge_works() -> bool:
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if cred.returncode != 0:
            return False
        return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _ensure_munged() -> bool:
    """Start munged (as user munge, default socket) unless one answers. True if we started it."""
    if _munge_works():
        return False
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    run_dir.chmod(0o755)
    proc = subprocess.run([_sbin("munged")], user="munge", group="munge", extra_groups=[],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise ClusterError(f"munged failed ({proc.returncode}): {proc.stderr.strip()}")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _munge_works():
            return True
        time.sleep(0.1)
    raise ClusterError("munged started but `munge -n | unmunge` still fails")


def cleanup_leftovers(extra_workdirs: list[Path] | None = None) -> None:
    """Remove whatever this module may have left running: jobs and slurmd in our namespaces,
    slurmctld from recorded pid files, the namespaces, veths and bridge, munged if we started it.
    Only processes found through our own pid files or inside our own namespaces are signalled."""
    record: dict = {}
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(REGISTRY.read_text())
    workdirs = [Path(record["workdir"])] if record.get("workdir") else []
    workdirs += [w for w in (extra_workdirs or []) if w not in workdirs]

    # 1. slurmctld first, so that it does not react to the nodes vanishing (nor requeue jobs).
    ctld = []
    for w in workdirs:
        pid = _read_pid(w / "run" / "slurmctld.pid")
        if pid and _pid_alive(pid) and _pid_comm(pid).startswith("slurmctld"):
            ctld.append(pid)
    _kill_pids(ctld)

    # 2. Every process inside one of our node namespaces: slurmd, slurmstepd, job payloads.
    namespaces = _our_netns()
    node_pids: list[int] = []
    for ns in namespaces:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        node_pids += [int(p) for p in out.split() if p.isdigit()]
    # slurmd pid files too, in case a namespace file was removed but its slurmd lives on.
    for w in workdirs:
        for pidfile in (w / "run").glob("slurmd-*.pid"):
            pid = _read_pid(pidfile)
            if pid and _pid_alive(pid) and _pid_comm(pid).startswith("slurmd"):
                node_pids.append(pid)
    # Short grace: everything in a node is disposable, and job payloads may ignore SIGTERM
    # (submitit does, it waits for the time-limit signal instead).
    _kill_pids(sorted(set(node_pids)), timeout=2.0)

    # 3. Links and namespaces. Deleting the host end removes the pair at once (otherwise the
    #    host end lingers a few seconds after its namespace goes).
    for link in _our_links():
        if link != BRIDGE:
            _quiet(["ip", "link", "del", link])
    for ns in namespaces:
        _quiet(["ip", "netns", "del", ns])
    if BRIDGE in _our_links():
        _quiet(["ip", "link", "del", BRIDGE])

    # 4. munged, only if this module started it.
    if record.get("munged_started"):
        pid = _read_pid(Path("/run/munge/munged.pid"))
        if pid and _pid_comm(pid).startswith("munged"):
            _kill_pids([pid])
    for w in workdirs:
        for pidfile in (w / "run").glob("*.pid"):
            pidfile.unlink(missing_ok=True)
    REGISTRY.unlink(missing_ok=True)


def leftovers() -> list[str]:
    """What of ours still exists (for tests and `status`): namespaces, links, live daemons."""
    found = [f"netns {n}" for n in _our_netns()] + [f"link {link}" for link in _our_links()]
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(REGISTRY.read_text())
        found.append(f"registry {REGISTRY} (workdir {record.get('workdir')})")
    return found


# --------------------------------------------------------------------------------------------
# module-level API (one cluster per process)

_current: TestCluster | None = None


def start(workdir: str | os.PathLike[str], nodes: int = 2, cpus_per_node: int = 2,
          mem_mb: int = 4000) -> ClusterInfo:
    """Start the local test cluster (or return the site's, see module doc); export SLURM_CONF."""
    global _current
    site = site_cluster_from_env()
    if site is not None:
        return site
    _current = TestCluster(workdir, nodes=nodes, cpus_per_node=cpus_per_node, mem_mb=mem_mb)
    info = _current.start()
    os.environ["SLURM_CONF"] = info.slurm_conf or ""
    return info


def stop() -> None:
    """Stop the cluster started by start() (a no-op for a site cluster)."""
    global _current
    if _current is not None:
        _current.stop()
        _current = None


# --------------------------------------------------------------------------------------------
# CLI


def _node_exec(argv: list[str]) -> None:
    """Runs inside a node's fresh UTS + mount namespace: bind mounts, host name, exec slurmd."""
    parser = argparse.ArgumentParser(prog="slurmcluster.py _node-exec")
    parser.add_argument("--hostname", required=True)
    parser.add_argument("--bind", nargs=2, action="append", default=[], metavar=("SRC", "DST"))
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    for src, dst in args.bind:
        subprocess.run(["mount", "--bind", src, dst], check=True)
    socket.sethostname(args.hostname)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    os.execv(command[0], command)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_node-exec"]:
        _node_exec(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description="Start/stop the zerosnake test Slurm cluster.")
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus-per-node", type=int, default=2)
    parser.add_argument("--mem-mb", type=int, default=4000)
    args = parser.parse_args(argv)
    cluster = TestCluster(args.workdir, nodes=args.nodes, cpus_per_node=args.cpus_per_node,
                          mem_mb=args.mem_mb)
    if args.action == "start":
        info = cluster.start()
        print(info.to_json())
        print(f"\nexport SLURM_CONF={info.slurm_conf}   # started in {info.start_seconds:.2f} s")
    elif args.action == "stop":
        cluster.stop()
        rest = leftovers()
        print("stopped" if not rest else f"stopped; still present: {rest}")
        return 1 if rest else 0
    else:
        print(cluster.status())
        rest = leftovers()
        if rest:
            print("present:", ", ".join(rest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
