"""The store on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import IntegrityError

from tests.records import record_trial
from trainer.contract.parallel import ParallelConfig
from tuner import store
from tuner.db import DatabaseError, connect
from tuner.outcome import FailureKind, Feedback, Outcome, TrialState, feedback
from tuner.perfconstants import ModelConstants
from tuner.spec import parse_spec

SPEC = parse_spec({"name": "s1", "model": "gpt-tiny", "cluster": "cpu-local", "num_gpus": 2,
                   "training": {"global_batch_size": 8, "precision": "fp32"}, "space": {"tp": [1, 2]}})  # fmt: skip
A = ParallelConfig(tp=2, micro_batch_size=8)
B = ParallelConfig(dp_replicate=2, micro_batch_size=4)


def ok(tps: float) -> Outcome:
    return Outcome(ok=True, tokens_per_s=tps, tflops_per_device=0.01, mfu=0.1, peak_memory_bytes=10, step_time_s=0.5,
                   result={"step_times_s": [0.4, 0.5, 0.6]})  # fmt: skip


def test_study_and_trials_round_trip(database_url: str) -> None:
    sessions = connect(database_url)
    with sessions.begin() as s:
        study = store.create_study(s, SPEC)
        t0 = record_trial(
            s, study, A, None, {"tokens_per_s": 100.0, "memory_bytes": 5.0}, job="slurm:123@/tmp/x"
        )
        t1 = store.add_trial(s, study, B, None, TrialState.WAITING)
        assert (t0.number, t1.number) == (0, 1)
    with sessions.begin() as s:
        study = store.get_study(s, "s1")
        t0, t1 = store.trials(s, study)
        assert (t0.state, t0.attempts, t0.job_id, t0.predicted_tokens_per_s) == (
            "RUNNING",
            1,
            "slurm:123@/tmp/x",
            100.0,
        )
        assert store.end_attempt(s, t0, ok(250.0), requeue=False, told=Feedback.SCORE)
        assert store.begin_attempt(s, t1) and store.attach_job(s, t1, "slurm:124@/tmp/y", None)
        oom = Outcome.failed(FailureKind.OOM, "CUDA out of memory")
        assert store.end_attempt(s, t1, oom, requeue=False, told=feedback(oom))
    with sessions() as s:
        study = store.get_study(s, "s1")
        t0, t1 = store.trials(s, study)
        assert (t0.state, t0.tokens_per_s, t0.step_time_min_s, t0.step_time_max_s, t0.told) == (
            "COMPLETE", 250.0, 0.4, 0.6, "score",
        )  # fmt: skip
        assert (t1.state, t1.failure_kind, t1.told) == ("FAIL", "oom", "infeasible")
        assert [e["kind"] for e in t1.attempt_log] == ["oom"] and t1.attempt_log[0][
            "job"
        ] == "slurm:124@/tmp/y"
        assert (
            feedback(store.outcome_of(t1)) is Feedback.INFEASIBLE
            and store.outcome_of(t0).tokens_per_s == 250.0
        )
        assert store.config_of(t0) == A
        assert store.best_trial(s, study).number == 0
        (best,) = store.best_configs(s, model="gpt-tiny")
        assert best.tokens_per_s == 250.0 and best.config == A.to_dict() and best.global_batch_size == 8


def test_a_layout_runs_once_per_study(database_url: str) -> None:
    sessions = connect(database_url)
    with pytest.raises(IntegrityError), sessions.begin() as s:
        study = store.create_study(s, SPEC)
        store.add_trial(s, study, A, None, TrialState.WAITING)
        store.add_trial(s, study, A, None, TrialState.WAITING)


def test_study_names_are_unique(database_url: str) -> None:
    sessions = connect(database_url)
    with sessions.begin() as s:
        store.create_study(s, SPEC)
    with pytest.raises(store.StudyExists), sessions.begin() as s:
        store.create_study(s, SPEC)


def test_finished_trials_are_immutable(database_url: str) -> None:
    """A second end of the same attempt (a runner that lost its lease racing the new holder)
    does not take: compare-and-set on the trial's state and job."""
    sessions = connect(database_url)
    with sessions.begin() as s:
        trial = record_trial(s, store.create_study(s, SPEC), A, ok(1.0))
        assert not store.end_attempt(s, trial, ok(2.0), requeue=False, told=Feedback.SCORE)
        assert not store.end_attempt(s, trial, ok(2.0), requeue=True)
        assert not store.begin_attempt(s, trial)
    with sessions() as s:
        (trial,) = store.trials(s, store.get_study(s, "s1"))
        assert (trial.state, trial.tokens_per_s, len(trial.attempt_log)) == ("COMPLETE", 1.0, 1)


def test_best_per_model_size_across_studies(database_url: str) -> None:
    sessions = connect(database_url)
    with sessions.begin() as s:
        for name, tps in (("s1", 100.0), ("s2", 300.0)):
            study = store.create_study(s, SPEC.model_copy(update={"name": name}))
            record_trial(s, study, A, ok(tps))
            record_trial(s, study, B, ok(tps / 2))
    with sessions() as s:
        (best,) = store.best_configs(s)
        assert (best.study, best.tokens_per_s) == ("s2", 300.0)
        assert store.best_configs(s, model="gpt-1t") == []


