"""Trials as local process groups: torchrun --standalone per trial (trainer/launch.py).

Devices are partitioned between concurrent trials: CPU slots (one per core) here, GPU ids through
CUDA_VISIBLE_DEVICES on a GPU host. A job id is "<pid>@<work dir>": a restarted worker re-attaches
to a trial whose process group is still alive, or reads the result it left behind."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.config import BenchmarkConfig, BenchmarkResult
from trainer.launch import RESULT_FILE, LocalRun, start_local
from tuner.outcome import FailureKind, Outcome, classify


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own exited child not yet reaped) counts as dead.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


@dataclass
class _Adopted:
    """A job started by a previous worker process: we can watch it but not wait() on it."""

    pid: int
    work_dir: Path
    deadline: float


class LocalDispatcher:
    def __init__(self, num_devices: int | None = None, gpu: bool = False, env: dict[str, str] | None = None):
        self.num_devices = num_devices or os.cpu_count() or 1
        self.gpu, self.env = gpu, env or {}
        self.runs: dict[str, LocalRun] = {}
        self.adopted: dict[str, _Adopted] = {}
        self.devices: dict[str, list[int]] = {}  # job -> device ids it holds

    def _free(self) -> list[int]:
        held = {d for ds in self.devices.values() for d in ds}
        return [d for d in range(self.num_devices) if d not in held]

    def can_start(self, cfg: BenchmarkConfig) -> bool:
        need = cfg.parallel.world_size
        free = self._free()
        # A trial larger than the machine may still run alone (CPU ranks oversubscribe cores).
        return len(free) >= need or (not self.devices and not self.gpu)

    def submit(self, cfg: BenchmarkConfig, *, name: str, work_dir: Path, timeout_s: float) -> str:
        free = self._free()
        ids = free[: cfg.parallel.world_size]
        env = dict(self.env)
        if self.gpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
        run = start_local(cfg, work_dir, timeout_s=timeout_s, env=env)
        job = f"{run.process.pid}@{work_dir}"
        self.runs[job], self.devices[job] = run, ids
        return job

    def poll(self, job_id: str) -> Outcome | None:
        if job_id in self.runs:
            result = self.runs[job_id].poll()
            if result is None:
                return None
            self._release(job_id)
            return classify(result)
        return self._poll_adopted(job_id)

    def _poll_adopted(self, job_id: str) -> Outcome | None:
        if job_id not in self.adopted:
            pid, _, path = job_id.partition("@")
            self.adopted[job_id] = _Adopted(int(pid), Path(path), time.monotonic() + 3600)
        job = self.adopted[job_id]
        result_path = job.work_dir / RESULT_FILE
        if _alive(job.pid) and time.monotonic() < job.deadline:
            return None
        self.adopted.pop(job_id)
        try:
            return classify(BenchmarkResult.from_json(result_path.read_text()))
        except (OSError, ValueError):
            return Outcome.failed(
                FailureKind.INFRA, f"trial process {job.pid} ended without a result (worker restart)"
            )

    def cancel(self, job_id: str) -> None:
        if job_id in self.runs:
            self.runs[job_id].cancel()
            self._release(job_id)
        else:
            pid = int(job_id.partition("@")[0])
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, 9)

    def _release(self, job_id: str) -> None:
        self.runs.pop(job_id, None)
        self.devices.pop(job_id, None)
