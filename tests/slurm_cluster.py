"""A real Slurm cluster for the tests: `scripts/slurm-local.sh` in a temp dir, with accounting
(slurmdbd + MariaDB), so `sacct` reports job states as on a production cluster. One node by
default; with `nodes=N` each node is a network + UTS namespace of its own on one bridge, and the
script's fault commands (daemon restarts, a killed slurmd, a cut link) act on it."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "slurm-local.sh"
BINARIES = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "munged", "mariadbd")
# sacct states of a job that will not change any more (everything but PENDING, RUNNING, ...).
FINAL_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"}  # fmt: skip
# sinfo states of a node that takes jobs.
UP_STATES = {"idle", "mixed", "allocated"}


@dataclasses.dataclass(frozen=True)
class SlurmCluster:
    state_dir: Path
    node: str  # the first node: the only one of a single-node cluster
    env: dict[str, str]  # the caller's environment with SLURM_CONF, for every Slurm client
    port: int = 0  # slurmctld's; slurmd +1, slurmdbd +2; a multi-node cluster's names derive from it
    nodes: list[str] = dataclasses.field(default_factory=list)
    node_addrs: dict[str, str] = dataclasses.field(default_factory=dict)  # NodeAddr by node name

    def run(self, *args: str, timeout_s: float = 60, check: bool = True) -> str:
        """Runs a Slurm client command; returns its stdout, raises with its stderr (unless
        `check=False`)."""
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def fault(self, command: str, *args: str, timeout_s: float = 120) -> str:
        """`slurm-local.sh COMMAND ARGS... STATE_DIR`: restart slurmctld|slurmdbd, kill-slurmd NODE,
        start-slurmd NODE, link NODE down|up, drain NODE, resume NODE, status."""
        return _script(command, *args, self.state_dir, env=self.env, timeout_s=timeout_s)

    def job_state(self, job_id: str) -> str:
        """The allocation's state in sacct ("" before slurmdbd has the record), first word only:
        "CANCELLED by 0" -> "CANCELLED"."""
        out = self.run("sacct", "-j", job_id, "-X", "--format=State", "--noheader", "--parsable2")
        return out.split()[0] if out.strip() else ""

    def wait_final_state(self, job_id: str, timeout_s: float = 60) -> str:
        """Polls sacct until the job reached a final state (its record lands < ~1 s after the end)."""
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in FINAL_STATES:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {state or 'unknown to sacct'} after {timeout_s} s")

    def wait_running(self, job_id: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while (state := self.run("squeue", "-h", "-j", job_id, "-o", "%T").strip()) != "RUNNING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not running after {timeout_s} s: {state!r}")
            time.sleep(0.2)

    def node_state(self, node: str) -> str:
        """sinfo's state: "idle", "down*" (* = not responding), "drained", ..."""
        return self.run("sinfo", "-h", "-N", "-n", node, "-o", "%T").strip()

    def wait_node_state(self, node: str, states: set[str], timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        while (state := self.node_state(node)) not in states:
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node} {state}, not {sorted(states)}, after {timeout_s} s")
            time.sleep(0.5)
        return state


def missing_binaries() -> list[str]:
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    return [name for name in BINARIES if shutil.which(name, path=path) is None]


def _ports_free(base: int, num_ports: int) -> bool:
    for port in range(base, base + num_ports):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _free_port_base(num_ports: int = 3) -> int:
    """slurmctld, slurmd and slurmdbd take base, base+1, base+2; a random base keeps two test
    sessions on one machine apart (and with it a multi-node cluster's bridge, namespaces, node
    names and subnet, which the script derives from the port)."""
    for _ in range(100):
        base = random.randrange(20000, 30000)
        if _ports_free(base, num_ports):
            return base
    raise RuntimeError(f"no {num_ports} consecutive free ports in 20000-30000 on 127.0.0.1")


def _script(*args: str | Path, env: dict[str, str], timeout_s: float = 300) -> str:
    done = subprocess.run(["bash", str(SCRIPT), *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout_s)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(
            f"slurm-local.sh {' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr.strip()}"
        )
    return done.stdout


def _client_env(state_dir: Path) -> dict[str, str]:
    """The caller's environment without the SLURM_* variables of an outer allocation (they would
    point srun at a job id our cluster never had), plus what `slurm-local.sh env` exports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for line in _script("env", state_dir, env=env).splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value
    env["PATH"] = f"{env.get('PATH', '/usr/bin:/bin')}:/usr/sbin:/sbin"
    return env


@contextmanager
def slurm_cluster(
    nodes: int = 1,
    inter_node_mbit: int | None = None,
    inter_node_latency_ms: int | None = None,
    cpus_per_node: int | None = None,
) -> Iterator[SlurmCluster]:
    """Starts a fresh cluster in a temp dir, yields it, stops it and removes the dir. One node
    (the machine's hostname, 8 CPUs) by default; `nodes=N` gives N namespaced nodes of 2 CPUs,
    their links shaped to `inter_node_mbit`. As root the script installs missing packages
    itself; anyone else gets an error naming them."""
    if os.geteuid() != 0:
        missing = missing_binaries()
        install = (f"Slurm binaries missing ({', '.join(missing)}): as root, `make system-deps` installs "
                   "them; " if missing else "")  # fmt: skip
        raise RuntimeError(f"{install}the local Slurm cluster (scripts/slurm-local.sh) needs root")
    # Not pytest's tmp_path: munged wants every directory above its socket searchable by all,
    # and pytest's are 0700.
    state_dir = Path(tempfile.mkdtemp(prefix="tuner-slurm-"))
    state_dir.chmod(0o755)
    port = _free_port_base()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_LOCAL_")}
    env["SLURM_LOCAL_PORT"] = str(port)
    options = [f"--nodes={nodes}"]
    for option, value in (("--inter-node-mbit", inter_node_mbit),
                          ("--inter-node-latency-ms", inter_node_latency_ms),
                          ("--cpus-per-node", cpus_per_node)):  # fmt: skip
        if value is not None:
            options.append(f"{option}={value}")
    try:
        _script("start", *options, state_dir, env=env)
        cluster = SlurmCluster(state_dir, node="", env=_client_env(state_dir), port=port)
        rows = [line.split() for line in cluster.run("sinfo", "-h", "-N", "-o", "%N %o").splitlines()]
        yield dataclasses.replace(cluster, node=rows[0][0], nodes=[name for name, _ in rows],
                                  node_addrs=dict(rows))  # fmt: skip
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(state_dir)], env=env, capture_output=True)
        shutil.rmtree(state_dir, ignore_errors=True)
