"""A model size nobody measured on a calibrated cluster: the planner's predicted best, marked as
predicted, with its calibration and a one-line command that confirms it (tuner/predict.py)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from api.main import create_app
from tests.records import finish, record_trial
from trainer.contract.parallel import ParallelConfig as P
from tuner import store, views
from tuner.db import connect
from tuner.outcome import Outcome
from tuner.perfconstants import ModelConstants
from tuner.settings import Settings
from tuner.spec import parse_spec

TUNER = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"
SPEC = {"name": "measured-tiny", "model": "gpt-tiny", "cluster": "cpu-local", "num_gpus": 2,
        "training": {"global_batch_size": 8, "precision": "fp32"},
        "space": {"tp": [1, 2], "pp": [1], "zero_stage": [0], "activation_checkpoint": ["none"],
                  "sequence_parallel": [False]},
        "trial": {"warmup_steps": 1, "measure_steps": 2, "timeout_s": 120, "device": "cpu"}}  # fmt: skip


@pytest.fixture
def db(tmp_path: Path) -> str:
    """gpt-tiny measured on cpu-local, and that cluster's calibration."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    sessions = connect(url)
    with sessions.begin() as s:
        study = store.create_study(s, parse_spec(SPEC))
        record_trial(
            s, study, P(tp=2, micro_batch_size=8), Outcome(ok=True, tokens_per_s=1000.0, step_time_s=0.25)
        )
        finish(s, study.id)
        store.save_calibration(s, "cpu-local", ModelConstants(compute_efficiency=0.4), 5, 0.12, study)
    return url


def test_an_unmeasured_size_gets_a_prediction_and_a_measured_one_does_not(db: str) -> None:
    with connect(db)() as s:
        (measured,) = views.best_or_predicted(s, model="gpt-tiny")
        (predicted,) = views.best_or_predicted(s, model="gpt-small")
        assert (
            views.best_or_predicted(s, model="gpt-small", cluster="a100-80gb") == []
        )  # no calibration there
    assert measured.kind == "measured" and measured.tokens_per_s == 1000.0
    assert (
        predicted.kind == "predicted" and predicted.model == "gpt-small" and predicted.cluster == "cpu-local"
    )
    assert predicted.predicted_tokens_per_s > 0 and predicted.template_study == "measured-tiny"
    assert (predicted.calibration.num_points, predicted.calibration.rms_log_error) == (5, 0.12)
    spec = parse_spec(predicted.study_spec)  # the confirming study is a valid spec: grid over the top layouts
    assert (spec.sampler, spec.budget.max_trials, spec.model.preset, spec.devices) == (
        "grid",
        3,
        "gpt-small",
        2,
    )
    assert predicted.confirm.endswith("&& tuner run confirm-gpt-small.yaml")


def test_the_api_and_the_cli_show_a_prediction_as_predicted(db: str, tmp_path: Path) -> None:
    client = TestClient(create_app(Settings(database_url=db, work_dir=tmp_path)))
    (row,) = client.get("/api/best", params={"model": "gpt-small"}).json()
    assert row["kind"] == "predicted" and row["calibration"]["cluster"] == "cpu-local"
    assert client.get("/api/best", params={"model": "gpt-tiny"}).json()[0]["kind"] == "measured"
    env = {**os.environ, "TUNER_DATABASE_URL": db, "TUNER_WORK_DIR": str(tmp_path / "runs")}
    out = subprocess.run(
        [TUNER, "best", "--model", "gpt-small"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert out.returncode == 0 and out.stdout.startswith("PREDICTED (not measured) gpt-small"), (
        out.stdout + out.stderr
    )
    assert "calibration of cpu-local: 5 measurements" in out.stdout and "confirm: tuner best" in out.stdout


@pytest.mark.distributed
def test_the_one_line_confirmation_runs_the_top_predicted_layouts(db: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TUNER_DATABASE_URL": db,
        "TUNER_WORK_DIR": str(tmp_path / "runs"),
        "PATH": f"{Path(TUNER).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }  # the venv's tuner, as a user's shell has it
    with connect(db)() as s:
        (predicted,) = views.best_or_predicted(s, model="gpt-small")
    done = subprocess.run(["bash", "-c", predicted.confirm], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    written = yaml.safe_load((tmp_path / "confirm-gpt-small.yaml").read_text())
    assert written["model"]["preset"] == "gpt-small"
    out = subprocess.run(
        [TUNER, "best", "--model", "gpt-small", "--json"], capture_output=True, text=True, env=env
    )
    (row,) = [r for r in yaml.safe_load(out.stdout) if r["kind"] == "measured"]
    assert row["study"] == written["name"] and row["tokens_per_s"] > 0
    assert shlex.split(predicted.confirm)[0] == "tuner"
