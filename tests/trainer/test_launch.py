"""trainer/launch.py: the supervisor's time limit, cancel and attach, and killing a trial by its tag.

The `distributed` tests run real trials of the tiny model (trainer.spawn, gloo); the others use plain commands.
Every test ends with no process of its trial alive, found both by tag and by the work dir in any
process's command line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer.helpers import tiny_config
from trainer.contract.parallel import ParallelConfig
from trainer.contract.result import BenchmarkResult
from trainer.contract.trial_dir import LAUNCH_FILE, RESULT_FILE, TAG_VAR
from trainer.launch import (
    LocalRun,
    is_alive,
    kill_trial,
    local_env,
    new_tag,
    proc_stat,
    process_start_time,
    run_local,
    start_local,
    trial_processes,
)

P = ParallelConfig
TP2 = P(tp=2, micro_batch_size=8)
ONE_RANK = P(micro_batch_size=8)


@pytest.fixture
def tags() -> Iterator[list[str]]:
    """Tags of the trials a test starts: whatever a failing test left behind is killed."""
    started: list[str] = []
    yield started
    for tag in started:
        kill_trial(tag, grace_s=1.0)


def mentioning(text: str) -> list[str]:
    """Command lines of live processes (not this one) that mention `text`."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(f"{entry.name}: {cmdline.decode(errors='replace')!r}")
    return found


def assert_nothing_left(run: LocalRun) -> None:
    assert trial_processes(run.tag) == []
    assert mentioning(str(run.work_dir)) == []


def wait_for_processes(tag: str, count: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while len(trial_processes(tag)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} processes of {tag} after {timeout_s} s"
        time.sleep(0.1)


def ppid(pid: int) -> int:
    return int(proc_stat(pid)[1])


# --- processes by tag (no torch) -----------------------------------------------------------------


def test_kill_trial_kills_reparented_and_stubborn_processes() -> None:
    tag = new_tag()
    other = subprocess.Popen(["sleep", "300"], env={**os.environ, TAG_VAR: tag + "-other"})
    # A double-forked sleep (its subshell exits, so init adopts it) and a sleep that ignores SIGTERM.
    script = "(sleep 300 &); trap '' TERM; sleep 301 & wait"
    parent = subprocess.Popen(["bash", "-c", script], env={**os.environ, TAG_VAR: tag})
    try:
        wait_for_processes(tag, 3, timeout_s=10)
        pids = trial_processes(tag)
        assert parent.pid in pids and other.pid not in pids
        assert any(ppid(pid) not in (parent.pid, os.getpid()) for pid in pids)  # one reparented
        started = time.monotonic()
        assert kill_trial(tag, grace_s=0.5) == 3
        assert time.monotonic() - started < 5
        assert trial_processes(tag) == []
        assert parent.wait(timeout=5) == -signal.SIGKILL  # it ignored SIGTERM
        assert is_alive(other.pid, process_start_time(other.pid))
    finally:
        kill_trial(tag, grace_s=0)
        other.kill()
        other.wait()
        parent.wait()


def test_trial_processes_excludes_the_caller() -> None:
    tag = new_tag()
    code = "from trainer.launch import trial_processes; import sys; print(trial_processes(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, tag], env=local_env({TAG_VAR: tag}), capture_output=True,
                         text=True, check=True, timeout=60)  # fmt: skip
    assert out.stdout.strip() == "[]"


def test_is_alive_needs_the_same_start_time() -> None:
    own = process_start_time(os.getpid())
    assert own is not None and is_alive(os.getpid(), own)
    assert not is_alive(os.getpid(), own + 1)  # a reused pid
    child = subprocess.Popen(["sleep", "300"])
    started = process_start_time(child.pid)
    child.kill()
    time.sleep(0.2)
    assert not is_alive(child.pid, started)  # a zombie: exited, not yet reaped
    child.wait()
    assert not is_alive(child.pid, started)


