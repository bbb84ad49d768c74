"""What goes to `sbatch`: a site's defaults, one resource description rendered both as argv and
as `#SBATCH` lines, and the job-script preamble. Used for trials (tuner/dispatch/slurm.py),
allocations (tuner/dispatch/allocation.py) and exported scripts (tuner/exports/sbatch.py).

Everything a user wrote reaches Slurm either as a validated name (tuner/spec.py: SlurmSpec) or as
one argv element of `sbatch` (no shell); job scripts quote every value with shlex.quote.
"""

from __future__ import annotations

import math
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer.contract.result import BenchmarkConfig
from trainer.contract.trial_dir import CONFIG_FILE, RESULT_FILE
from tuner.spec import SlurmSpec

ROOT = Path(__file__).resolve().parent.parent.parent
SITE_OPTIONS = ("account", "partition", "qos", "constraint")


@dataclass(frozen=True)
class SiteSettings:
    """A site's Slurm defaults (read by tuner.settings: SlurmSettings, TUNER_SLURM_*); the study's
    SlurmSpec overrides them.
    `setup` is shell code run at the top of every job (e.g. `source /opt/site/env.sh`): an
    administrator's setting, never taken from a submitted spec."""

    account: str | None = None
    partition: str | None = None
    qos: str | None = None
    constraint: str | None = None
    setup: tuple[str, ...] = ()
    python: str = sys.executable  # the interpreter on the compute nodes (same path on a shared FS)
    # The network interface the ranks talk over (GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in every
    # job): the high-speed one on a real cluster (e.g. hsn0 on Frontier/Perlmutter), eth0 on the
    # local multi-node cluster. None: the libraries' own choice.
    socket_ifname: str | None = None

    @property
    def exports(self) -> dict[str, str]:
        if not self.socket_ifname:
            return {}
        return {"GLOO_SOCKET_IFNAME": self.socket_ifname, "NCCL_SOCKET_IFNAME": self.socket_ifname}


def time_limit_minutes(timeout_s: float) -> int:
    """Slurm's --time for a trial: its timeout (start-up included) in whole minutes, at least 1.
    Slurm enforces limits every 30 s, so a trial ends TIMEOUT up to ~30 s after it."""
    return max(1, math.ceil(timeout_s / 60))


def layout_resources(cfg: BenchmarkConfig, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, tasks per node): one task per rank, ranks packed onto as few nodes as possible."""
    world = cfg.parallel.world_size
    per_node = max(1, min(world, gpus_per_node))
    return math.ceil(world / per_node), per_node


def job_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:100] or "trial"


def site_options(spec: SlurmSpec, site: SiteSettings) -> list[str]:
    """`--account=...` etc.: the spec's value, else the site's; validated names only."""
    return [f"--{o}={v}" for o in SITE_OPTIONS if (v := getattr(spec, o) or getattr(site, o))]


@dataclass(frozen=True)
class SlurmResources:
    """One job's resources and options, rendered as `sbatch` argv or as `#SBATCH` lines."""

    name: str
    nodes: int
    ntasks_per_node: int
    time_minutes: int
    ntasks: int | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    site: tuple[str, ...] = ()  # --account=... etc.
    output: str | None = None
    chdir: Path | None = None
    requeue: bool = False  # --no-requeue: a node failure ends the job and the tuner decides
    exclusive: bool = False  # --exclusive: no other job on the nodes (a benchmark measures alone)

    @classmethod
    def for_trial(cls, cfg: BenchmarkConfig, *, name: str, timeout_s: float, spec: SlurmSpec,
                  site: SiteSettings, gpus_per_node: int, output: str | None = None,
                  chdir: Path | None = None) -> SlurmResources:  # fmt: skip
        """A trial: one task per rank on as few nodes as hold them, GPUs on cuda, --time from the
        trial's timeout."""
        nodes, per_node = layout_resources(cfg, gpus_per_node)
        gpus = (
            (spec.gpus_per_node if spec.gpus_per_node is not None else per_node)
            if cfg.device == "cuda"
            else None
        )
        return cls(name=job_name(name), nodes=nodes, ntasks_per_node=per_node, ntasks=cfg.parallel.world_size,
                   time_minutes=time_limit_minutes(timeout_s), gpus_per_node=gpus, cpus_per_task=spec.cpus_per_task,
                   site=tuple(site_options(spec, site)), output=output, chdir=chdir)  # fmt: skip

    def options(self) -> list[str]:
        opts = [f"--job-name={self.name}"]
        if self.output:
            opts += [f"--output={self.output}", "--open-mode=append"]
        opts += [f"--nodes={self.nodes}", f"--ntasks-per-node={self.ntasks_per_node}"]
        if self.ntasks is not None:
            opts.append(f"--ntasks={self.ntasks}")
        if self.gpus_per_node is not None:
            opts.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.cpus_per_task:
            opts.append(f"--cpus-per-task={self.cpus_per_task}")
        opts.append(f"--time={self.time_minutes}")
        if not self.requeue:
            opts.append("--no-requeue")
        if self.exclusive:
            opts.append("--exclusive")
        if self.chdir is not None:
            opts.append(f"--chdir={self.chdir}")
        return [*opts, *self.site]

    def argv(self, script: Path) -> list[str]:
        """`sbatch --parsable ... script` (no shell)."""
        return ["sbatch", "--parsable", *self.options(), str(script)]

    def sbatch_lines(self) -> list[str]:
        """`#SBATCH` lines for a script submitted by hand. Not shell and not quotable, which is
        why every value is a number, a sanitised name or a name that passed SlurmSpec's checks."""
        return [f"#SBATCH {o}" for o in self.options()]


