"""Trials as local process groups: a supervisor per trial (trainer/launch.py) runs torchrun,
enforces the trial's time limit itself and, on a timeout or a cancel, kills every process that
carries the trial's tag, so nothing outlives a trial even when the worker that started it died.

CPU trials fork their ranks from a fork server this dispatcher starts with its first trial
(trainer/forkserver.py: torch is imported once, not by every rank of every trial; a trial whose
server is gone starts its ranks as processes). PARALLEL_TUNER_FORKSERVER=0 turns it off
(FORKSERVER_VAR; the files and variables of a trial: trainer/contract/trial_dir.py).

Devices are partitioned between concurrent trials: CPU slots (one per core) here, GPU ids through
CUDA_VISIBLE_DEVICES on a GPU host. A handle is `local:<host>/<supervisor pid>@<work dir>`; a
restarted worker on the same host re-attaches through the trial's launch.json (pid and start
time, so a reused pid is never mistaken for the trial)."""

from __future__ import annotations

import os
import socket
import time
import weakref
from pathlib import Path

from trainer.contract.result import BenchmarkConfig
from trainer.contract.trial_dir import (
    FORKSERVER_VAR,
    SOCKET_VAR,
    read_config,
    read_launch,
    read_result,
    trial_tag,
)  # fmt: skip
from trainer.forkclient import ForkServer
from trainer.launch import LocalRun, launcher_name, start_local
from tuner.dispatch.base import DispatchError, JobHandle, JobReport
from tuner.outcome import FailureKind, Outcome, classify

# A trial on another host (a worker there died; its work dir is shared): its supervisor ends it
# by its own limit, so it is given up only this long after that limit.
FOREIGN_GRACE_S = 120.0


