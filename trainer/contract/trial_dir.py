"""A trial's work directory and environment: the one definition of the files a trial is started
with and leaves behind, and of the variables that travel in its environment. Every side uses it:
the launcher and its supervisor (trainer/launch.py), the fork server (trainer/forkserver.py), the
trainer (trainer/benchmark.py, trainer/failures.py), every dispatcher (tuner/dispatch/) and the
sbatch export (tuner/exports/sbatch.py). Torch-free: the tuner imports it (an import-linter contract in
pyproject.toml keeps it so).

    config.json                  the BenchmarkConfig, written by whoever starts the trial (prepare)
    result.json                  the BenchmarkResult, written once by rank 0, or by the supervisor
                                 when the time limit ended the trial (load_result, read_result)
    result.json.rank<r>.fail.json   a failed rank's report, for rank 0 to find the root cause
    log.txt                      every rank's stdout and stderr (log_tail)
    launch.json                  a local trial's supervisor (LaunchRecord: pid, start time, host,
                                 tag, time limit, then its exit code; written by trainer/launch.py)
    job.sbatch                   the job script of a trial submitted with sbatch

A result is judged by result.json, never by an exit code (trainer/launch.py says why). Torch's own
rendezvous variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) and Slurm's (SLURM_*) keep
their own names; the variables below are ours.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from trainer.contract.result import BenchmarkConfig, BenchmarkResult

CONFIG_FILE = "config.json"
RESULT_FILE = "result.json"
LOG_FILE = "log.txt"
LAUNCH_FILE = "launch.json"
SCRIPT_FILE = "job.sbatch"

# --- variables of a trial's environment ---
# Every process of a trial carries PARALLEL_TUNER_TRIAL=<tag>: a trial is found and killed by it
# (trainer/launch.py: kill_trial), under Slurm as on this machine.
TAG_VAR = "PARALLEL_TUNER_TRIAL"
# A fork server's socket path: the trial's ranks are forked from it (trainer/forkserver.py).
SOCKET_VAR = "TRAINER_FORKSERVER"
# The listening socket handed to rank 0 for the rendezvous store (its port cannot be taken between
# being chosen and being listened on), by number; set, empty, on the other ranks (trainer/spawn.py).
STORE_FD_VAR = "TRAINER_STORE_FD"
# Test hook: "<raise|hang|exit|oom>:<rank>:<step>[:<job name>]" (trainer/benchmark.py: inject_fault).
FAULT_VAR = "TRAINER_FAULT"

# --- variables of the tuner's environment that choose how local trials start ---
LAUNCHER_VAR = "PARALLEL_TUNER_LAUNCHER"  # "spawn" (the default) or "torchrun" (trainer/launch.py)
FORKSERVER_VAR = "PARALLEL_TUNER_FORKSERVER"  # "0": every rank of a CPU trial starts its own Python

LOG_TAIL_CHARS = 3000  # what a failure message quotes of the log


class NoResult(Exception):
    """A work dir without a usable result: `missing` when there is no result file, else the file
    is unreadable (not a BenchmarkResult; the message says why)."""

    def __init__(self, path: Path, missing: bool, reason: str = ""):
        self.path, self.missing = path, missing
        super().__init__(f"no result file {path}" if missing else f"unreadable result file {path}: {reason}")


def trial_tag(name: str, work_dir: Path) -> str:
    """The tag every process of a trial attempt carries (TAG_VAR): its job name, unique in one
    database only, and a digest of its work dir, unique on one file system. Two tuners with their
    own databases on one host (or two tests) both have a "pt1-t0-a1"; by name alone each would find
    and kill the other's ranks."""
    digest = hashlib.sha256(str(Path(work_dir).absolute()).encode()).hexdigest()[:12]
    return f"{name}.{digest}"


def prepare(work_dir: Path, cfg: BenchmarkConfig) -> None:
    """Make `work_dir` ready for a new attempt: the config written, an earlier attempt's result
    and launch record removed (a stale result would be read as this attempt's)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / CONFIG_FILE).write_text(cfg.to_json())
    for name in (RESULT_FILE, LAUNCH_FILE):
        (work_dir / name).unlink(missing_ok=True)


def read_config(work_dir: Path) -> BenchmarkConfig:
    """The trial's config; OSError or ValueError when there is none or it is not one."""
    return BenchmarkConfig.from_json((work_dir / CONFIG_FILE).read_text())


def load_result(work_dir: Path) -> BenchmarkResult:
    """The trial's result; raises NoResult saying whether the file is missing or unreadable."""
    path = work_dir / RESULT_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise NoResult(path, missing=True) from None
    except OSError as e:
        raise NoResult(path, missing=False, reason=str(e)) from None
    try:
        return BenchmarkResult.from_json(text)
    except ValueError as e:
        raise NoResult(path, missing=False, reason=str(e)) from None


def read_result(work_dir: Path) -> BenchmarkResult | None:
    """The trial's result, or None when there is no usable one (missing or unreadable: a poller
    then judges by the job's state; load_result says which)."""
    try:
        return load_result(work_dir)
    except NoResult:
        return None


def write_result(path: Path, result: BenchmarkResult) -> None:
    """Write a result whole (a reader never sees half of one)."""
    atomic_write(path, result.to_json())


def rank_failure_file(result_path: Path, rank: int) -> Path:
    """Where rank `rank` reports its failure, beside the result it would go into."""
    return result_path.with_name(f"{result_path.name}.rank{rank}.fail.json")


def rank_failure_files(result_path: Path) -> list[Path]:
    return sorted(result_path.parent.glob(f"{result_path.name}.rank*.fail.json"))


def log_tail(work_dir: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The last `chars` characters of the trial's log ('' when there is none). Reads only the end:
    a log can hold a long run's output."""
    try:
        with open(work_dir / LOG_FILE, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 4 * chars))  # UTF-8: at most 4 bytes a character
            return log.read().decode(errors="replace")[-chars:]
    except OSError:
        return ""


def with_log_tail(reason: str, work_dir: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """A failure message: `reason`, then the log's tail."""
    return f"{reason}\n--- log tail ---\n{log_tail(work_dir, chars)}"


@dataclass(frozen=True)
class LaunchRecord:
    """launch.json: a local trial's supervisor, written as it starts and again, with its exit
    code, as it ends. A worker re-attaches to the trial through it, on this host by pid and start
    time (a reused pid has another start time), from another host by waiting out its time limit."""

    pid: int
    start_time: int | None  # clock ticks since boot: /proc/<pid>/stat field 22
    host: str
    tag: str
    timeout_s: float | None
    started_at: float  # time.time()
    exit_code: int | None = None  # None while the supervisor runs
    ended_at: float | None = None

    @property
    def ended(self) -> bool:
        return self.exit_code is not None

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        if not self.ended:  # no exit_code key while running: what readers before this class checked
            del data["exit_code"], data["ended_at"]
        return json.dumps(data)


def read_launch(work_dir: Path) -> LaunchRecord | None:
    """A local trial's launch record, None when there is none or it is unreadable."""
    try:
        info = json.loads((work_dir / LAUNCH_FILE).read_text())
        return LaunchRecord(**info)
    except (OSError, ValueError, TypeError):  # TypeError: not an object, or not these fields
        return None


def write_launch(work_dir: Path, record: LaunchRecord) -> None:
    atomic_write(work_dir / LAUNCH_FILE, record.to_json())


def atomic_write(path: Path, text: str) -> None:
    """Write `path` whole: a temporary file beside it, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