def preamble(spec: SlurmSpec, site: SiteSettings, env: dict[str, str], *,
             checkout: Path | None = ROOT) -> list[str]:  # fmt: skip
    """Job-script lines before the command: site setup, module loads, `checkout` (this one, which a
    trial job reads from the shared file system) on PYTHONPATH unless None, the exports (`env`, then
    the spec's; values quoted)."""
    q = shlex.quote
    return [
        *site.setup, *[f"module load {q(m)}" for m in spec.modules],
        *([f"export PYTHONPATH={q(str(checkout))}" + "${PYTHONPATH:+:$PYTHONPATH}"] if checkout else []),
        *[f"export {k}={q(v)}" for k, v in sorted({**site.exports, **env, **spec.env}.items())],
    ]  # fmt: skip


# A port free on the job's first node (the batch script runs there, and so does rank 0 with block
# distribution) for the rendezvous store, unless the site set one. The trainer's fallback, a port
# derived from the job id, can land on a port another service holds: rank 0 then fails to listen
# and the other ranks retry a foreign server for init_timeout_s (seen in the test suite).
FREE_PORT = 'import socket; s = socket.socket(); s.bind(("0.0.0.0", 0)); print(s.getsockname()[1])'
# After the first rank ends, the others get this long before srun ends them: rank 0 writes the
# result last, and a failed trial exits 0 on purpose (no --kill-on-bad-exit then).
SRUN_WAIT_S = 60


def trainer_command(python: str, config: str, out: str) -> str:
    """The job's last lines: a free port for the store, then every rank under srun, ranks in
    blocks per node (the placement rule of trainer/contract/topology.py), one rank failing ends the step."""
    q = shlex.quote
    return (f"export MASTER_PORT=${{MASTER_PORT:-$({q(python)} -c {q(FREE_PORT)})}}\n"
            f"exec srun --kill-on-bad-exit=1 --wait={SRUN_WAIT_S} --distribution=block {q(python)} -m trainer.benchmark "
            f"--config {q(config)} --out {q(out)}")  # fmt: skip


def render_script(cfg: BenchmarkConfig, *, work_dir: Path, spec: SlurmSpec, site: SiteSettings,
                  env: dict[str, str]) -> str:  # fmt: skip
    """A trial's job script: site setup, modules, environment, then the trainer under srun."""
    lines = ["#!/bin/bash", "# parallel-tuner trial (tuner/dispatch/slurm.py); resources are sbatch options",
             "set -u", *preamble(spec, site, env), f"cd {shlex.quote(str(work_dir))}",
             trainer_command(site.python, str(work_dir / CONFIG_FILE), str(work_dir / RESULT_FILE))]  # fmt: skip
    return "\n".join(lines) + "\n"
