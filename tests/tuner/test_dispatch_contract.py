"""The Dispatcher contract (tuner/dispatch/base.py), run over every implementation: the fake of
the state-machine tests, local process groups, Slurm jobs and srun steps of an allocation (a real
local Slurm cluster). What the runner relies on:
- submit returns a handle that survives str/parse, or raises DispatchError;
- poll answers for a handle a previous dispatcher (a previous worker) submitted, and keeps
  answering the same report once the job ended;
- cancel ends the job, and no process of it is left on this machine;
- find returns the job submitted under a name, and None for a name never submitted;
- a hung job ends as a timeout, whichever timer fires."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tuner.fakes import FakeClock, FakeCluster, FakeDispatcher, ok
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig
from trainer.contract.trial_dir import trial_tag
from trainer.launch import trial_processes
from tuner.dispatch import DispatchError, JobHandle, JobReport
from tuner.outcome import FailureKind

ONE = BenchmarkConfig(model=MODEL_PRESETS["gpt-tiny"], parallel=ParallelConfig(micro_batch_size=8), warmup_steps=1,
                      measure_steps=2, device="cpu", dtype="fp32")  # fmt: skip
TWO = BenchmarkConfig(model=MODEL_PRESETS["gpt-tiny"], parallel=ParallelConfig(tp=2, micro_batch_size=8),
                      warmup_steps=1, measure_steps=2, device="cpu", dtype="fp32")  # fmt: skip
HANG = {"TRAINER_FAULT": "hang:0:0"}


@dataclass
class Kind:
    """How to make one kind of dispatcher (with extra job environment) and wait on it."""

    name: str
    make: Callable[[dict[str, str]], object]
    tick: Callable[[], None] = lambda: time.sleep(0.5)
    processes_on_this_machine: bool = True
    bad_submit: Callable[[Path], tuple[object, Path]] | None = None  # -> (dispatcher, work dir)

    def wait(self, d, job: JobHandle, done: bool = True, timeout_s: float = 240) -> JobReport:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            report = d.poll(job)
            if report.done == done and (done or report.state == "RUNNING"):
                return report
            self.tick()
        raise TimeoutError(f"{self.name}: job {job} not {'done' if done else 'running'} in {timeout_s} s")


def _fake() -> Kind:
    clock = FakeClock()
    cluster = FakeCluster(
        clock, script=lambda cfg, name: (1e9 if "hang" in name or "timeout" in name else 30.0, ok(cfg))
    )
    kind = Kind("fake", lambda env: FakeDispatcher(cluster), tick=lambda: clock.sleep(5),
                processes_on_this_machine=False)  # fmt: skip
    cluster.fail_submit = lambda name: "refused" if name.startswith("bad") else None
    kind.bad_submit = lambda tmp: (FakeDispatcher(cluster), tmp / "bad")
    return kind


def _local() -> Kind:
    from tuner.dispatch.local import LocalDispatcher

    def bad(tmp: Path):
        (tmp / "a-file").write_text("")
        return LocalDispatcher(), tmp / "a-file" / "trial"  # cannot be made a directory

    return Kind("local", lambda env: LocalDispatcher(num_devices=4, env=env), bad_submit=bad)


def _slurm(cluster) -> Kind:
    from tuner.dispatch.slurm import SlurmDispatcher
    from tuner.spec import SlurmSpec

    def make(env, partition: str = "debug"):
        return SlurmDispatcher(spec=SlurmSpec(partition=partition), gpus_per_node=8,
                               env={"GLOO_SOCKET_IFNAME": "lo", **env}, min_interval_s=0.5)  # fmt: skip

    return Kind("slurm", make, bad_submit=lambda tmp: (make({}, partition="nosuchpartition"), tmp / "bad"))


def _step(cluster, allocation: str) -> Kind:
    from tuner.dispatch.allocation import SrunDispatcher

    def make(env):
        return SrunDispatcher(nodes=[cluster.node], devices_per_node=4, gpu=False, end=None, allocation=allocation,
                              env={"GLOO_SOCKET_IFNAME": "lo", **env})  # fmt: skip

    def bad(tmp: Path):
        (tmp / "a-file").write_text("")
        return make({}), tmp / "a-file" / "trial"

    return Kind("step", make, bad_submit=bad)


SLURM = [pytest.mark.slurm, pytest.mark.distributed]


def _kind(request, name: str, monkeypatch: pytest.MonkeyPatch):
    if name == "fake":
        yield _fake()
    elif name == "local":
        yield _local()
    else:
        cluster = request.getfixturevalue("slurm_cluster")
        for key in ("SLURM_CONF", "PATH"):
            monkeypatch.setenv(key, cluster.env[key])
        if name == "slurm":
            yield _slurm(cluster)
            return
        # A held allocation (4 CPUs) for srun steps, as `tuner alloc-run` runs inside one.
        allocation = cluster.run("sbatch", "--parsable", "--ntasks=4", "--time=20", "--job-name=contract-hold",
                                 "--output=/dev/null", "--wrap", "sleep 1200").strip().split(";")[0]  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while cluster.run("squeue", "-h", "-j", allocation, "-o", "%T").strip() != "RUNNING":
                assert time.monotonic() < deadline, "the holding allocation never started"
                time.sleep(0.5)
            yield _step(cluster, allocation)
        finally:
            subprocess.run(["scancel", allocation], env=cluster.env, capture_output=True)


LOCAL = pytest.param("local", marks=pytest.mark.distributed)


@pytest.fixture(params=["fake", LOCAL, pytest.param("slurm", marks=SLURM), pytest.param("step", marks=SLURM)])
def kind(request, monkeypatch: pytest.MonkeyPatch):
    yield from _kind(request, request.param, monkeypatch)


# Slurm's own time limit is whole minutes (a hung job ends TIMEOUT ~85 s after it starts):
# tests/slurm/test_dispatch.py::test_slurm_time_limit_is_a_timeout covers it; here the others.
@pytest.fixture(params=["fake", LOCAL, pytest.param("step", marks=SLURM)])
def timed_kind(request, monkeypatch: pytest.MonkeyPatch):
    yield from _kind(request, request.param, monkeypatch)


def _name(kind: Kind, what: str) -> str:
    return f"contract-{kind.name}-{what}-{time.monotonic_ns() % 10**8}"


def test_a_job_runs_to_its_outcome_and_a_new_dispatcher_sees_the_same(kind: Kind, tmp_path: Path) -> None:
    d = kind.make({})
    job = d.submit(ONE, name=_name(kind, "ok"), work_dir=tmp_path / "ok", timeout_s=300)
    assert JobHandle.parse(str(job)) == job
    report = kind.wait(d, job)
    assert report.outcome.ok and report.outcome.tokens_per_s > 0, report
    assert d.poll(job) == report  # the same answer again
    later = kind.wait(kind.make({}), job)  # a restarted worker
    assert later.outcome.ok and later.outcome.tokens_per_s == report.outcome.tokens_per_s


def test_cancel_ends_the_job_and_leaves_no_process(kind: Kind, tmp_path: Path) -> None:
    d, name = kind.make(HANG), _name(kind, "hang")
    job = d.submit(TWO, name=name, work_dir=tmp_path / "hang", timeout_s=600)
    tag = trial_tag(name, tmp_path / "hang")
    kind.wait(d, job, done=False)
    if kind.processes_on_this_machine:
        deadline = time.monotonic() + 120
        while len(trial_processes(tag)) < 2:  # the ranks are up (launcher, ranks)
            assert time.monotonic() < deadline, "the trial's processes never started"
            time.sleep(0.5)
    d.cancel(job)
    report = kind.wait(d, job)
    assert report.outcome.failure is FailureKind.CANCELLED, report
    if kind.processes_on_this_machine:
        deadline = time.monotonic() + 30  # Slurm's slurmstepd signals the ranks asynchronously
        while trial_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert trial_processes(tag) == []


def test_find_returns_the_job_submitted_under_a_name(kind: Kind, tmp_path: Path) -> None:
    d, name = kind.make(HANG), _name(kind, "find")
    job = d.submit(ONE, name=name, work_dir=tmp_path / "find", timeout_s=600)
    try:
        assert kind.make({}).find(name, tmp_path / "find") == job
        assert kind.make({}).find(name + "-never", tmp_path / "find") is None
    finally:
        d.cancel(job)


def test_a_failed_submission_is_a_dispatch_error(kind: Kind, tmp_path: Path) -> None:
    d, work_dir = kind.bad_submit(tmp_path)
    with pytest.raises(DispatchError):
        d.submit(ONE, name=f"bad-{kind.name}", work_dir=work_dir, timeout_s=60)


def test_a_hung_job_ends_as_a_timeout(timed_kind: Kind, tmp_path: Path) -> None:
    kind = timed_kind
    d, name = kind.make(HANG), _name(kind, "timeout")
    job = d.submit(TWO, name=name, work_dir=tmp_path / "timeout", timeout_s=12)
    report = kind.wait(d, job)
    assert report.outcome.failure is FailureKind.TIMEOUT, report
    assert not kind.processes_on_this_machine or trial_processes(trial_tag(name, tmp_path / "timeout")) == []


@pytest.mark.distributed
def test_two_tuners_trials_of_one_name_are_not_each_others(tmp_path: Path) -> None:
    """Two tuners with their own databases on one host both name their first trial pt1-t0-a1:
    cancelling one's trial leaves the other's running (a trial's processes are found by its name
    and its work dir, trainer/contract/trial_dir.py: trial_tag)."""
    from tuner.dispatch.local import LocalDispatcher

    ours, theirs = LocalDispatcher(num_devices=2, env=HANG), LocalDispatcher(num_devices=2, env=HANG)
    name = "pt1-t0-a1"
    mine = ours.submit(ONE, name=name, work_dir=tmp_path / "a" / "t0", timeout_s=600)
    other = theirs.submit(ONE, name=name, work_dir=tmp_path / "b" / "t0", timeout_s=600)
    try:
        local = _local()
        for d, job in ((ours, mine), (theirs, other)):
            local.wait(d, job, done=False)
        ours.cancel(mine)
        assert ours.poll(mine).outcome.failure is FailureKind.CANCELLED
        assert trial_processes(trial_tag(name, tmp_path / "a" / "t0")) == []
        assert theirs.poll(other).state == "RUNNING"
        assert trial_processes(trial_tag(name, tmp_path / "b" / "t0"))
    finally:
        ours.cancel(mine)
        theirs.cancel(other)
        ours.close()
        theirs.close()
    assert trial_processes(trial_tag(name, tmp_path / "b" / "t0")) == []
