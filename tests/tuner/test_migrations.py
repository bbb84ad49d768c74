"""Migrations on databases written by earlier versions, on SQLite and on a real PostgreSQL: rows
stored before a revision read back right after it, and the downgrade restores them."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from trainer.contract.parallel import ParallelConfig
from tuner import store
from tuner.db import MIGRATIONS, connect, make_engine, upgrade
from tuner.outcome import FailureKind, Feedback, StudyStatus, TrialState, feedback
from tuner.spec import parse_spec

SPEC = parse_spec({"name": "old", "model": "gpt-tiny", "cluster": "cpu-local", "num_gpus": 2,
                   "training": {"global_batch_size": 8, "precision": "fp32"}, "space": {"tp": [1, 2]}})  # fmt: skip
NOW = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def _to(engine: sa.Engine, revision: str, *, down: bool = False) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        (command.downgrade if down else command.upgrade)(cfg, revision)


def _trial(number: int, config: ParallelConfig, **values) -> dict:
    return {"study_id": 1, "number": number, "layout_key": f"k{number}", "config": config.to_dict(), "tp": config.tp,
            "pp": config.pp, "dp": config.dp, "micro_batch_size": config.micro_batch_size,
            "num_microbatches": config.num_microbatches, "zero_stage": 0, "activation_checkpoint": "none",
            "sequence_parallel": False, "pp_schedule": "1f1b", "virtual_stages": 1, "attempts": 1,
            "created_at": NOW, "finished_at": NOW, **values}  # fmt: skip


def _rows_of_revision_0007(engine: sa.Engine) -> None:
    """A study and its trials as tuner 0007 wrote them: a trial pruned while running carried the
    failure kind 'pruned_running' and its reason as the failure message."""
    meta = sa.MetaData()
    meta.reflect(engine, only=["studies", "trials"])
    studies, trials = meta.tables["studies"], meta.tables["trials"]
    measured = {"tokens_per_s": 500.0, "mfu": 0.1, "tflops_per_device": 0.01, "step_time_median_s": 0.5}
    with engine.begin() as conn:
        conn.execute(studies.insert().values(
            id=1, name="old", spec=SPEC.model_dump(mode="json"), status="COMPLETE", sampler="model",
            model_key="gpt-tiny", num_params=1, cluster_key="cpu-local", num_gpus=2, created_at=NOW,
            started_at=NOW, finished_at=NOW,
        ))  # fmt: skip
        for row in [
            _trial(0, ParallelConfig(tp=2, micro_batch_size=8), state="COMPLETE", told="score", device_s=10.0,
                   **measured),
            _trial(1, ParallelConfig(dp_replicate=2, micro_batch_size=4), state="PRUNED", told="score",
                   device_s=4.0, failure_kind="pruned_running", **{**measured, "tokens_per_s": 200.0},
                   failure_message="pruned while running: 200 tokens/s < floor 450 tokens/s after 3 steps"),
            _trial(2, ParallelConfig(micro_batch_size=8), state="PRUNED", told="infeasible", device_s=0.0,
                   attempts=0, failure_kind="predicted_oom", failure_message="predicted 90 GiB > 80 GB"),
        ]:  # fmt: skip
            conn.execute(trials.insert().values(**row))


def test_0008_moves_a_trial_pruned_while_running_out_of_the_failures(database_url: str) -> None:
    engine = make_engine(database_url)
    _to(engine, "0007")
    _rows_of_revision_0007(engine)
    upgrade(engine)  # to head, as every process does at start
    with connect(database_url)() as s:
        study = store.study_by_id(s, 1)
        done, slow, never = store.trials(s, study)
        assert study.status is StudyStatus.COMPLETE and done.state is TrialState.COMPLETE  # typed columns
        assert (slow.state, slow.failure_kind, slow.failure_message, slow.tokens_per_s) == (
            TrialState.PRUNED, None, None, 200.0,
        )  # fmt: skip
        assert slow.stop_reason.startswith(
            "pruned while running: 200 tokens/s"
        ) and store.pruned_while_running(slow)
        assert (never.state, never.failure_kind, never.stop_reason) == (
            TrialState.PRUNED, FailureKind.PREDICTED_OOM, None,
        )  # fmt: skip
        # Replayed to the sampler as a score; counted by the budget as run (the predicted OOM is not).
        assert feedback(store.outcome_of(slow)) is Feedback.SCORE and store.outcome_of(slow).pruned
        assert feedback(store.outcome_of(never)) is Feedback.INFEASIBLE
        used = store.usage(s, study, now=NOW)
        assert (used.trials, used.finished, used.device_s) == (2, 2, 14.0)
    _to(engine, "0007", down=True)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT number, failure_kind, failure_message FROM trials ORDER BY number")
        ).all()
    assert [tuple(r) for r in rows] == [
        (0, None, None),
        (1, "pruned_running", "pruned while running: 200 tokens/s < floor 450 tokens/s after 3 steps"),
        (2, "predicted_oom", "predicted 90 GiB > 80 GB"),
    ]
    engine.dispose()


def test_0010_stores_every_axis_and_the_device_count_from_the_layout(database_url: str) -> None:
    """A cp trial written at revision 0009 (cp only in its config JSON) gets its axis columns and
    its device count, cp included, and study_bests files it at that count (it was tp*tp_col*pp*dp)."""
    engine = make_engine(database_url)
    _to(engine, "0009")
    meta = sa.MetaData()
    meta.reflect(engine, only=["studies", "trials", "study_bests"])
    studies, trials, bests = meta.tables["studies"], meta.tables["trials"], meta.tables["study_bests"]
    cp2 = ParallelConfig(tp=2, dp_shard=2, cp=2, zero_stage=2, micro_batch_size=4)  # 8 devices
    dp2 = ParallelConfig(tp=2, dp_replicate=2, micro_batch_size=4)  # 4 devices
    with engine.begin() as conn:
        conn.execute(studies.insert().values(
            id=1, name="old", spec=SPEC.model_dump(mode="json"), status="COMPLETE", sampler="model",
            model_key="gpt-tiny", num_params=1, cluster_key="cpu-local", num_gpus=8, created_at=NOW,
        ))  # fmt: skip
        for number, (config, tokens) in enumerate([(cp2, 900.0), (dp2, 500.0)]):
            row = _trial(number, config, state="COMPLETE", told="score", tokens_per_s=tokens, device_s=1.0)
            conn.execute(trials.insert().values(**{**row, "zero_stage": config.zero_stage}, tp_col=1))
        # 0009's rebuild: both at "4 devices" (cp left out), the cp trial the best there
        conn.execute(bests.insert().values(study_id=1, world_size=4, trial_id=1, tokens_per_s=900.0))
    upgrade(engine)
    with connect(database_url)() as s:
        study = store.study_by_id(s, 1)
        with_cp, without = store.trials(s, study)
        assert (with_cp.world_size, with_cp.cp, with_cp.dp_shard, with_cp.dp_replicate, with_cp.ep) == (
            8,
            2,
            2,
            1,
            1,
        )
        assert (without.world_size, without.cp, without.dp_replicate) == (4, 1, 2)
        assert store.config_of(with_cp) == cp2
        assert (store.best_at(s, 1, 8), store.best_at(s, 1, 4)) == (900.0, 500.0)
    _to(engine, "0009", down=True)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT world_size, trial_id FROM study_bests")).all()
        columns = {c["name"] for c in sa.inspect(conn).get_columns("trials")}
    assert [tuple(r) for r in rows] == [(4, 1)] and "cp" not in columns and "world_size" not in columns
    engine.dispose()
