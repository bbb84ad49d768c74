"""The study runner's state machine in seconds: budgets (each across a restart), leases, cancel,
dispatch errors, a crash between a submission and its commit, and the failure policy. A real
SQLite database, the fake dispatcher and clock of tests/tuner/fakes.py; the same runner against
real trials: tests/tuner/test_loop.py, tests/slurm/, bench/chaos.py."""

from __future__ import annotations

import datetime as dt
import os
import re
import socket
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from tests.tuner.fakes import FakeClock, FakeCluster, FakeDispatcher, measured_at, ok, tokens_for
from tuner import store
from tuner.db import connect
from tuner.dispatch import JobHandle
from tuner.lease import Lease
from tuner.loop import StudyRunner
from tuner.outcome import FailureKind, Outcome, StudyStatus
from tuner.spec import parse_spec

BASE = {
    "model": "gpt-tiny", "cluster": {"preset": "cpu-local", "gpus_per_node": 8, "num_nodes": 1}, "num_gpus": 4,
    "training": {"global_batch_size": 8, "precision": "fp32"},
    "space": {"tp": [1, 2], "pp": [1, 2], "micro_batch_size": [1, 2, 4, 8], "zero_stage": [0],
              "activation_checkpoint": ["none", "full"], "sequence_parallel": [False], "pp_schedule": ["1f1b"]},
    "trial": {"timeout_s": 600, "device": "cpu"},
    "budget": {"max_trials": 6, "trials_in_flight": 2},
    "sampler": "grid", "prune_predicted_oom": False,
}  # fmt: skip


class Env:
    """A study in a real SQLite database, a fake cluster on a fake clock."""

    def __init__(self, tmp_path: Path, **overrides):
        data = {**BASE, "name": "s"}
        for key, value in overrides.items():
            data[key] = {**data[key], **value} if isinstance(data.get(key), dict) else value
        self.spec = parse_spec(data)
        self.sessions = connect(f"sqlite:///{tmp_path / 'db.sqlite'}")
        self.clock = FakeClock()
        self.cluster = FakeCluster(self.clock)
        self.work_dir = tmp_path / "runs"
        with self.sessions.begin() as s:
            self.study_id = store.create_study(s, self.spec).id

    def runner(self, owner: store.Owner | None = None, takeover: bool = False, **kwargs) -> StudyRunner:
        owner = owner or store.Owner(f"w-{os.urandom(3).hex()}", "elsewhere", 1)
        with self.sessions.begin() as s:
            store.claim(s, self.study_id, owner, takeover=takeover, now=self.clock())
        lease = Lease(self.sessions, self.study_id, owner)  # no heartbeat thread: fake time
        return StudyRunner(self.sessions, self.study_id, FakeDispatcher(self.cluster), self.work_dir, lease,
                           poll_s=10, clock=self.clock, sleep=self.clock.sleep, **kwargs)  # fmt: skip

    def run(self, **kwargs) -> StudyStatus:
        return self.runner(**kwargs).run()

    def steps(self, runner: StudyRunner, n: int) -> None:
        """n passes of the loop, then the runner is dropped as if its process was SIGKILLed."""
        assert runner.load() is None
        for _ in range(n):
            assert runner.step() is None
            self.clock.sleep(10)

    def study(self):
        with self.sessions() as s:
            return s.get(store.Study, self.study_id)

    def trials(self):
        with self.sessions() as s:
            return store.trials(s, s.get(store.Study, self.study_id))

    def usage(self) -> store.Usage:
        with self.sessions() as s:
            return store.usage(s, s.get(store.Study, self.study_id), now=self.clock())

    def expire_lease(self) -> None:
        self.clock.sleep(store.DEFAULT_LEASE_S + 1)


def kinds(trial) -> list[str]:
    return [e["kind"] for e in trial.attempt_log or []]


# --- a calm study ----------------------------------------------------------------------------------


