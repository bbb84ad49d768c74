"""GET /api/studies/{id}/calibration: each completed trial as predicted when proposed and as the
study's own calibration predicts it (tuner/views.py: study_calibration)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from tests import records
from tests.records import record_trial
from trainer.contract.parallel import ParallelConfig
from tuner import store
from tuner.db import connect
from tuner.outcome import FailureKind, Outcome
from tuner.perfconstants import CPU_CONSTANTS, ModelConstants
from tuner.perfmodel import estimate
from tuner.settings import Settings
from tuner.spec import parse_spec

TOKEN = "calibration-token"
SPEC = {"name": "cal-1", "model": "gpt-tiny", "cluster": "cpu-local", "num_gpus": 2,
        "training": {"global_batch_size": 8, "precision": "fp32"},
        "space": {"tp": [1, 2], "pp": [1], "micro_batch_size": [4, 8], "zero_stage": [0],
                  "activation_checkpoint": ["none"], "sequence_parallel": [False]}}  # fmt: skip
MEASURED = {  # layout -> measured tokens/s; each was predicted at 1000 tokens/s when proposed
    ParallelConfig(tp=2, micro_batch_size=8): 900.0,
    ParallelConfig(dp_replicate=2, micro_batch_size=4): 1500.0,
}


@pytest.fixture
def setup(tmp_path: Path) -> tuple[TestClient, str, int]:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'api.db'}", work_dir=tmp_path / "runs", api_token=TOKEN
    )
    client = TestClient(create_app(settings))
    r = client.post("/api/studies", json=SPEC, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 201, r.text
    study_id = r.json()["id"]
    with connect(settings.database_url).begin() as s:
        study = s.get(store.Study, study_id)
        for cfg, tokens in MEASURED.items():
            outcome = Outcome(ok=True, tokens_per_s=tokens, mfu=0.1, step_time_s=8 * 32 / tokens,
                              peak_memory_bytes=10**6, tflops_per_device=0.01)  # fmt: skip
            record_trial(s, study, cfg, outcome, {"tokens_per_s": 1000.0, "memory_bytes": 1e6})
        oom = ParallelConfig(dp_replicate=2, micro_batch_size=2, num_microbatches=2)
        record_trial(s, study, oom, Outcome.failed(FailureKind.OOM, "over the cap"), {"tokens_per_s": 1000.0})
        records.finish(s, study_id)
    return client, settings.database_url, study_id


def test_no_calibration_until_the_study_has_one(setup: tuple[TestClient, str, int]) -> None:
    client, _, study_id = setup
    assert client.get(f"/api/studies/{study_id}/calibration").json() == {
        "calibration": None, "trials": [], "median_error_proposed": None, "median_error_calibrated": None
    }  # fmt: skip
    assert client.get("/api/studies/999/calibration").status_code == 404


def test_completed_trials_priced_by_the_studys_own_calibration(setup: tuple[TestClient, str, int]) -> None:
    client, url, study_id = setup
    fitted = ModelConstants(**{**CPU_CONSTANTS.to_dict(), "compute_efficiency": 0.3, "layer_floor_s": 2e-3})
    with connect(url).begin() as s:
        study = s.get(store.Study, study_id)
        store.save_calibration(s, "cpu-local", fitted, 2, 0.05, study)
        # A later calibration of the same cluster by another study is the cluster's prior, not this study's fit.
        other = store.create_study(s, parse_spec({**SPEC, "name": "cal-2"}))
        store.save_calibration(s, "cpu-local", ModelConstants(compute_efficiency=0.9), 3, 0.1, other)
    body = client.get(f"/api/studies/{study_id}/calibration").json()
    assert (body["calibration"]["study_id"], body["calibration"]["num_points"]) == (study_id, 2)
    spec = parse_spec(SPEC)
    by_layout = {cfg.describe(): (cfg, tokens) for cfg, tokens in MEASURED.items()}
    assert sorted(t["layout"] for t in body["trials"]) == sorted(by_layout)  # completed trials only
    for t in body["trials"]:
        cfg, tokens = by_layout[t["layout"]]
        est = estimate(spec.as_model_config(), cfg, spec.cluster, "fp32", fitted)
        assert (t["tokens_per_s"], t["proposed_tokens_per_s"]) == (tokens, 1000.0)
        assert t["calibrated_tokens_per_s"] == pytest.approx(est.tokens_per_s)
        assert t["calibrated_memory_bytes"] == pytest.approx(est.memory_bytes)
    assert body["median_error_proposed"] == pytest.approx(
        statistics.median([1000 / 900 - 1, 1 - 1000 / 1500])
    )
    calibrated = [abs(t["calibrated_tokens_per_s"] / t["tokens_per_s"] - 1) for t in body["trials"]]
    assert body["median_error_calibrated"] == pytest.approx(statistics.median(calibrated))
