"""Launch one benchmark trial on this machine under a supervisor (torch-free: the tuner uses it).

    start_local(cfg, work_dir, timeout_s=600) -> LocalRun

starts `python -m trainer.launch` (the supervisor, in its own session), which starts the command
(trainer.spawn with one process per rank, or e.g. an srun step) and enforces the time limit
itself, so the limit holds when the caller dies. Every process of a trial carries
PARALLEL_TUNER_TRIAL=<tag> in its environment; the trial is killed by that tag (kill_trial), not
by process group, because a launcher may start ranks in sessions of their own (torchrun does)
and a rank can outlive its launcher.

The result is judged by the result file rank 0 writes, not by an exit code: a gloo rank can abort
at exit after the result was written (about 6 in 140 CPU launches), and a failed trial exits 0 on
purpose (trainer/failures.py). The files of work_dir (config.json, result.json, log.txt,
launch.json) and the variables of a trial's environment: trainer/contract/trial_dir.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainer.contract.result import BenchmarkConfig, BenchmarkResult
from trainer.contract.trial_dir import (
    CONFIG_FILE,
    LAUNCH_FILE,
    LAUNCHER_VAR,
    LOG_FILE,
    RESULT_FILE,
    TAG_VAR,
    LaunchRecord,
    NoResult,
    load_result,
    prepare,
    read_launch,
    with_log_tail,
    write_launch,
)

# trainer.spawn, torchrun and srun forward SIGTERM to their ranks (srun to the step's tasks on
# every node): give them this long before everything tagged here gets SIGTERM and then SIGKILL.
COMMAND_GRACE_S = 5.0
TIMEOUT_EXIT_CODE = 124  # as timeout(1)


def _trainer_args(config: Path, out: Path) -> list[str]:
    return ["-m", "trainer.benchmark", "--config", str(config), "--out", str(out)]


def torchrun_command(num_procs: int, config: Path, out: Path, python: str = sys.executable) -> list[str]:
    """The trial under torchrun, as a user would launch it."""
    launcher = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_procs}"]
    return [*launcher, *_trainer_args(config, out)]


def ranks_command(num_procs: int, config: Path, out: Path, python: str = sys.executable) -> list[str]:
    """The trial as local trials run it: trainer.spawn, torchrun's single-node launch without
    its agent's start-up (trainer/spawn.py)."""
    launcher = [python, "-m", "trainer.spawn", f"--nproc-per-node={num_procs}", "--", python]
    return [*launcher, *_trainer_args(config, out)]


LAUNCHERS = {"spawn": ranks_command, "torchrun": torchrun_command}  # LAUNCHER_VAR picks; spawn unless set


def launcher_name() -> str:
    name = os.environ.get(LAUNCHER_VAR, "spawn")
    if name not in LAUNCHERS:
        raise ValueError(f"{LAUNCHER_VAR}={name!r} is not a launcher; valid: {', '.join(LAUNCHERS)}")
    return name


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


# --- processes: by tag, by (pid, start time) ------------------------------------------------------


def trial_processes(tag: str) -> list[int]:
    """Pids of the live processes (not zombies) whose environment carries this trial's tag, the
    caller excluded. Processes we may not read (other users') are skipped."""
    needle, me = f"{TAG_VAR}={tag}".encode(), os.getpid()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()  # empty for a zombie
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return sorted(pids)


def kill_trial(tag: str, grace_s: float = 5.0, max_rounds: int = 20) -> int:
    """SIGTERM every process of the trial, wait up to `grace_s` for them to go, then SIGKILL what
    is left until none is found (at most `max_rounds` rounds: a process stuck in the kernel may not
    die). Returns how many processes were signalled."""
    signalled: set[int] = set()
    pids = trial_processes(tag)
    _signal(pids, signal.SIGTERM, signalled)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = trial_processes(tag)
    for _ in range(max_rounds):
        if not (pids := trial_processes(tag)):
            break
        _signal(pids, signal.SIGKILL, signalled)
        time.sleep(0.1)
    return len(signalled)