def test_a_calm_study_runs_max_trials_exactly(tmp_path: Path) -> None:
    env = Env(tmp_path)
    assert env.run() is StudyStatus.COMPLETE
    trials = env.trials()
    assert [(t.state, t.told, t.attempts, kinds(t)) for t in trials] == [("COMPLETE", "score", 1, ["ok"])] * 6
    assert [t.device_s for t in trials] == [60.0 * t.tp * t.pp * t.dp for t in trials]
    assert len(env.cluster.submitted) == 6 == len(set(env.cluster.submitted))
    study = env.study()
    assert study.finished_at is not None and study.lease_expires_at is None and study.error is None


# --- budgets from the database, each across a restart -------------------------------------------------


def test_max_trials_holds_across_a_restart_and_running_jobs_are_reattached(tmp_path: Path) -> None:
    env = Env(tmp_path)
    env.steps(env.runner(), 8)  # some trials done, two running, then the runner is gone
    running = [(t.number, t.job_id) for t in env.trials() if t.state == "RUNNING"]
    assert len(running) == 2
    env.expire_lease()
    assert env.run(takeover=True) is StudyStatus.COMPLETE
    trials = env.trials()
    assert len(trials) == 6 and all(t.state == "COMPLETE" for t in trials)
    assert [(t.number, t.job_id) for t in trials if t.number in dict(running)] == running  # same jobs
    assert all(t.attempts == 1 for t in trials)
    assert len(env.cluster.submitted) == 6 == len(set(env.cluster.submitted))  # nothing ran twice


def test_device_hours_budget_continues_across_a_restart(tmp_path: Path) -> None:
    # Each trial runs 60 s on 1-4 devices: 0.05 device-hours is 180 device-seconds.
    env = Env(tmp_path, budget={"max_trials": 20, "max_device_hours": 0.05, "trials_in_flight": 1})
    env.steps(env.runner(), 4)
    before = env.usage().device_s
    assert 0 < before < 180
    env.expire_lease()
    assert env.run(takeover=True) is StudyStatus.COMPLETE
    trials, used = env.trials(), env.usage()
    assert used.device_s >= 180 and len(trials) < 20
    last = max(t.device_s for t in trials)
    assert used.device_s <= 180 + last  # within one trial
    assert "max_device_hours" in env.study().error


def test_wall_time_budget_counts_from_the_first_start(tmp_path: Path) -> None:
    env = Env(tmp_path, budget={"max_trials": 50, "max_wall_time_s": 300, "trials_in_flight": 1})
    env.steps(env.runner(), 12)  # 120 s
    env.expire_lease()  # 61 s more
    assert env.run(takeover=True) is StudyStatus.COMPLETE
    assert "max_wall_time_s" in env.study().error
    assert 300 <= env.usage().wall_s <= 300 + 60 + 10  # the last trial finishes after the limit
    assert all(t.state in ("COMPLETE", "FAIL") for t in env.trials())


def test_early_stop_counts_trials_since_the_last_improvement_across_a_restart(tmp_path: Path) -> None:
    env = Env(tmp_path, budget={"max_trials": 30, "early_stop_trials": 4, "trials_in_flight": 1})
    # Every trial after the first is slower: the first stays the best.
    speed = iter([10_000.0, *[1000.0 - i for i in range(40)]])
    env.cluster.script = lambda cfg, name: (60.0, Outcome(ok=True, tokens_per_s=next(speed), step_time_s=1.0))
    env.steps(env.runner(), 14)  # a few trials
    assert 0 < env.usage().since_improvement < 4
    env.expire_lease()
    assert env.run(takeover=True) is StudyStatus.COMPLETE
    trials = env.trials()
    assert len(trials) == 5 and "early stop" in env.study().error


# --- leases -----------------------------------------------------------------------------------------


