"""A real single-node Slurm cluster for the tests: `scripts/slurm-local.sh` in a temp dir, with
accounting (slurmdbd + MariaDB), so `sacct` reports job states as on a production cluster."""

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


@dataclasses.dataclass(frozen=True)
class SlurmCluster:
    state_dir: Path
    node: str
    env: dict[str, str]  # the caller's environment with SLURM_CONF, for every Slurm client

    def run(self, *args: str, timeout_s: float = 60) -> str:
        """Runs a Slurm client command; returns its stdout, raises with its stderr."""
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

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
    sessions on one machine apart."""
    for _ in range(100):
        base = random.randrange(20000, 30000)
        if _ports_free(base, num_ports):
            return base
    raise RuntimeError(f"no {num_ports} consecutive free ports in 20000-30000 on 127.0.0.1")


def _client_env(state_dir: Path) -> dict[str, str]:
    """The caller's environment without the SLURM_* variables of an outer allocation (they would
    point srun at a job id our cluster never had), plus what `slurm-local.sh env` exports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    exports = subprocess.run(["bash", str(SCRIPT), "env", str(state_dir)], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    for line in exports.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value
    env["PATH"] = f"{env.get('PATH', '/usr/bin:/bin')}:/usr/sbin:/sbin"
    return env


@contextmanager
def slurm_cluster() -> Iterator[SlurmCluster]:
    """Starts a fresh cluster in a temp dir, yields it, stops it and removes the dir. As root the
    script installs missing packages itself; anyone else gets an error naming them."""
    if os.geteuid() != 0:
        missing = missing_binaries()
        install = (f"Slurm binaries missing ({', '.join(missing)}): as root, `make system-deps` installs "
                   "them; " if missing else "")  # fmt: skip
        raise RuntimeError(f"{install}the local Slurm cluster (scripts/slurm-local.sh) needs root")
    # Not pytest's tmp_path: munged wants every directory above its socket searchable by all,
    # and pytest's are 0700.
    state_dir = Path(tempfile.mkdtemp(prefix="tuner-slurm-"))
    state_dir.chmod(0o755)
    env = {**os.environ, "SLURM_LOCAL_PORT": str(_free_port_base())}
    script = lambda *args: subprocess.run(["bash", str(SCRIPT), *args, str(state_dir)], env=env,  # noqa: E731
                                          capture_output=True, text=True)  # fmt: skip
    try:
        started = script("start")
        if started.returncode != 0:
            raise RuntimeError(
                f"slurm-local.sh start failed ({started.returncode}):\n{started.stderr.strip()}"
            )
        cluster = SlurmCluster(state_dir, node="", env=_client_env(state_dir))
        node = cluster.run("sinfo", "--noheader", "--Node", "--format=%N").strip()
        yield dataclasses.replace(cluster, node=node)
    finally:
        script("stop")
        shutil.rmtree(state_dir, ignore_errors=True)
