"""The API in-process (TestClient) on a real SQLite database: contracts, errors, auth."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from api.main import create_app
from tests import records
from tests.records import record_trial
from trainer.contract.axes import AXES
from trainer.contract.parallel import ParallelConfig
from tuner import store
from tuner.db import connect
from tuner.outcome import FailureKind, Outcome
from tuner.settings import Settings
from tuner.spec import parse_spec, read_spec_file

TUNER = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STUDIES = Path(__file__).resolve().parents[2] / "studies"
HF_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"
SPEC = {"name": "api-1", "model": "gpt-tiny", "cluster": "cpu-local", "num_gpus": 2,
        "training": {"global_batch_size": 8, "precision": "fp32"},
        "space": {"tp": [1, 2], "pp": [1], "micro_batch_size": [4, 8], "zero_stage": [0],
                  "activation_checkpoint": ["none"], "sequence_parallel": [False]}}  # fmt: skip


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        database_url=f"sqlite:///{tmp_path / 'api.db'}", work_dir=tmp_path / "runs", api_token=TOKEN
    )


@pytest.fixture
def client(settings: Settings) -> TestClient:
    return TestClient(create_app(settings))


def _submit(client: TestClient, spec: dict, **kwargs) -> dict:
    r = client.post("/api/studies", json=spec, headers=AUTH, **kwargs)
    assert r.status_code == 201, r.text
    return r.json()


def _finish_with_trials(settings: Settings, study_id: int) -> None:
    """Trials as a worker would have stored them: two measured, one OOM."""
    sessions = connect(settings.database_url)
    with sessions.begin() as s:
        study = s.get(store.Study, study_id)
        for cfg, outcome in [
            (ParallelConfig(tp=2, micro_batch_size=8), Outcome(ok=True, tokens_per_s=900.0, mfu=0.1, step_time_s=0.3,
                                                              peak_memory_bytes=10_000, tflops_per_device=0.01)),
            (ParallelConfig(dp_replicate=2, micro_batch_size=4), Outcome(ok=True, tokens_per_s=1500.0, mfu=0.2,
                                                                        step_time_s=0.2, peak_memory_bytes=9000,
                                                                        tflops_per_device=0.02)),
            (ParallelConfig(dp_replicate=2, micro_batch_size=2, num_microbatches=2),
             Outcome.failed(FailureKind.OOM, "over the cap")),
        ]:  # fmt: skip
            record_trial(s, study, cfg, outcome, {"tokens_per_s": 1000.0, "memory_bytes": 1e4})
        records.finish(s, study_id)


def test_submit_json_and_yaml_then_read_back(client: TestClient) -> None:
    created = _submit(client, SPEC)
    assert created["status"] == "pending" and created["url"] == f"/api/studies/{created['id']}"
    yaml_text = (STUDIES / "tiny-cpu.yaml").read_text()
    r = client.post("/api/studies", content=yaml_text, headers={**AUTH, "Content-Type": "application/yaml"})
    assert r.status_code == 201, r.text
    page = client.get("/api/studies").json()
    assert page["total"] == 2 and {i["name"] for i in page["items"]} == {"api-1", "tiny-cpu"}
    detail = client.get(f"/api/studies/{created['id']}").json()
    assert detail["spec"]["name"] == "api-1" and detail["progress"] == {
        "finished": 0,
        "budget": 20,
        "by_state": {},
    }
    assert client.get("/api/studies", params={"status": "complete"}).json()["total"] == 0
    assert client.get("/api/studies", params={"status": "pending"}).json()["total"] == 2
    assert (
        client.get("/api/studies", params={"model": "gpt-tiny", "limit": 1}).json()["items"][0]["name"]
        == "tiny-cpu"
    )
    assert client.get("/api/studies", params={"limit": 1, "offset": 1}).json()["items"][0]["name"] == "api-1"
    again = client.post("/api/studies", json=SPEC, headers=AUTH)
    assert again.status_code == 409 and again.json()["error"]["code"] == "study_exists"


def test_results_trials_incremental_csv_best_metrics(client: TestClient, settings: Settings) -> None:
    study_id = _submit(client, SPEC)["id"]
    _finish_with_trials(settings, study_id)
    trials = client.get(f"/api/studies/{study_id}/trials").json()
    assert [t["state"] for t in trials["items"]] == ["complete", "complete", "failed"] and trials[
        "last_number"
    ] == 2
    newer = client.get(f"/api/studies/{study_id}/trials", params={"after": 0}).json()
    assert [t["number"] for t in newer["items"]] == [1, 2]
    assert client.get(f"/api/studies/{study_id}/trials", params={"after": 2}).json() == {
        "items": [],
        "last_number": 2,
    }
    csv = client.get(f"/api/studies/{study_id}/trials.csv")
    assert csv.headers["content-type"].startswith("text/csv")
    lines = csv.text.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("number,state,layout,tp,tp_col,pp,dp_replicate,dp_shard")
    assert trials["items"][1]["dp_replicate"] == 2 and trials["items"][1]["world_size"] == 2
    axes = client.get("/api/axes").json()  # the parallel coordinates' dimensions: one per axis
    assert [a["name"] for a in axes] == [a.name for a in AXES] and all(
        a["name"] in trials["items"][0] for a in axes
    )
    best = client.get("/api/best").json()
    assert len(best) == 1 and best[0]["tokens_per_s"] == 1500.0 and best[0]["study_id"] == study_id
    assert best[0]["layout"] == "tp1 pp1 dpr2 mbs4x1" and best[0]["gpus"] == 2
    assert client.get("/api/best", params={"model": "gpt-1t"}).json() == []
    detail = client.get(f"/api/studies/{study_id}").json()
    assert (
        detail["status"] == "complete"
        and detail["best"]["number"] == 1
        and detail["progress"]["finished"] == 3
    )
    assert (
        detail["progress"]["by_state"] == {"complete": 2, "failed": 1}
        and detail["best"]["state"] == "complete"
    )
    metrics = client.get("/metrics").text
    assert 'tuner_studies{state="complete"} 1' in metrics and 'tuner_trials{state="failed"} 1' in metrics
    assert "tuner_trial_duration_seconds_count 3" in metrics


def test_cancel_and_delete(client: TestClient, settings: Settings) -> None:
    study_id = _submit(client, SPEC)["id"]
    r = client.delete(f"/api/studies/{study_id}", headers=AUTH)
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_finished"
    assert client.post(f"/api/studies/{study_id}/cancel", headers=AUTH).json()["status"] == "cancelled"
    assert client.post(f"/api/studies/{study_id}/cancel", headers=AUTH).status_code == 409
    assert client.delete(f"/api/studies/{study_id}", headers=AUTH).status_code == 204
    assert client.get(f"/api/studies/{study_id}").status_code == 404


def test_plan_matches_the_cli_document(client: TestClient, settings: Settings, tmp_path: Path) -> None:
    r = client.post("/api/plan", json={"spec": SPEC, "top": 2})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["num_valid"] == 3 and len(doc["candidates"]) == 2
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    cli = subprocess.run([TUNER, "plan", "--spec", str(path), "--top", "2", "--json"], capture_output=True, text=True,
                         env={**os.environ, "TUNER_DATABASE_URL": settings.database_url}, cwd=tmp_path)  # fmt: skip
    assert json.loads(cli.stdout) == doc
    bad = client.post("/api/plan", json={"spec": {**SPEC, "sampler": "nope"}})
    assert bad.status_code == 422 and bad.json()["error"]["detail"][0]["field"] == "sampler"


@pytest.mark.parametrize("body,ctype,status,code", [
    (b"{not json", "application/json", 400, "malformed_json"),
    (b"name: [unclosed", "application/yaml", 400, "malformed_yaml"),
    (b"- a list\n- not a mapping", "application/yaml", 422, "invalid_spec"),
    (b"<xml/>", "application/xml", 415, "unsupported_media_type"),
])  # fmt: skip
def test_malformed_bodies_get_one_error_shape(
    client: TestClient, body: bytes, ctype: str, status: int, code: str
) -> None:
    r = client.post("/api/studies", content=body, headers={**AUTH, "Content-Type": ctype})
    assert r.status_code == status
    err = r.json()["error"]
    assert (err["status"], err["code"]) == (status, code) and err["message"]


def test_wrong_types_name_the_field(client: TestClient) -> None:
    r = client.post(
        "/api/studies", json={**SPEC, "num_gpus": "two", "budget": {"max_trials": 0}}, headers=AUTH
    )
    assert r.status_code == 422
    fields = {d["field"] for d in r.json()["error"]["detail"]}
    assert {"num_gpus", "budget.max_trials"} <= fields


def test_a_space_with_no_valid_layout_is_refused_with_the_reasons(client: TestClient) -> None:
    spec = {**SPEC, "space": {**SPEC["space"], "tp": [4], "micro_batch_size": [3]}}
    r = client.post("/api/studies", json=spec, headers=AUTH)
    assert r.status_code == 422 and r.json()["error"]["code"] == "no_valid_layout"
    assert "does not divide 2 GPUs" in r.json()["error"]["message"]
    assert client.get("/api/studies").json()["total"] == 0  # nothing stored


def test_an_hf_config_path_is_refused_the_server_reads_no_files(client: TestClient) -> None:
    r = client.post("/api/studies", json={**SPEC, "model": {"hf_config": "/etc/passwd"}}, headers=AUTH)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_spec"
    (problem,) = r.json()["error"]["detail"]
    assert problem["field"] == "model" and problem["message"].startswith("hf_config: ")
    assert "the server reads no files" in problem["message"]
    assert client.get("/api/studies").json()["total"] == 0


def test_a_spec_file_with_hf_config_arrives_as_fields_with_its_family(
    client: TestClient, tmp_path: Path
) -> None:
    """What `tuner submit --url` sends (tuner/cli_results.py): the file read where the spec is."""
    shutil.copy(HF_CONFIGS / "Llama-3.1-8B.json", tmp_path / "config.json")
    spec = {"name": "llama", "model": {"hf_config": "config.json"}, "cluster": "h100-80gb",
            "training": {"global_batch_size": 64}}  # fmt: skip
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    body = yaml.safe_dump(read_spec_file(tmp_path / "s.yaml"))
    r = client.post("/api/studies", content=body, headers={**AUTH, "Content-Type": "application/yaml"})
    assert r.status_code == 201, r.text
    (item,) = client.get("/api/studies", params={"model": "llama3.1-8b"}).json()["items"]
    assert (item["model"], item["family"]) == ("llama3.1-8b", "llama")
    stored = client.get(f"/api/studies/{item['id']}").json()["spec"]["model"]
    assert "hf_config" not in stored and stored["num_kv_heads"] == 8 and stored["norm"] == "rmsnorm"
    assert client.get("/api/studies", params={"model": "gpt-tiny"}).json()["total"] == 0


def test_oversize_bodies_are_refused(client: TestClient) -> None:
    big = json.dumps({**SPEC, "padding": "x" * (1 << 20)})
    r = client.post("/api/studies", content=big, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks():  # no Content-Length: the limit holds while streaming
        for _ in range(20):
            yield b" " * 100_000

    r = client.post("/api/studies", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413


def test_unknown_ids_are_404(client: TestClient) -> None:
    for method, path in [("GET", "/api/studies/999"), ("GET", "/api/studies/999/trials"),
                         ("GET", "/api/studies/999/trials.csv"), ("POST", "/api/studies/999/cancel"),
                         ("DELETE", "/api/studies/999"), ("GET", "/api/studies/999/export?format=sbatch")]:  # fmt: skip
        r = client.request(method, path, headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path)
    assert client.get("/api/studies/abc").status_code == 422
    assert client.get(f"/api/studies/{2**70}").status_code == 422  # beyond any database integer
    assert client.delete(f"/api/studies/{2**63}", headers=AUTH).json()["error"]["code"] == "invalid_request"


def test_writes_need_the_token(client: TestClient, settings: Settings) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        r = client.post("/api/studies", json=SPEC, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert client.get("/api/studies").json()["total"] == 0
    assert client.post("/api/studies/1/cancel").status_code == 401
    assert client.delete("/api/studies/1").status_code == 401
    assert client.get("/api/studies").status_code == 200  # reads open by default


def test_read_auth_and_a_file_of_hashed_tokens(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# users\nalice:{hashlib.sha256(b'alice-token').hexdigest()}\n"
                      f"bob:{hashlib.sha256(b'bob-token').hexdigest()}\n")  # fmt: skip
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'a.db'}", work_dir=tmp_path, api_tokens_file=tokens,
                        read_auth=True)  # fmt: skip
    client = TestClient(create_app(settings))
    assert client.get("/api/studies").status_code == 401
    assert client.get("/api/studies", headers={"Authorization": "Bearer bob-token"}).status_code == 200
    r = client.post("/api/studies", json=SPEC, headers={"Authorization": "Bearer alice-token"})
    assert r.status_code == 201
    assert client.get("/healthz").status_code == 200  # the health check stays open


def test_no_token_configured_refuses_writes(tmp_path: Path) -> None:
    client = TestClient(
        create_app(Settings(database_url=f"sqlite:///{tmp_path / 'a.db'}", work_dir=tmp_path))
    )
    r = client.post("/api/studies", json=SPEC)
    assert r.status_code == 503 and r.json()["error"]["code"] == "auth_not_configured"


def test_cors_is_off_unless_configured(client: TestClient, tmp_path: Path) -> None:
    r = client.get("/api/studies", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    on = TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}", work_dir=tmp_path,
                                        cors_origins=("https://ok.example",))))  # fmt: skip
    r = on.get("/api/studies", headers={"Origin": "https://ok.example"})
    assert r.headers["access-control-allow-origin"] == "https://ok.example"


def test_hostile_names_are_stored_as_data(client: TestClient) -> None:
    name = "../../etc/passwd; $(rm -rf ~) `id` \"q\" 'x' <script>"
    created = _submit(client, {**SPEC, "name": name})
    assert client.get(f"/api/studies/{created['id']}").json()["name"] == name
    assert client.get("/api/studies").json()["items"][0]["name"] == name


def test_spec_parse_error_matches_cli_validation() -> None:
    with pytest.raises(ValueError, match="num_gpus"):
        parse_spec({**SPEC, "num_gpus": "two"})
    assert yaml.safe_load((STUDIES / "tiny-cpu.yaml").read_text())["name"] == "tiny-cpu"


def test_one_vocabulary_for_studies_and_trials_and_the_older_words_still_filter(
    client: TestClient, settings: Settings
) -> None:
    """Studies and trials speak the same lower-case words (docs/api.md, "Vocabulary"); a client
    that filters with an older word (a study was "done", trials said "COMPLETE") gets the same rows."""
    study_id = _submit(client, SPEC)["id"]
    _finish_with_trials(settings, study_id)
    for word in ("complete", "done", "COMPLETE", "Done"):
        page = client.get("/api/studies", params={"status": word}).json()
        assert [i["id"] for i in page["items"]] == [study_id], word
        assert page["items"][0]["status"] == "complete"
    r = client.get("/api/studies", params={"status": "finished"})
    (problem,) = r.json()["error"]["detail"]
    assert r.status_code == 422 and problem["field"] == "query.status"
    assert (
        "'finished' is not one of pending, running, cancelling, complete, failed, cancelled"
        in problem["message"]
    )
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    assert schema["StudySummary"]["properties"]["status"]["enum"] == [
        "pending", "running", "cancelling", "complete", "failed", "cancelled",
    ]  # fmt: skip
    assert schema["TrialOut"]["properties"]["state"]["enum"] == [
        "waiting", "submitting", "running", "complete", "pruned", "failed",
    ]  # fmt: skip


def test_a_trial_pruned_while_running_is_a_measurement_not_a_failure(
    client: TestClient, settings: Settings
) -> None:
    study_id = _submit(client, SPEC)["id"]
    slow = Outcome(ok=True, tokens_per_s=400.0, mfu=0.05, step_time_s=0.6, peak_memory_bytes=9000,
                   tflops_per_device=0.005, pruned=True, message="pruned while running: 400 tokens/s < floor 900")  # fmt: skip
    with connect(settings.database_url).begin() as s:
        record_trial(s, store.study_by_id(s, study_id), ParallelConfig(tp=2, micro_batch_size=8), slow)
    (trial,) = client.get(f"/api/studies/{study_id}/trials").json()["items"]
    assert (trial["state"], trial["failure_kind"], trial["failure_message"], trial["told"]) == (
        "pruned", None, None, "score",
    )  # fmt: skip
    assert trial["stop_reason"].startswith("pruned while running") and trial["tokens_per_s"] == 400.0
    csv = client.get(f"/api/studies/{study_id}/trials.csv").text.splitlines()
    row = dict(zip(csv[0].split(","), csv[1].split(","), strict=False))
    assert (row["state"], row["failure_kind"], row["stop_reason"][:20]) == (
        "pruned",
        "",
        "pruned while running",
    )


def test_a_cached_read_is_never_stale_after_a_write(client: TestClient, settings: Settings) -> None:
    """/api/best, polling and the study detail answer from what they kept while nothing was written
    (api/reads.py, tuner/views.py), and the next request after a trial finishes, a study changes
    or one is deleted sees it."""
    study_id = _submit(client, SPEC)["id"]
    _finish_with_trials(settings, study_id)
    reads = client.app.state.reads
    sessions = connect(settings.database_url)
    poll = f"/api/studies/{study_id}/trials?after=2"
    first = (
        client.get("/api/best").json(),
        client.get(poll).json(),
        client.get(f"/api/studies/{study_id}").json(),
    )
    hits = reads.hits
    assert (client.get("/api/best").json(), client.get(poll).json()) == first[:2] and reads.hits == hits + 2
    # A trial finishes: faster than the best, after the last number polled.
    fast = Outcome(
        ok=True, tokens_per_s=5000.0, mfu=0.5, step_time_s=0.1, peak_memory_bytes=9000, tflops_per_device=0.05
    )
    with sessions.begin() as s:
        record_trial(
            s,
            store.study_by_id(s, study_id),
            ParallelConfig(dp_replicate=2, micro_batch_size=1, num_microbatches=4),
            fast,
        )
    (best,) = client.get("/api/best").json()
    assert best["tokens_per_s"] == 5000.0 and best["payoff"]["best_tokens_per_s"] == 5000.0
    assert [t["number"] for t in client.get(poll).json()["items"]] == [3]
    detail = client.get(f"/api/studies/{study_id}").json()
    assert detail["best"]["number"] == 3 and detail["progress"]["by_state"] == {"complete": 3, "failed": 1}
    # The study changes: deleted, its best goes with it.
    assert client.delete(f"/api/studies/{study_id}", headers=AUTH).status_code == 204
    assert client.get("/api/best").json() == [] and client.get(poll).status_code == 404


def test_plan_with_an_export_matches_the_cli_and_names_a_bad_format(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    r = client.post("/api/plan", json={"spec": SPEC, "top": 2, "export": "megatron"})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["export"]["format"] == "megatron" and "--tensor-model-parallel-size" in doc["export"]["text"]
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    cli = subprocess.run([TUNER, "plan", "--spec", str(path), "--top", "2", "--json", "--export", "megatron"],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "TUNER_DATABASE_URL": settings.database_url})  # fmt: skip
    assert json.loads(cli.stdout) == doc
    bad = client.post("/api/plan", json={"spec": SPEC, "export": "nemo"})
    assert bad.status_code == 422 and bad.json()["error"]["detail"][0]["field"] == "body.export"