def test_a_live_lease_is_refused_an_expired_one_taken_over(tmp_path: Path) -> None:
    env = Env(tmp_path)
    first = store.Owner("worker@n1:11:aaaaaa", "n1", 11)
    env.runner(first)
    with (
        env.sessions.begin() as s,
        pytest.raises(store.ClaimRefused, match=r"worker@n1:11:aaaaaa .*expires in 60 s"),
    ):
        store.claim(s, env.study_id, store.Owner("b", "n2", 12), now=env.clock())
    env.clock.sleep(30)
    with env.sessions.begin() as s:
        assert store.renew(s, env.study_id, first, now=env.clock())  # the heartbeat
    env.clock.sleep(40)  # 70 s after the claim, 40 s after the renewal: still held
    with env.sessions.begin() as s, pytest.raises(store.ClaimRefused, match="expires in 20 s"):
        store.claim(s, env.study_id, store.Owner("b", "n2", 12), now=env.clock())
    env.clock.sleep(21)
    with env.sessions.begin() as s, pytest.raises(store.ClaimRefused, match="expired 1 s ago"):
        store.claim(s, env.study_id, store.Owner("b", "n2", 12), takeover=False, now=env.clock())
    with env.sessions.begin() as s:
        assert (
            store.claim(s, env.study_id, store.Owner("b", "n2", 12), now=env.clock()) is StudyStatus.RUNNING
        )
        assert not store.renew(s, env.study_id, first, now=env.clock())  # the old holder learns it


def test_a_worker_takes_an_expired_study_and_a_dead_local_owner_at_once(tmp_path: Path) -> None:
    env = Env(tmp_path)
    dead = store.Owner("worker@here:dead", socket.gethostname(), 2**22 + 17)  # no such pid
    env.runner(dead)
    with env.sessions.begin() as s:
        taken = store.claim_next(s, store.Owner("w2", "h", 1), now=env.clock())
        assert taken is not None and taken.lease_owner == "w2"  # no wait: the owner's process is gone
    env.expire_lease()
    with env.sessions.begin() as s:
        assert store.claim_next(s, store.Owner("w3", "h", 1), now=env.clock()).lease_owner == "w3"
        assert store.claim_next(s, store.Owner("w4", "h", 1), now=env.clock()) is None  # w3's is live


def test_a_runner_that_lost_its_lease_stops_without_writing(tmp_path: Path) -> None:
    env = Env(tmp_path)
    first = env.runner()
    env.steps(first, 3)
    env.expire_lease()
    env.runner(takeover=True)  # another worker holds it now
    before = [(t.number, t.state, t.job_id, t.attempts) for t in env.trials()]
    env.clock.sleep(120)
    assert first.step() is StudyStatus.RUNNING  # "someone else runs it"
    assert [(t.number, t.state, t.job_id, t.attempts) for t in env.trials()] == before


# --- cancel -----------------------------------------------------------------------------------------


def test_cancel_keeps_the_first_reason_and_ends_every_trial(tmp_path: Path) -> None:
    env = Env(tmp_path)
    runner = env.runner()
    env.steps(runner, 3)
    with env.sessions.begin() as s:
        first = store.cancel(s, env.study_id, "cancelled through the API", now=env.clock())
        again = store.cancel(s, env.study_id, "cancelled from the CLI", now=env.clock())
    assert (first.took, first.status, again.took) == (True, StudyStatus.CANCELLING, False)
    assert "already being cancelled" in again.message
    assert runner.step() is StudyStatus.CANCELLED
    study = env.study()
    assert (study.status, study.error) == ("CANCELLED", "cancelled through the API")
    assert study.finished_at is not None
    assert all(j.cancelled or j.ends_at <= env.clock() for j in env.cluster.jobs.values())
    cancelled = [t for t in env.trials() if t.failure_kind == "cancelled"]
    assert cancelled and all((t.state, t.told) == ("FAIL", "nothing") for t in cancelled)
    with env.sessions.begin() as s:
        late = store.cancel(s, env.study_id, "too late", now=env.clock())
    assert not late.took and "already ended (cancelled)" in late.message
    assert env.study().error == "cancelled through the API"