def _signal(pids: list[int], sig: signal.Signals, signalled: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            signalled.add(pid)


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat from the third on (field N at index N - 3; `pid` may be
    "self"), None if the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot: field 22 of /proc/<pid>/stat), None if gone."""
    fields = proc_stat(pid)
    return (fields[0], int(fields[19])) if fields else None


def process_start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return stat[1] if stat else None


def is_alive(pid: int, start_time: int) -> bool:
    """Whether process `pid` is the one that started at `start_time` and is still running: a
    reused pid has another start time; a zombie (exited, not yet reaped) counts as dead."""
    stat = _stat(pid)
    return stat is not None and stat[1] == start_time and stat[0] not in ("Z", "X")


# --- the caller's side ----------------------------------------------------------------------------


@dataclass
class LocalRun:
    """A trial started in `work_dir`, watched through its supervisor `pid` (with `start_time`, so a
    reused pid is not mistaken for it). `process` is None when attached after a restart."""

    work_dir: Path
    tag: str
    pid: int
    start_time: int
    timeout_s: float | None = None
    process: subprocess.Popen | None = None
    _result: BenchmarkResult | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def attach(cls, work_dir: Path) -> LocalRun | None:
        """The trial in `work_dir` as its launch.json describes it; None if there is none. Raises
        ValueError if it was launched on another host (its pid means nothing here)."""
        if (info := read_launch(work_dir)) is None:
            return None
        if info.host != socket.gethostname():
            raise ValueError(
                f"the trial in {work_dir} was launched on host {info.host!r}, this is {socket.gethostname()!r}"
            )
        return cls(work_dir, info.tag, info.pid, info.start_time, info.timeout_s)

    @property
    def result_path(self) -> Path:
        return self.work_dir / RESULT_FILE

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return is_alive(self.pid, self.start_time)

    def poll(self) -> BenchmarkResult | None:
        """None while the supervisor runs; then the result file, or an 'error' result saying
        there was none. The supervisor writes status 'timeout' when the time limit ends the trial."""
        if self._result is None and not self.alive():
            # A supervisor that was SIGKILLed left its trial behind; nothing of it may outlive poll.
            kill_trial(self.tag, grace_s=1.0)
            self._result = self._read()
        return self._result

    def wait(self) -> BenchmarkResult:
        while (result := self.poll()) is None:
            time.sleep(0.2)
        return result

    def cancel(self, grace_s: float = 10.0) -> None:
        """Stop the trial: SIGTERM to the supervisor (it stops the command gracefully and kills
        every tagged process), then after `grace_s` kill whatever of the trial is still alive.
        When this returns no process of the trial is alive (on this machine)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        kill_trial(self.tag, grace_s=2.0)
        if self.process is not None:
            self.process.wait()

    def _read(self) -> BenchmarkResult:
        try:
            return load_result(self.work_dir)
        except NoResult as e:
            if self.process is not None:
                code = self.process.returncode
            else:
                code = launch.exit_code if (launch := read_launch(self.work_dir)) else None
            return BenchmarkResult(
                status="error",
                error=with_log_tail(f"no valid result file ({e}); exit code {code}", self.work_dir),
            )


def new_tag() -> str:
    return f"trial-{uuid.uuid4().hex[:16]}"


