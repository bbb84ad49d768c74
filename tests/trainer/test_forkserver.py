"""trainer/forkserver.py: ranks forked from a server that imported torch once, found and killed by
their trial's tag like started ones, and a trial that goes on (or ends cleanly) whatever happens to
the server. Real trials of the tiny model (trainer.spawn, gloo)."""

from __future__ import annotations

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
from tests.trainer.test_launch import assert_nothing_left, wait_for_processes
from trainer.contract.parallel import ParallelConfig
from trainer.contract.trial_dir import LOG_FILE, SOCKET_VAR, TAG_VAR, trial_tag
from trainer.forkclient import TAG_ROOM, ForkServer
from trainer.launch import (
    kill_trial,
    local_env,
    new_tag,
    proc_stat,
    run_local,
    start_local,
    trial_processes,
)
from tuner.dispatch.local import LocalDispatcher

DP2 = ParallelConfig(dp_replicate=2, micro_batch_size=4)
FALLBACK = "trainer.forkserver: starting the rank as a process"


@pytest.fixture
def server() -> Iterator[ForkServer]:
    s = ForkServer.start()
    assert s is not None
    yield s
    s.close(wait_s=10)
    assert not s.alive() and trial_processes(s.tag) == []


def children(pid: int) -> list[int]:
    """Live (not zombie) children of `pid`."""
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and _ppid(int(e.name)) == pid]


def _ppid(pid: int) -> int | None:
    """The parent of a live process; None when it is gone or a zombie."""
    fields = proc_stat(pid)
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[1])


def test_retag_writes_the_tag_where_proc_environ_shows_it() -> None:
    code = textwrap.dedent("""
        import sys
        from pathlib import Path
        from trainer.forkserver import retag
        retag(sys.argv[1])
        print(Path("/proc/self/environ").read_bytes().count(b"PARALLEL_TUNER_TRIAL="))
        retag("x" * 200)
    """)
    run = subprocess.run([sys.executable, "-c", code, "trial-new"], capture_output=True, text=True,
                         env={**local_env(), TAG_VAR: "placeholder".ljust(40, "_")})  # fmt: skip
    assert run.stdout.strip() == "1"  # one entry, the new tag (a second would be the old one)
    assert "does not fit the 40 bytes kept for it" in run.stderr


@pytest.mark.distributed
def test_a_forked_trial_equals_a_started_one(tmp_path: Path, server: ForkServer) -> None:
    cfg = tiny_config(DP2, measure_steps=3)
    started = run_local(cfg, tmp_path / "started")
    forked = run_local(cfg, tmp_path / "forked", env={SOCKET_VAR: server.path})
    assert started.status == forked.status == "ok", (started.error, forked.error)
    assert forked.losses == started.losses and forked.grad_norms == started.grad_norms
    # One thread per rank, as torchrun sets it: 2 ranks of 2 threads on 2 cores ran pp 2 6x slower.
    assert started.device_name.endswith("(1 threads)") and forked.device_name.endswith("(1 threads)")
    assert FALLBACK not in (tmp_path / "forked" / LOG_FILE).read_text()
    assert children(server.process.pid) == []  # reaped


@pytest.mark.distributed
def test_forked_ranks_carry_the_trial_tag_and_die_with_the_trial(tmp_path: Path, server: ForkServer) -> None:
    run = start_local(tiny_config(DP2), tmp_path / "hung", timeout_s=300,
                      env={SOCKET_VAR: server.path, "TRAINER_FAULT": "hang:1:1"})  # fmt: skip
    try:
        wait_for_processes(run.tag, 4)  # supervisor, trainer.spawn, 2 ranks
        ranks = children(server.process.pid)
        assert len(ranks) == 2 and set(ranks) <= set(trial_processes(run.tag))
        run.cancel()
        assert_nothing_left(run)
        assert children(server.process.pid) == []
    finally:
        kill_trial(run.tag, grace_s=1)
    again = run_local(tiny_config(DP2), tmp_path / "next", env={SOCKET_VAR: server.path})
    assert again.status == "ok", again.error


@pytest.mark.distributed
def test_a_tag_too_long_to_fork_starts_the_ranks_as_processes(tmp_path: Path, server: ForkServer) -> None:
    tag = new_tag().ljust(TAG_ROOM + 1, "x")
    result = run_local(tiny_config(DP2), tmp_path, env={SOCKET_VAR: server.path}, tag=tag)
    assert result.status == "ok", result.error
    assert (tmp_path / LOG_FILE).read_text().count(FALLBACK) == 2
    assert trial_processes(tag) == []


@pytest.mark.distributed
def test_a_trial_with_other_start_up_settings_starts_its_ranks_as_processes(
    tmp_path: Path, server: ForkServer
) -> None:
    """A variable torch reads when imported cannot reach a rank forked after the import."""
    env = {SOCKET_VAR: server.path, "TORCH_SHOW_CPP_STACKTRACES": "1"}
    result = run_local(tiny_config(DP2), tmp_path, env=env)
    assert result.status == "ok", result.error
    log = (tmp_path / LOG_FILE).read_text()
    assert log.count(FALLBACK) == 2 and "differs from the server's in TORCH_SHOW_CPP_STACKTRACES" in log


@pytest.mark.distributed
def test_the_fork_server_dying_ends_its_trials_and_the_next_trial_gets_a_new_one(tmp_path: Path) -> None:
    """A LocalDispatcher forks CPU ranks from its server. SIGKILL the server while a trial runs:
    trainer.spawn sees it go, the trial fails instead of hanging, nothing of it is left, and the
    dispatcher's next trial runs from a new server; close() stops that one."""
    dispatcher, name = LocalDispatcher(num_devices=2, env={"TRAINER_FAULT": "hang:1:1"}), new_tag()
    try:
        hung = dispatcher.submit(tiny_config(DP2), name=name, work_dir=tmp_path / "hung", timeout_s=300)
        tag = trial_tag(name, tmp_path / "hung")
        first = dispatcher.server
        assert first is not None
        wait_for_processes(tag, 4)
        ranks = children(first.process.pid)
        assert len(ranks) == 2
        first.process.kill()
        first.process.wait()
        deadline = time.monotonic() + 60
        while not (report := dispatcher.poll(hung)).done:
            assert time.monotonic() < deadline, "the trial did not end after its fork server died"
            time.sleep(0.2)
        assert not report.outcome.ok
        assert trial_processes(tag) == [] and all(_ppid(p) is None for p in ranks)
        dispatcher.env = {}
        ok = dispatcher.submit(tiny_config(DP2), name=new_tag(), work_dir=tmp_path / "ok", timeout_s=300)
        second = dispatcher.server
        assert second is not None and second is not first and second.alive()
        while not (report := dispatcher.poll(ok)).done:
            time.sleep(0.2)
        assert report.outcome.ok, report.outcome
        assert FALLBACK not in (tmp_path / "ok" / LOG_FILE).read_text()
    finally:
        dispatcher.close()
    second.process.wait(10)
    assert trial_processes(second.tag) == [] and not Path(second.path).parent.exists()


def test_the_server_stops_when_the_process_that_started_it_ends() -> None:
    code = (
        "from trainer.forkclient import ForkServer; s = ForkServer.start(); print(s.process.pid, flush=True)"
    )
    starter = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=local_env(),
                             timeout=120)  # fmt: skip
    pid = int(starter.stdout.strip())
    deadline = time.monotonic() + 10
    while _ppid(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _ppid(pid) is not None
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the fork server outlived the process that started it"
