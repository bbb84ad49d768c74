"""Launch one benchmark trial as a local process group under torchrun (torch-free: the tuner uses it).

The result is judged by the result file rank 0 writes, not by torchrun's exit code: a rank can
abort at exit after the result was written (../shared/notes/torch-on-cpu.md), and a failed trial
exits 0 on purpose (trainer/failures.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.config import BenchmarkConfig, BenchmarkResult

RESULT_FILE = "result.json"
CONFIG_FILE = "config.json"
LOG_FILE = "log.txt"


def torchrun_command(num_procs: int, config: Path, out: Path, python: str = sys.executable) -> list[str]:
    return [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_procs}",
        "-m", "trainer.benchmark", "--config", str(config), "--out", str(out),
    ]  # fmt: skip


def local_env(extra: dict[str, str] | None = None, loopback: bool = True) -> dict[str, str]:
    """Environment for a trial: collectives on the loopback interface only when it runs on this
    machine alone (`loopback`)."""
    env = dict(os.environ)
    if loopback:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The trial must import this checkout's trainer even when the caller runs from elsewhere.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


@dataclass
class LocalRun:
    """A trial started in `work_dir` (config.json, result.json, log.txt)."""

    work_dir: Path
    process: subprocess.Popen
    started: float
    timeout_s: float | None

    @property
    def result_path(self) -> Path:
        return self.work_dir / RESULT_FILE

    def poll(self) -> BenchmarkResult | None:
        """None while running; the result once done (a timeout or a crash becomes status 'error')."""
        code = self.process.poll()
        if code is None:
            if self.timeout_s is not None and time.monotonic() - self.started > self.timeout_s:
                self.cancel()
                return self._failed(f"timed out after {self.timeout_s:.0f} s (hang or too slow)")
            return None
        return self._read(code)

    def wait(self) -> BenchmarkResult:
        while (result := self.poll()) is None:
            time.sleep(0.1)
        return result

    def cancel(self) -> None:
        """Kill the whole process group (torchrun and its ranks)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def _read(self, code: int) -> BenchmarkResult:
        try:
            return BenchmarkResult.from_json(self.result_path.read_text())
        except (OSError, ValueError) as e:
            return self._failed(f"no valid result file ({e}); torchrun exit code {code}")

    def _failed(self, reason: str) -> BenchmarkResult:
        log = self.work_dir / LOG_FILE
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        return BenchmarkResult(status="error", error=f"{reason}\n--- log tail ---\n{tail}")


def start_local(
    cfg: BenchmarkConfig,
    work_dir: Path,
    *,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    command: list[str] | None = None,
) -> LocalRun:
    """Write the config into `work_dir` and start torchrun with one process per rank (or
    `command`, e.g. an srun step, which must read config.json and write result.json there)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / CONFIG_FILE).write_text(cfg.to_json())
    (work_dir / RESULT_FILE).unlink(missing_ok=True)
    cmd = command or torchrun_command(
        cfg.parallel.world_size, work_dir / CONFIG_FILE, work_dir / RESULT_FILE, python
    )
    with open(work_dir / LOG_FILE, "wb") as log:
        process = subprocess.Popen(
            cmd, cwd=work_dir, env=local_env(env, loopback=command is None), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    return LocalRun(work_dir, process, time.monotonic(), timeout_s)


def run_local(cfg: BenchmarkConfig, work_dir: Path, **kwargs) -> BenchmarkResult:
    return start_local(cfg, work_dir, **kwargs).wait()
