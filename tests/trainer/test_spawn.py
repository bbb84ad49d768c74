"""trainer.spawn, the local trials' launcher: a real gloo rendezvous through the environment it
sets, a failed rank ending the others, a signal passed on, and no rank left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer.launch import is_alive, process_start_time

SPAWN = [sys.executable, "-m", "trainer.spawn"]


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


@pytest.mark.distributed
def test_ranks_meet_in_a_real_gloo_group(tmp_path: Path) -> None:
    rank = _script(
        tmp_path,
        """
        import os, sys, datetime, torch, torch.distributed as dist
        from trainer.benchmark import init_process_group  # rank 0: the store on the handed socket
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_process_group("gloo", rank, world, datetime.timedelta(seconds=60))
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        out = sys.argv[1] + "/rank" + os.environ["RANK"]
        open(out, "w").write(f"{os.environ['LOCAL_RANK']} {dist.get_world_size()} {t.item():g}")
        dist.destroy_process_group()
        """,
    )
    done = subprocess.run([*SPAWN, "--nproc-per-node=3", "--", *rank, str(tmp_path)],
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"}, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in range(3)] == [f"{r} 3 6" for r in range(3)]


def test_a_failed_rank_ends_the_others_and_sets_the_exit_code(tmp_path: Path) -> None:
    rank = _script(
        tmp_path,
        """
        import os, sys, time
        open(sys.argv[1] + "/pid" + os.environ["RANK"], "w").write(str(os.getpid()))
        if os.environ["RANK"] == "1":
            time.sleep(0.5)
            sys.exit(3)
        time.sleep(300)  # as a rank waiting in a collective for the one that died
        """,
    )
    started = time.monotonic()
    done = subprocess.run([*SPAWN, "--nproc-per-node=2", "--", *rank, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "rank 1 exited with code 3" in done.stderr
    assert time.monotonic() - started < 20  # not the sleeping rank's 300 s
    sleeper = int((tmp_path / "pid0").read_text())
    assert not Path(f"/proc/{sleeper}").exists()  # ended and reaped by the launcher


def test_sigterm_reaches_every_rank_and_a_stubborn_one_is_killed(tmp_path: Path) -> None:
    rank = _script(
        tmp_path,
        """
        import os, signal, sys, time
        if os.environ["RANK"] == "1":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ignores the polite request
        open(sys.argv[1] + "/pid" + os.environ["RANK"], "w").write(str(os.getpid()))
        time.sleep(300)
        """,
    )
    spawner = subprocess.Popen([*SPAWN, "--nproc-per-node=2", "--", *rank, str(tmp_path)],
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        starts = [process_start_time(p) for p in pids]
        spawner.send_signal(signal.SIGTERM)
        assert spawner.wait(timeout=30) == 128 + signal.SIGTERM
        assert not any(is_alive(p, s) for p, s in zip(pids, starts, strict=True))
    finally:
        if spawner.poll() is None:
            spawner.kill()
            spawner.wait()


BAD_ARGUMENTS = [
    (["--nproc-per-node=0", "--", "true"], "--nproc-per-node must be >= 1, not 0"),
    (["--nproc-per-node=2"], "no command given"),
]


@pytest.mark.parametrize(("args", "message"), BAD_ARGUMENTS)
def test_bad_arguments_say_what_is_wrong(args: list[str], message: str) -> None:
    done = subprocess.run([*SPAWN, *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and message in done.stderr


def test_the_launcher_is_chosen_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.contract.trial_dir import LAUNCHER_VAR
    from trainer.launch import LAUNCHERS, launcher_name

    monkeypatch.delenv(LAUNCHER_VAR, raising=False)
    assert launcher_name() == "spawn" and "trainer.spawn" in LAUNCHERS["spawn"](2, Path("c"), Path("r"))
    monkeypatch.setenv(LAUNCHER_VAR, "torchrun")
    assert launcher_name() == "torchrun"
    monkeypatch.setenv(LAUNCHER_VAR, "mpirun")
    with pytest.raises(ValueError, match="'mpirun' is not a launcher; valid: spawn, torchrun"):
        launcher_name()


def test_the_others_are_ended_once_rank_0_has_ended(tmp_path: Path) -> None:
    """Rank 0 wrote a failed trial's result and exited 0 (on purpose); rank 1 waits for a store
    that never came (init_timeout_s): it is ended after the grace period, not left waiting."""
    rank = _script(
        tmp_path,
        """
        import os, sys, time
        open(sys.argv[1] + "/pid" + os.environ["RANK"], "w").write(str(os.getpid()))
        time.sleep(300 if os.environ["RANK"] == "1" else 0.2)
        """,
    )
    started = time.monotonic()
    done = subprocess.run([*SPAWN, "--nproc-per-node=2", "--", *rank, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and "rank 0 ended: ending the other ranks" in done.stderr, done.stderr
    assert time.monotonic() - started < 20
    assert not Path(f"/proc/{int((tmp_path / 'pid1').read_text())}").exists()