def test_a_pending_study_is_cancelled_at_once(tmp_path: Path) -> None:
    env = Env(tmp_path)
    with env.sessions.begin() as s:
        result = store.cancel(s, env.study_id, "not needed", now=env.clock())
    assert (result.took, result.status) == (True, StudyStatus.CANCELLED)
    assert env.study().finished_at is not None
    with env.sessions.begin() as s, pytest.raises(store.ClaimRefused, match="already ended"):
        store.claim(s, env.study_id, store.Owner("w", "h", 1))


def test_the_one_writer_refuses_moves_the_state_machine_does_not_allow(tmp_path: Path) -> None:
    env = Env(tmp_path)
    with env.sessions.begin() as s:
        assert not store.transition(s, env.study_id, StudyStatus.COMPLETE)  # PENDING -> COMPLETE: no
        assert not store.transition(
            s, env.study_id, StudyStatus.CANCELLED, where=[store.Study.lease_owner == "x"]
        )
        assert store.transition(s, env.study_id, StudyStatus.CANCELLED)
        assert not store.transition(s, env.study_id, StudyStatus.RUNNING)  # final stays final


def test_no_module_but_the_store_writes_a_study_status() -> None:
    root = Path(__file__).resolve().parents[2]
    writes = re.compile(
        r"\.status\s*=(?!=)|status\s*=\s*[\"'](PENDING|RUNNING|CANCELLING|COMPLETE|FAILED|CANCELLED)[\"']"
    )
    found = [f"{p.relative_to(root)}:{i}" for pkg in ("tuner", "api") for p in (root / pkg).rglob("*.py")
             if p.name != "studies.py" and "migrations" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if writes.search(line)]  # fmt: skip
    assert found == []


# --- dispatch errors ---------------------------------------------------------------------------------


def test_failed_submissions_requeue_with_backoff_and_the_study_goes_on(tmp_path: Path) -> None:
    env = Env(tmp_path)
    failures = iter([True, True, False, True] + [False] * 20)
    env.cluster.fail_submit = lambda name: (
        "sbatch: error: Batch job submission failed" if next(failures) else None
    )
    assert env.run() is StudyStatus.COMPLETE
    trials = env.trials()
    assert [t.state for t in trials] == ["COMPLETE"] * 6
    logged = [k for t in trials for k in kinds(t)]
    assert logged.count("dispatch_error") == 3 and logged.count("ok") == 6
    assert env.study().dispatch_failures == 0


def test_too_many_failed_submissions_pause_the_study_never_fail_it(tmp_path: Path) -> None:
    env = Env(tmp_path, trial={"max_dispatch_failures": 3, "dispatch_pause_s": 120})
    env.cluster.fail_submit = lambda name: "sbatch: error: Unable to contact slurm controller"
    assert env.run() is StudyStatus.PENDING
    study = env.study()
    assert study.status == "PENDING" and "paused after 3 failed submissions" in study.error
    assert study.lease_owner is None and study.resume_after is not None
    with env.sessions.begin() as s:
        assert (
            store.claim_next(s, store.Owner("w", "h", 1), now=env.clock()) is None
        )  # not before resume_after
    env.clock.sleep(121)
    env.cluster.fail_submit = lambda name: None
    assert env.run() is StudyStatus.COMPLETE
    assert env.study().error is None