class LocalDispatcher:
    kind = "local"

    def __init__(self, num_devices: int | None = None, gpu: bool = False, env: dict[str, str] | None = None):
        self.num_devices = num_devices or os.cpu_count() or 1
        self.gpu, self.env = gpu, env or {}
        self.host = socket.gethostname()
        self.runs: dict[JobHandle, LocalRun] = {}
        self.devices: dict[JobHandle, list[int]] = {}  # job -> device ids it holds
        self.final: dict[JobHandle, JobReport] = {}
        self.adopted: set[JobHandle] = set()
        self.server: ForkServer | None = None
        self.server_failed = False  # it would not start: not tried again

    def close(self) -> None:
        """Stop the fork server taking requests (it exits once its trials' ranks have ended)."""
        if self.server is not None:
            self.server.close()
            self.server = None

    def _fork_server_env(self) -> dict[str, str]:
        """The environment that has a CPU trial fork its ranks from this dispatcher's server,
        started (or started again, after it stopped when idle) here; {} when it is not used."""
        if (
            self.gpu
            or self.server_failed
            or launcher_name() != "spawn"
            or os.environ.get(FORKSERVER_VAR) == "0"
        ):
            return {}
        if self.server is None or not self.server.alive():
            self.close()
            self.server = ForkServer.start()
            self.server_failed = self.server is None
            if self.server is not None:  # stopped with this dispatcher, at the latest at exit
                weakref.finalize(self, self.server.close)
        return {SOCKET_VAR: self.server.path} if self.server else {}

    def _free(self) -> list[int]:
        held = {d for ds in self.devices.values() for d in ds}
        return [d for d in range(self.num_devices) if d not in held]

    def _pick(self, world: int) -> list[int] | None:
        """Device slots for a trial of `world` ranks, or None while they are taken. A trial larger
        than the machine may still run alone (CPU ranks oversubscribe cores)."""
        free = self._free()
        if len(free) >= world or (not self.devices and not self.gpu):
            return free[:world]
        return None

    def can_start(self, cfg: BenchmarkConfig) -> bool:
        return self._pick(cfg.parallel.world_size) is not None

    def _command(self, cfg: BenchmarkConfig, work_dir: Path, name: str, slots: list[int]) -> list[str] | None:
        return None  # torchrun (trainer/launch.py)

    def _job_id(self, run: LocalRun) -> str:
        return f"{self.host}/{run.pid}"

    def submit(self, cfg: BenchmarkConfig, *, name: str, work_dir: Path, timeout_s: float) -> JobHandle:
        ids = self._pick(cfg.parallel.world_size)
        if ids is None:
            raise DispatchError(f"no {cfg.parallel.world_size} free device slots (ask can_start first)")
        command = self._command(cfg, work_dir, name, ids)
        env = {**(self._fork_server_env() if command is None else {}), **self.env}
        if self.gpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
        try:
            run = start_local(cfg, work_dir, timeout_s=timeout_s, env=env, tag=trial_tag(name, work_dir),
                              command=command)  # fmt: skip
        except OSError as e:
            raise DispatchError(f"cannot start the trial's launcher: {e}") from None
        job = JobHandle(self.kind, self._job_id(run), work_dir)  # type: ignore[arg-type]
        self.runs[job], self.devices[job] = run, ids
        return job

    def poll(self, job: JobHandle) -> JobReport:
        if job in self.final:
            return self.final[job]
        run = self.runs.get(job) or self._adopt(job)
        if run is None:
            return self._unattached(job)
        result = run.poll()
        if result is None:
            return JobReport("RUNNING")
        launch = read_launch(job.work_dir)
        if job in self.adopted and read_result(job.work_dir) is None and not (launch and launch.ended):
            # A supervisor ends by writing its exit code; one we adopted that is gone without it
            # (and without a result) was killed with its worker or its host.
            return self._end(job, JobReport("LOST", Outcome.failed(
                FailureKind.INFRA, f"trial supervisor {job.id} ended without a result")))  # fmt: skip
        return self._end(job, JobReport("ENDED", classify(result)))

    def cancel(self, job: JobHandle) -> None:
        run = self.runs.get(job) or self._adopt(job)
        if run is not None:
            run.cancel()  # returns when no process of the trial is left
        self._end(
            job, JobReport("CANCELLED", Outcome.failed(FailureKind.CANCELLED, "cancelled by the tuner"))
        )

    def find(self, name: str, work_dir: Path) -> JobHandle | None:
        try:
            run = LocalRun.attach(work_dir)
        except ValueError:  # launched on another host: not ours to find
            return None
        if run is None or run.tag != trial_tag(name, work_dir):
            return None
        return JobHandle(self.kind, self._job_id(run), work_dir)  # type: ignore[arg-type]

    # --- internals ---

    def _end(self, job: JobHandle, report: JobReport) -> JobReport:
        self.runs.pop(job, None)
        self.devices.pop(job, None)
        self.final[job] = report
        return report

    def _adopt(self, job: JobHandle) -> LocalRun | None:
        """A trial an earlier worker on this host started: watch it through its launch.json."""
        if job.host != self.host:
            return None
        try:
            run = LocalRun.attach(job.work_dir)
        except ValueError:  # the work dir holds a later attempt from another host
            return None
        if run is None or run.pid != job.pid:
            return None
        self.adopted.add(job)
        self.runs[job] = run
        self.devices[job] = self._free()[: _world_size(job.work_dir)]
        return run

    def _unattached(self, job: JobHandle) -> JobReport:
        """A trial we cannot watch: its supervisor is gone (another attempt's launch.json in its
        place), or it runs on another host."""
        result = read_result(job.work_dir)
        launch = read_launch(job.work_dir)
        if job.host != self.host and launch is not None and launch.pid == job.pid:
            if result is not None:
                return self._end(job, JobReport("ENDED", classify(result)))
            deadline = launch.started_at + (launch.timeout_s or 0) + FOREIGN_GRACE_S
            if time.time() < deadline:
                return JobReport(f"RUNNING on {job.host}")
        return self._end(job, JobReport("LOST", Outcome.failed(
            FailureKind.INFRA, f"trial supervisor {job.id} is gone without a result")))  # fmt: skip


def _world_size(work_dir: Path) -> int:
    try:
        return read_config(work_dir).parallel.world_size
    except (OSError, ValueError):
        return 1