def start_local(
    cfg: BenchmarkConfig,
    work_dir: Path,
    *,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    command: list[str] | None = None,
    tag: str | None = None,
) -> LocalRun:
    """Write the config into `work_dir` and start the supervisor, which runs trainer.spawn with one
    process per rank on `python` (or `command`, e.g. an srun step, which must read config.json
    and write result.json there) for at most `timeout_s`. Returns once launch.json is written."""
    tag = tag or new_tag()
    if "\0" in tag:
        raise ValueError(f"a trial tag cannot hold a NUL byte: {tag!r}")
    prepare(work_dir, cfg)
    cmd = command or LAUNCHERS[launcher_name()](
        cfg.parallel.world_size, work_dir / CONFIG_FILE, work_dir / RESULT_FILE, python
    )
    limit = [] if timeout_s is None else [f"--timeout-s={timeout_s}"]
    # The supervisor runs on this interpreter: it imported trainer.launch, torch or not.
    argv = [sys.executable, "-m", "trainer.launch", f"--work-dir={work_dir}", *limit, "--", *cmd]
    with open(work_dir / LOG_FILE, "wb") as log:
        process = subprocess.Popen(
            argv, cwd=work_dir, env={**local_env(env, loopback=command is None), TAG_VAR: tag},
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    # launch.json is written before the command starts, so an attach after this finds the trial.
    while not (work_dir / LAUNCH_FILE).exists() and process.poll() is None:
        time.sleep(0.01)
    return LocalRun(work_dir, tag, process.pid, process_start_time(process.pid) or 0, timeout_s, process)


def run_local(cfg: BenchmarkConfig, work_dir: Path, **kwargs) -> BenchmarkResult:
    return start_local(cfg, work_dir, **kwargs).wait()


# --- the supervisor: python -m trainer.launch --work-dir D [--timeout-s N] -- COMMAND... ----------


def supervise(command: list[str], work_dir: Path, timeout_s: float | None) -> int:
    """Run `command` for at most `timeout_s`; leave no tagged process behind. Exit code: the
    command's, 124 on the time limit (after writing a 'timeout' result unless one was written),
    128 + signal on a cancel (no result)."""
    started, started_at = time.monotonic(), time.time()
    tag = os.environ[TAG_VAR]
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    info = LaunchRecord(pid=os.getpid(), start_time=process_start_time(os.getpid()), host=socket.gethostname(),
                        tag=tag, timeout_s=timeout_s, started_at=started_at)  # fmt: skip
    write_launch(work_dir, info)
    try:
        # Its own process group: SIGTERM to it reaches the command's children (srun, the
        # ranks trainer.spawn started).
        proc = subprocess.Popen(command, cwd=work_dir, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        print(f"trainer.launch: cannot start {command[0]!r}: {e}", file=sys.stderr, flush=True)
        return _finish(work_dir, info, 127)
    deadline = None if timeout_s is None else started + timeout_s
    while proc.poll() is None and not stop and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.1)
    if proc.returncode is not None:  # the command ended: kill any rank that outlived it
        kill_trial(tag, grace_s=2.0)
        code = proc.returncode
        return _finish(work_dir, info, code if code >= 0 else 128 - code)
    reason = f"signal {stop[0]} (cancel)" if stop else f"time limit {timeout_s:.0f} s"
    print(f"trainer.launch: {reason}: stopping trial {tag}", file=sys.stderr, flush=True)
    _stop(proc, tag)
    if stop:
        return _finish(work_dir, info, 128 + stop[0])
    error = with_log_tail(f"timed out after {timeout_s:.0f} s (hang or too slow)", work_dir)
    result = BenchmarkResult(status="timeout", error=error, wall_time_s=time.monotonic() - started)
    _write_new(work_dir / RESULT_FILE, result.to_json())  # a result the trainer wrote stands
    return _finish(work_dir, info, TIMEOUT_EXIT_CODE)


def _stop(proc: subprocess.Popen, tag: str) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(COMMAND_GRACE_S)
    kill_trial(tag, grace_s=2.0)
    if proc.poll() is None:  # a command that dropped the tag from its environment
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _finish(work_dir: Path, info: LaunchRecord, exit_code: int) -> int:
    write_launch(work_dir, replace(info, exit_code=exit_code, ended_at=time.time()))
    return exit_code


def _write_new(path: Path, text: str) -> bool:
    """Write `path` whole unless it exists (a hard link does not replace)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Supervise one trial (see trainer/launch.py).")
    parser.add_argument("--work-dir", required=True, type=Path)
    parser.add_argument("--timeout-s", type=float, default=None)
    parser.add_argument("command", nargs="+", help="after --: the command to run")
    args = parser.parse_args(argv)
    return supervise(args.command, args.work_dir, args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