def test_a_crash_between_submit_and_commit_does_not_run_the_trial_twice(tmp_path: Path) -> None:
    env = Env(tmp_path, budget={"max_trials": 3, "trials_in_flight": 1})
    runner = env.runner()
    runner.load()

    def killed(*args, **kwargs):
        raise SystemExit("SIGKILL between sbatch and the commit of its job id")

    original = store.attach_job
    store.attach_job = killed  # the process dies right after the dispatcher returned
    try:
        with pytest.raises(SystemExit):
            runner.step()
    finally:
        store.attach_job = original
    (trial,) = env.trials()
    assert (trial.state, trial.job_id) == ("SUBMITTING", None) and len(env.cluster.submitted) == 1
    env.expire_lease()
    assert env.run(takeover=True) is StudyStatus.COMPLETE
    first = env.trials()[0]
    assert (first.state, first.attempts, kinds(first)) == ("COMPLETE", 1, ["ok"])
    assert env.cluster.submitted.count(store.job_name(env.study_id, 0, 1)) == 1
    assert len(env.cluster.submitted) == 3


def test_a_submitting_trial_whose_job_never_reached_the_scheduler_is_requeued(tmp_path: Path) -> None:
    env = Env(tmp_path, budget={"max_trials": 2, "trials_in_flight": 1})
    runner = env.runner()
    runner.load()
    original = FakeDispatcher.submit
    FakeDispatcher.submit = lambda self, *a, **k: (_ for _ in ()).throw(SystemExit("killed inside sbatch"))
    try:
        with pytest.raises(SystemExit):
            runner.step()
    finally:
        FakeDispatcher.submit = original
    env.expire_lease()
    assert env.run(takeover=True) is StudyStatus.COMPLETE
    first = env.trials()[0]
    assert (first.state, kinds(first)) == ("COMPLETE", ["dispatch_error", "ok"])


# --- the failure policy ----------------------------------------------------------------------------


def _scripted(env: Env, by_attempt: dict[str, list]) -> None:
    """Trial 0's attempts end as listed; every other trial is fine."""

    def script(cfg, name):
        number, attempt = re.match(r"pt\d+-t(\d+)-a(\d+)", name).groups()
        plan = by_attempt.get(number, [])
        kind = plan[int(attempt) - 1] if int(attempt) <= len(plan) else "ok"
        return 60.0, ok(cfg) if kind == "ok" else Outcome.failed(
            FailureKind(kind), f"{kind} on attempt {attempt}"
        )

    env.cluster.script = script


@pytest.mark.parametrize(
    ("attempts", "state", "told"),
    [
        (["crash", "ok"], "COMPLETE", "score"),  # one crash is retried
        (["crash", "crash"], "FAIL", "infeasible"),  # a crash that repeats is the layout's
        (["infra", "infra", "infra"], "FAIL", "nothing"),  # max_retries 2, never told
        (["infra", "ok"], "COMPLETE", "score"),
        (["oom"], "FAIL", "infeasible"),
        (["timeout"], "FAIL", "infeasible"),  # not retried: hung or too slow within its limit
        (["cancelled"], "FAIL", "nothing"),  # an administrator's scancel: not the layout's fault
        (["infra", "crash", "infra", "crash"], "FAIL", "infeasible"),
    ],
)
def test_failure_policy(tmp_path: Path, attempts: list[str], state: str, told: str) -> None:
    env = Env(tmp_path, budget={"max_trials": 2, "trials_in_flight": 1})
    _scripted(env, {"0": attempts})
    runner = env.runner()
    assert runner.run() is StudyStatus.COMPLETE
    first = env.trials()[0]
    assert (first.state, first.told, kinds(first)) == (state, told, attempts[: len(kinds(first))])
    assert len(kinds(first)) == len(attempts)
    heard = [c for c, _ in runner.sampler.history]
    assert (store.config_of(first) in heard) == (told != "nothing")


def test_predicted_oom_is_its_own_kind_told_as_infeasible(tmp_path: Path) -> None:
    env = Env(tmp_path, prune_predicted_oom=True, cluster={"device_memory_gb": 0.0001},
              budget={"max_trials": 2, "trials_in_flight": 1})  # fmt: skip
    runner = env.runner()
    assert runner.run() is StudyStatus.COMPLETE
    trials = env.trials()
    assert trials and {(t.state, t.failure_kind, t.told) for t in trials} == {
        ("PRUNED", "predicted_oom", "infeasible")
    }
    assert env.cluster.submitted == [] and env.usage().trials == 0