@pytest.mark.parametrize(
    "url",
    ["sqlite:////nonexistent-dir/x/tuner.db", "postgresql+psycopg://nobody@127.0.0.1:1/db", "notadb://x"],
)
def test_bad_database_url_is_one_clear_line(url: str) -> None:
    with pytest.raises(DatabaseError) as err:
        connect(url)
    assert "\n" not in str(err.value) and ("cannot reach" in str(err.value) or "not valid" in str(err.value))


def test_calibrations_keep_the_latest_constants_per_cluster(database_url: str) -> None:
    sessions = connect(database_url)
    with sessions.begin() as s:
        assert store.latest_constants(s, "cpu-local") is None
        study = store.create_study(s, SPEC)
        store.save_calibration(s, "cpu-local", ModelConstants(compute_efficiency=0.3), 4, 0.2, study)
        store.save_calibration(s, "a100-80gb", ModelConstants(compute_efficiency=0.6), 5, 0.1)
        store.save_calibration(s, "cpu-local", ModelConstants(compute_efficiency=0.4), 6, 0.1, study)
    with sessions() as s:
        assert store.latest_constants(s, "cpu-local") == ModelConstants(compute_efficiency=0.4)
        assert store.latest_constants(s, "a100-80gb") == ModelConstants(compute_efficiency=0.6)
        assert store.latest_constants(s, "h100-80gb") is None


def test_best_per_model_size_follows_finished_trials_and_deletes(database_url: str) -> None:
    sessions = connect(database_url)
    with sessions.begin() as s:
        a = store.create_study(s, SPEC)
        b = store.create_study(s, SPEC.model_copy(update={"name": "s2"}))
        for study, cfg, tps in [
            (a, A, 100.0),
            (a, B, 300.0),
            (b, A, 200.0),
            (b, ParallelConfig(micro_batch_size=8), 50.0),
        ]:
            record_trial(s, study, cfg, ok(tps))
    with sessions() as s:
        best = {(r["gpus"], r["study"], r["tokens_per_s"]) for r in store.best_rows(s)}
        assert best == {(2, "s1", 300.0), (1, "s2", 50.0)}  # per device count: 2 GPUs and 1
        assert [r["tokens_per_s"] for r in store.best_rows(s, num_gpus=1)] == [50.0]
    with sessions.begin() as s:
        s.delete(store.get_study(s, "s1"))  # the trials and their bests go with it
    with sessions() as s:
        assert {(r["gpus"], r["study"], r["tokens_per_s"]) for r in store.best_rows(s)} == {
            (2, "s2", 200.0),
            (1, "s2", 50.0),
        }


def test_status_columns_are_typed_by_the_enums(database_url: str) -> None:
    """Rows hold the enums' values, as before the columns were typed; a string that is no state is
    refused before it reaches the database, and a state reads back as its enum member."""
    from sqlalchemy import text, update
    from sqlalchemy.exc import StatementError

    from tuner.outcome import StudyStatus

    sessions = connect(database_url)
    with sessions.begin() as s:
        study = store.create_study(s, SPEC)
        record_trial(s, study, A, ok(1.0))
    with sessions() as s:
        assert s.execute(text("SELECT status FROM studies")).scalar_one() == "PENDING"
        assert s.execute(text("SELECT state, told FROM trials")).one() == ("COMPLETE", "score")
        study = store.get_study(s, "s1")
        (trial,) = store.trials(s, study)
        assert study.status is StudyStatus.PENDING and trial.state is TrialState.COMPLETE
        assert trial.told is Feedback.SCORE
        with pytest.raises(StatementError, match="done"):
            s.execute(update(store.Study).values(status="done"))
        assert store.find_studies(s, status=StudyStatus.PENDING)[1] == 1
        assert store.find_studies(s, status=StudyStatus.COMPLETE)[1] == 0


def test_a_calibration_exported_with_a_retired_constant_still_imports(database_url: str) -> None:
    """dp_overlap (a fitted fraction, retired by issue 37's overlap rule) in an older export is
    dropped on import and on reading; any other unknown constant is still refused by name."""
    sessions = connect(database_url)
    old = {"cluster": "h100-80gb", "constants": {"compute_efficiency": 0.5, "dp_overlap": 0.4}, "num_points": 3,
           "rms_log_error": 0.1, "created_at": "2026-12-01T00:00:00+00:00"}  # fmt: skip
    with sessions.begin() as s:
        assert store.import_calibrations(s, [old]) == 1
    with sessions() as s:
        assert store.latest_constants(s, "h100-80gb") == ModelConstants(compute_efficiency=0.5)
    bad = {**old, "constants": {"compute_efficiency": 0.5, "dp_overlapp": 0.4}}
    with sessions.begin() as s, pytest.raises(ValueError, match="unknown constants \\['dp_overlapp'\\]"):
        store.import_calibrations(s, [bad])