# --- the supervisor with plain commands ------------------------------------------------------------


def python_command(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


HANG = python_command("import time; time.sleep(300)")


def test_time_limit_gives_a_timeout_result(tmp_path: Path, tags: list[str]) -> None:
    started = time.monotonic()
    run = start_local(tiny_config(ONE_RANK), tmp_path, timeout_s=1, command=HANG)
    tags.append(run.tag)
    result = run.wait()
    assert result.status == "timeout"
    assert result.error.startswith("timed out after 1 s (hang or too slow)")
    assert "--- log tail ---" in result.error
    assert time.monotonic() - started < 15
    launch = json.loads((tmp_path / LAUNCH_FILE).read_text())
    assert launch["pid"] == run.pid and launch["start_time"] == run.start_time and launch["tag"] == run.tag
    assert launch["timeout_s"] == 1 and launch["exit_code"] == 124 and launch["host"]
    assert_nothing_left(run)


def test_a_result_the_command_wrote_stands(tmp_path: Path, tags: list[str]) -> None:
    written = BenchmarkResult(status="error", error="written by the trainer")
    command = python_command(f"""
        import pathlib, time
        pathlib.Path({RESULT_FILE!r}).write_text({written.to_json()!r})
        time.sleep(300)
    """)
    run = start_local(tiny_config(ONE_RANK), tmp_path, timeout_s=2, command=command)
    tags.append(run.tag)
    assert run.wait() == written
    assert_nothing_left(run)


def test_a_process_that_outlives_the_command_is_killed(tmp_path: Path, tags: list[str]) -> None:
    command = python_command("""
        import subprocess, sys
        subprocess.Popen(["sleep", "300"], start_new_session=True)  # as torchrun starts a rank
        sys.exit(3)
    """)
    run = start_local(tiny_config(ONE_RANK), tmp_path, command=command)
    tags.append(run.tag)
    result = run.wait()
    assert (
        result.status == "error" and "no valid result file" in result.error and "exit code 3" in result.error
    )
    assert_nothing_left(run)


def test_poll_kills_what_a_killed_supervisor_left(tmp_path: Path, tags: list[str]) -> None:
    run = start_local(tiny_config(ONE_RANK), tmp_path, timeout_s=300, command=HANG)
    tags.append(run.tag)
    wait_for_processes(run.tag, 2)
    os.kill(run.pid, signal.SIGKILL)
    result = run.wait()
    assert result.status == "error" and "exit code -9" in result.error
    assert_nothing_left(run)


def test_attach(tmp_path: Path, tags: list[str]) -> None:
    assert LocalRun.attach(tmp_path) is None
    run = start_local(tiny_config(ONE_RANK), tmp_path, timeout_s=300, command=HANG)
    tags.append(run.tag)
    attached = LocalRun.attach(tmp_path)
    assert attached is not None and attached.process is None
    assert (attached.pid, attached.start_time, attached.tag, attached.timeout_s) == (
        run.pid,
        run.start_time,
        run.tag,
        300,
    )
    assert attached.poll() is None
    attached.cancel()
    assert_nothing_left(run)
    assert run.poll() is not None and attached.poll() is not None
    assert "exit code 143" in attached.poll().error  # SIGTERM: a cancel writes no result


# --- real trials (trainer.spawn) -------------------------------------------------------------------


@pytest.mark.distributed
def test_launcher_timeout_on_a_hung_rank_leaves_nothing(tmp_path: Path, tags: list[str]) -> None:
    """Rank 1 hangs at step 1 and rank 0 waits in a collective (the step timeout is 2 minutes):
    the supervisor's time limit ends the trial and kills both ranks, their launcher
    (trainer.spawn), and itself."""
    started = time.monotonic()
    run = start_local(tiny_config(TP2), tmp_path, timeout_s=12, env={"TRAINER_FAULT": "hang:1:1"})
    tags.append(run.tag)
    result = run.wait()
    assert result.status == "timeout", result.error
    assert result.error.startswith("timed out after 12 s (hang or too slow)")
    assert time.monotonic() - started < 12 + 20
    assert_nothing_left(run)
    attached = LocalRun.attach(tmp_path)
    assert attached is not None and attached.poll() == result


@pytest.mark.distributed
@pytest.mark.parametrize("through", ["own", "attached"])
def test_cancel_kills_every_process_of_the_trial(through: str, tmp_path: Path, tags: list[str]) -> None:
    run = start_local(tiny_config(TP2), tmp_path, timeout_s=300, env={"TRAINER_FAULT": "hang:1:1"})
    tags.append(run.tag)
    wait_for_processes(run.tag, 4)  # supervisor, trainer.spawn, 2 ranks
    handle = run if through == "own" else LocalRun.attach(tmp_path)
    started = time.monotonic()
    handle.cancel()
    assert time.monotonic() - started < 15
    assert_nothing_left(run)
    assert not (tmp_path / RESULT_FILE).exists()


@pytest.mark.distributed
def test_time_limit_holds_when_the_caller_dies(tmp_path: Path, tags: list[str]) -> None:
    """The caller starts a hung trial and is SIGKILLed; the supervisor still ends it on time."""
    caller_code = """
        import sys, time
        from pathlib import Path
        from tests.trainer.helpers import tiny_config
        from trainer.contract.parallel import ParallelConfig
        from trainer.launch import start_local
        run = start_local(tiny_config(ParallelConfig(micro_batch_size=8)), Path(sys.argv[1]), timeout_s=10,
                          env={"TRAINER_FAULT": "hang:0:1"})
        print(run.tag, flush=True)
        time.sleep(300)
    """
    caller = subprocess.Popen([*python_command(caller_code), str(tmp_path)], env=local_env(), text=True,
                              stdout=subprocess.PIPE, cwd=Path(__file__).parents[2])  # fmt: skip
    try:
        tag = caller.stdout.readline().strip()
        tags.append(tag)
        assert tag.startswith("trial-")
    finally:
        caller.kill()
        caller.wait()
    attached = LocalRun.attach(tmp_path)
    assert attached is not None and attached.tag == tag
    deadline = time.monotonic() + 60
    while (result := attached.poll()) is None:
        assert time.monotonic() < deadline, "the supervisor did not end the trial"
        time.sleep(0.2)
    assert result.status == "timeout" and result.error.startswith("timed out after 10 s"), result.error
    assert json.loads((tmp_path / LAUNCH_FILE).read_text())["exit_code"] == 124
    assert_nothing_left(attached)


@pytest.mark.distributed
def test_collective_timeout_is_a_timeout(tmp_path: Path, tags: list[str]) -> None:
    """Rank 1 hangs at step 2; rank 0's collective times out (step timeout shortened to 5 s after
    step 1) and rank 0 writes status 'timeout' long before the launcher's limit."""
    cfg = tiny_config(TP2, warmup_steps=2, step_timeout_s=5)
    started = time.monotonic()
    run = start_local(cfg, tmp_path, timeout_s=120, env={"TRAINER_FAULT": "hang:1:2"})
    tags.append(run.tag)
    result = run.wait()
    assert result.status == "timeout", result.error
    assert "a collective timed out on rank 0" in result.error and result.failed_rank is None
    assert time.monotonic() - started < 60
    assert_nothing_left(run)


@pytest.mark.distributed
def test_crashed_rank_without_traceback_is_an_error(tmp_path: Path) -> None:
    """A rank that dies hard (like a segfault) leaves no result file: the launcher reports a crash."""
    result = run_local(tiny_config(TP2), tmp_path, timeout_s=120, env={"TRAINER_FAULT": "exit:1:1"})
    assert result.status == "error"
    assert "no valid result file" in result.error and "rank 1 exited with code 1" in result.error