def test_a_slow_trial_is_pruned_while_running_told_its_score_not_retried_and_its_time_counts(
    tmp_path: Path,
) -> None:
    # One trial at a time, so each knows the best before it; the fake trial stops after 30 s
    # instead of 60 when it is slower than its floor (tests/tuner/fakes.py: measured_at). Odd
    # trials run at half speed, so some fall below the floor whatever order the sampler takes.
    env = Env(
        tmp_path, trial={"prune_running_fraction": 0.9}, budget={"max_trials": 6, "trials_in_flight": 1}
    )
    env.cluster.script = measured_at(lambda name: 0.5 if int(re.search(r"-t(\d+)-", name)[1]) % 2 else 1.0)
    runner = env.runner()
    assert runner.run() is StudyStatus.COMPLETE
    trials = env.trials()
    floors = [env.cluster.jobs[JobHandle.parse(t.job_id).id].cfg.abandon_below_tokens_per_s for t in trials]
    best_before = [max((u.tokens_per_s for u in trials[:i] if u.state == "COMPLETE"), default=None)
                   for i in range(len(trials))]  # fmt: skip
    assert floors == [None if b is None else 0.9 * b for b in best_before]
    pruned = [t for t in trials if t.state == "PRUNED"]
    assert pruned and all(
        t.tokens_per_s < f for t, f in zip(trials, floors, strict=True) if t.state == "PRUNED"
    )
    for t in pruned:  # a measurement of fewer steps, not a failure: no failure kind, its stop reason
        assert (t.failure_kind, t.failure_message, t.told, t.attempts, kinds(t)) == (
            None,
            None,
            "score",
            1,
            ["pruned_running"],
        )
        assert t.stop_reason.startswith("pruned while running") and t.tokens_per_s > 0
        assert store.pruned_while_running(t)
        assert t.device_s == 30.0 * t.tp * t.pp * t.dp
        assert store.outcome_of(t).ok and store.outcome_of(t).pruned  # replayed as a score
    used = env.usage()
    assert used.trials == 6 and used.device_s == sum(t.device_s for t in trials)  # counted, not free
    assert len(env.cluster.submitted) == 6 == len(set(env.cluster.submitted))  # none retried
    heard = dict(runner.sampler.history)
    assert all(heard[store.config_of(t)].tokens_per_s == t.tokens_per_s for t in pruned)
    with env.sessions() as s:
        best = store.best_trial(s, s.get(store.Study, env.study_id))
    assert best.state == "COMPLETE" and best.tokens_per_s == max(t.tokens_per_s for t in trials)


def test_a_database_that_stops_answering_pauses_the_runner_and_loses_nothing(tmp_path: Path) -> None:
    env = Env(tmp_path)
    real, calls = store.usage, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if 5 <= calls["n"] < 9:
            raise OperationalError("SELECT", {}, Exception("server closed the connection unexpectedly"))
        return real(*args, **kwargs)

    waits, sleep = [], env.clock.sleep
    env.clock.sleep = lambda s: (waits.append(s), sleep(s))[1]
    store.usage = flaky
    try:
        assert env.run() is StudyStatus.COMPLETE
    finally:
        store.usage = real
    assert calls["n"] > 9 and [t.state for t in env.trials()] == ["COMPLETE"] * 6
    # Four failed passes back off 1, 2, 4, 8 s (tuner/loop.py: DB_BACKOFF), then it polls again.
    at = waits.index(1)
    assert waits[at : at + 5] == [1, 2, 4, 8, 10]  # 10: Env's poll_s


