"""The study loop with real trials (the trainer under torchrun on CPU)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select

from trainer.contract.result import BenchmarkConfig
from trainer.contract.trial_dir import trial_tag
from trainer.launch import trial_processes
from tuner import store
from tuner.db import Calibration, connect
from tuner.dispatch import JobHandle
from tuner.dispatch.local import LocalDispatcher
from tuner.exports import export_layout
from tuner.fitting import Measurement, rms_log_error
from tuner.loop import run_study
from tuner.perfconstants import default_constants
from tuner.spec import parse_spec

pytestmark = pytest.mark.distributed

TUNER = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"
BASE = {
    "model": "gpt-tiny", "cluster": "cpu-local", "num_gpus": 2,
    "training": {"global_batch_size": 8, "precision": "fp32"},
    "space": {"tp": [1, 2], "pp": [1], "micro_batch_size": [4, 8], "zero_stage": [0],
              "activation_checkpoint": ["none", "full"], "sequence_parallel": [False]},
    "trial": {"warmup_steps": 1, "measure_steps": 2, "timeout_s": 25, "device": "cpu"},
    "sampler": "grid", "prune_predicted_oom": False,
}  # fmt: skip


class FaultyDispatcher(LocalDispatcher):
    """The real local dispatcher; chosen layouts get a fault injected into their trainer."""

    def __init__(self, faults: dict[str, str]):
        super().__init__()
        self.faults = faults

    def submit(self, cfg, *, name, work_dir, timeout_s):
        self.env = {"TRAINER_FAULT": self.faults.get(cfg.parallel.describe(), "")}
        return super().submit(cfg, name=name, work_dir=work_dir, timeout_s=timeout_s)


def test_failed_trials_are_recorded_and_the_study_completes(tmp_path: Path) -> None:
    spec = parse_spec({**BASE, "name": "faults", "budget": {"max_trials": 6}})
    sessions = connect(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with sessions.begin() as s:
        store.create_study(s, spec)
    faults = {
        "tp1 pp1 dpr2 mbs4x1": "oom:0:0",
        "tp2 pp1 mbs8x1": "raise:1:0",
        "tp1 pp1 dpr2 mbs4x1 ac=full": "hang:0:0",
    }
    status = run_study(sessions, "faults", FaultyDispatcher(faults), tmp_path / "runs")
    assert status == "COMPLETE"
    with sessions() as s:
        trials = store.trials(s, store.get_study(s, "faults"))
        kinds = {store.config_of(t).describe(): (t.state, t.failure_kind) for t in trials}
    assert len(trials) == 6  # the space's 6 valid layouts, each once
    assert kinds.pop("tp1 pp1 dpr2 mbs4x1") == ("FAIL", "oom")
    assert kinds.pop("tp2 pp1 mbs8x1") == ("FAIL", "crash")
    assert kinds.pop("tp1 pp1 dpr2 mbs4x1 ac=full") == ("FAIL", "timeout")
    assert set(kinds.values()) == {("COMPLETE", None)}
    by_layout = {store.config_of(t).describe(): t for t in trials}
    crashed = by_layout["tp2 pp1 mbs8x1"]  # a crash is retried once; repeated, it is the layout's
    assert ([e["kind"] for e in crashed.attempt_log], crashed.told) == (["crash", "crash"], "infeasible")
    # No process of any attempt is left, the hung one included (killed by its supervisor's limit).
    for t in trials:
        work_dir = JobHandle.parse(t.job_id).work_dir
        for attempt in range(1, t.attempts + 1):
            assert trial_processes(trial_tag(store.job_name(t.study_id, t.number, attempt), work_dir)) == []
    # The exported sbatch holds exactly the config the best trial ran with, all but the study's floor
    # for pruning while running (set once a trial has completed): a rerun measures the layout whatever it is.
    with sessions() as s:
        best = store.best_trial(s, store.get_study(s, "faults"))
    ran = BenchmarkConfig.from_json((JobHandle.parse(best.job_id).work_dir / "config.json").read_text())
    exported = export_layout("sbatch", spec, store.config_of(best)).split("<<'CONFIG_JSON'\n")[1]
    assert BenchmarkConfig.from_json(exported.split("\nCONFIG_JSON")[0]) == replace(
        ran, abandon_below_tokens_per_s=None
    )
    # The study's 3 measurements calibrated the model: the cluster's prior for its next study.
    with sessions() as s:
        (row,) = s.scalars(select(Calibration)).all()
        assert (row.cluster_key, row.num_points, row.study_id) == ("cpu-local", 3, trials[0].study_id)
        points = [Measurement(spec.as_model_config(), store.config_of(t), spec.cluster, t.step_time_median_s, "fp32")
                  for t in trials if t.state == "COMPLETE"]  # fmt: skip
        fitted = store.latest_constants(s, "cpu-local")
        # it fits them better than the constants the study began with (a fresh database: the CPU
        # defaults), which price these 2-rank trials ~3x fast (docs/benchmarks.md, "One rank per core")
        assert rms_log_error(points, fitted) < rms_log_error(points, default_constants(spec.cluster))


def _states(db: str, name: str) -> list[tuple[int, str, int, str]]:
    with connect(db)() as s:
        study = store.get_study(s, name)
        return (
            []
            if study is None
            else [(t.number, t.state, t.attempts, t.layout_key) for t in store.trials(s, study)]
        )


def _failure(db: str, name: str, number: int) -> tuple[object, object]:
    with connect(db)() as s:
        trial = next(t for t in store.trials(s, store.get_study(s, name)) if t.number == number)
        return trial.failure_kind, trial.failure_message


def test_worker_killed_mid_study_resumes_without_losing_or_repeating_trials(tmp_path: Path) -> None:
    spec = {**BASE, "name": "restart", "sampler": "model", "budget": {"max_trials": 4}}
    spec["space"] = {**BASE["space"], "zero_stage": [0, 2, 3]}
    # The re-attached trial must complete: room for a loaded machine (make test at a load of 7
    # once timed it out at 25 s, a FAIL where COMPLETE was asserted).
    spec["trial"] = {**BASE["trial"], "timeout_s": 120}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    env = {**os.environ, "TUNER_DATABASE_URL": db, "TUNER_WORK_DIR": str(tmp_path / "runs")}
    worker = subprocess.Popen([TUNER, "run", str(tmp_path / "s.yaml")], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # kill once a trial finished and the next one runs
        states = [st for _, st, _, _ in _states(db, "restart")]
        if "COMPLETE" in states and "RUNNING" in states:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"study never reached a running second trial: {_states(db, 'restart')}")
    worker.send_signal(signal.SIGKILL)  # the worker only: its trials run in their own sessions
    worker.wait()
    before = _states(db, "restart")
    running = [n for n, st, _, _ in before if st == "RUNNING"]
    resumed = subprocess.run([TUNER, "run", str(tmp_path / "s.yaml")], env=env, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming study 'restart'" in resumed.stdout
    after = _states(db, "restart")
    assert len(after) == 4 and [n for n, *_ in after] == [0, 1, 2, 3]
    assert all(st in ("COMPLETE", "FAIL", "PRUNED") for _, st, _, _ in after), after
    assert len({key for *_, key in after}) == 4  # no layout twice
    for n in running:  # the trial that was running when the worker died was re-attached, not re-run
        assert after[n][1] == "COMPLETE" and after[n][2] == 1, (after[n], _failure(db, "restart", n))
