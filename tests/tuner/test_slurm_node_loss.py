"""A multi-node Slurm job whose ranks saw a lost node before slurmctld did ends FAILED, not
NODE_FAIL: tuner/dispatch/slurm.py holds such a crash until Slurm flags one of its nodes (INFRA) or
its wait passes (the crash stands). Slurm's commands are doubles here (canned sacct and sinfo
answers); the real path is tests/slurm/test_multinode.py's link-down case on a 4-node cluster."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tuner.dispatch import slurm
from tuner.dispatch.base import JobHandle
from tuner.outcome import FailureKind


class FakeSlurm:
    """Answers `_query` as sacct, sinfo and scontrol would, and records what was asked."""

    def __init__(self, nodes: str, count: int) -> None:
        self.nodes, self.count = nodes, count
        self.states = {"n1": "allocated", "n2": "allocated"}
        self.asked: list[str] = []

    def __call__(self, args: list[str]) -> str:
        self.asked.append(args[0])
        fmt = next((a for a in args if a.startswith("--format=")), "")
        if args[0] == "sacct" and "NodeList" in fmt:
            return f"{self.nodes}|{self.count}\n"
        if args[0] == "sacct":
            return "7|FAILED|1:0\n"
        if args[0] == "sinfo":
            return "".join(f"{n}|{s}\n" for n, s in self.states.items())
        if args[0] == "scontrol":
            return "SlurmctldTimeout        = 120 sec\nSlurmdTimeout           = 10 sec\n"
        return ""


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    f = FakeSlurm("n[1-2]", 2)
    monkeypatch.setattr(slurm, "_query", f)
    monkeypatch.setattr(slurm, "NODE_CHECK_EVERY_S", 0.0)
    return f


def _poll(d: slurm.SlurmDispatcher, work: Path):
    return d.poll(JobHandle("slurm", "7", work))


def test_a_crash_is_held_until_slurm_flags_a_node_then_it_is_infra(fake: FakeSlurm, tmp_path: Path) -> None:
    d = slurm.SlurmDispatcher()
    (tmp_path / "log.txt").write_text("srun: error: n2: task 1: Killed\n")
    assert not _poll(d, tmp_path).done  # the nodes look fine: Slurm may not have noticed yet
    assert not _poll(d, tmp_path).done
    assert d.node_loss_wait_s == 30.0  # 3 x SlurmdTimeout, read from the cluster
    fake.states["n2"] = "idle*"  # slurmctld's ping went unanswered
    report = _poll(d, tmp_path)
    assert report.done and report.outcome.failure is FailureKind.INFRA, report.outcome
    assert "n2 (idle*)" in report.outcome.message and "Killed" in report.outcome.message
    assert _poll(d, tmp_path) is report  # ended: the same report from now on


def test_a_crash_stands_once_the_wait_passed_with_every_node_healthy(fake: FakeSlurm, tmp_path: Path) -> None:
    d = slurm.SlurmDispatcher(node_loss_wait_s=0.3)
    assert not _poll(d, tmp_path).done
    time.sleep(0.35)
    report = _poll(d, tmp_path)
    assert report.done and report.outcome.failure is FailureKind.CRASH


def test_a_one_node_crash_or_the_trainers_own_error_is_not_held(fake: FakeSlurm, tmp_path: Path) -> None:
    fake.nodes, fake.count = "n1", 1
    report = _poll(slurm.SlurmDispatcher(), tmp_path)
    assert report.outcome.failure is FailureKind.CRASH and "sinfo" not in fake.asked

    fake.nodes, fake.count, fake.asked[:] = "n[1-2]", 2, []
    work = tmp_path / "verdict"
    work.mkdir()
    (work / "result.json").write_text(json.dumps({"status": "error", "error": "ValueError: bad shape"}))
    report = _poll(slurm.SlurmDispatcher(), work)
    assert report.outcome.failure is FailureKind.CRASH and "sinfo" not in fake.asked
    # a verdict that names a network error is held like a job without one
    (work / "result.json").write_text(json.dumps({"status": "error", "error": "Connection reset by peer"}))
    assert not _poll(slurm.SlurmDispatcher(), work).done and "sinfo" in fake.asked