def test_handing_back_requeues_running_trials_without_using_a_retry(tmp_path: Path) -> None:
    env = Env(tmp_path)
    stop = {"now": False}
    runner = env.runner(should_yield=lambda: stop["now"])
    env.steps(runner, 3)
    stop["now"] = True
    assert runner.step() is StudyStatus.PENDING
    study = env.study()
    assert (study.status, study.lease_owner) == ("PENDING", None)
    handed = [t for t in env.trials() if kinds(t) == ["cancelled"]]
    assert handed and all(t.state == "WAITING" for t in handed)
    assert env.run() is StudyStatus.COMPLETE
    assert all(t.state == "COMPLETE" and kinds(t)[-1] == "ok" for t in env.trials())


def test_best_and_throughput_come_from_the_measurements(tmp_path: Path) -> None:
    env = Env(tmp_path)
    env.run()
    with env.sessions() as s:
        best = store.best_trial(s, s.get(store.Study, env.study_id))
    assert best.tokens_per_s == max(t.tokens_per_s for t in env.trials())
    from tuner.spec import benchmark_config

    assert best.tokens_per_s == tokens_for(benchmark_config(env.spec, store.config_of(best)))


def test_budget_decisions_are_pure_functions_of_usage() -> None:
    from tuner.budget import may_add_trial, stop_reason
    from tuner.spec import BudgetSpec

    b = BudgetSpec(max_trials=4, max_wall_time_s=100, max_device_hours=1, early_stop_trials=3)
    fresh = store.Usage(trials=3, finished=2, active=1, device_s=10, wall_s=5, since_improvement=0)
    assert may_add_trial(b, fresh) and stop_reason(b, fresh) is None
    assert not may_add_trial(b, store.Usage(4, 3, 1, 10, 5, 0))
    assert "max_wall_time_s" in stop_reason(b, store.Usage(1, 0, 0, 0, 100, 0))
    assert "max_device_hours" in stop_reason(b, store.Usage(1, 0, 0, 3600, 1, 0))
    assert "early stop" in stop_reason(b, store.Usage(1, 0, 0, 0, 1, 3))


def test_times_are_utc_from_the_injected_clock(tmp_path: Path) -> None:
    env = Env(tmp_path, budget={"max_trials": 1})
    env.run()
    (trial,) = env.trials()
    ended = dt.datetime.fromisoformat(trial.attempt_log[0]["ended_at"])
    assert ended.tzinfo is not None and ended <= env.clock()


def test_the_exported_sbatch_reproduces_exactly_what_was_measured(tmp_path: Path) -> None:
    import json

    from trainer.contract.result import BenchmarkConfig
    from tuner.exports import export_layout

    env = Env(tmp_path, training={"precision": "bf16"}, trial={"device": "auto"})  # cpu-local: fp32 on CPU
    env.run()
    with env.sessions() as s:
        best = store.best_trial(s, s.get(store.Study, env.study_id))
    measured = env.cluster.jobs[JobHandle.parse(best.job_id).id].cfg  # what the dispatcher was given
    script = export_layout("sbatch", env.spec, store.config_of(best))
    exported = script.split("<<'CONFIG_JSON'\n")[1].split("\nCONFIG_JSON")[0]
    # All but the study's floor for pruning while running: a rerun measures the layout whatever it is.
    assert BenchmarkConfig.from_dict(json.loads(exported)) == replace(
        measured, abandon_below_tokens_per_s=None
    )
    assert (measured.device, measured.dtype) == ("cpu", "fp32")


def test_dispatchers_never_import_the_runner_the_store_or_the_database() -> None:
    """Dispatchers report job states; the runner is the one writer (docs/samplers.md)."""
    root = Path(__file__).resolve().parents[2] / "tuner" / "dispatch"
    imports = re.compile(r"^\s*(from|import)\s+(tuner\.(store|loop|db|worker|lease)|sqlalchemy)\b", re.M)
    found = {p.name: imports.findall(p.read_text()) for p in root.glob("*.py")}
    assert {name: hits for name, hits in found.items() if hits} == {}
