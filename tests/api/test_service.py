"""The service for real: `tuner serve` (uvicorn, 127.0.0.1) in a subprocess with its embedded
worker running real trials; two `tuner worker`s sharing a real PostgreSQL; schemathesis."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tuner import store
from tuner.db import connect

TUNER = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"
TOKEN = "e2e-token"
TINY = {
    "model": "gpt-tiny", "cluster": "cpu-local", "num_gpus": 1,
    "training": {"global_batch_size": 8, "precision": "fp32"},
    "space": {"tp": [1], "pp": [1], "micro_batch_size": [2, 4, 8], "zero_stage": [0],
              "activation_checkpoint": ["none", "full"], "sequence_parallel": [False]},
    "trial": {"warmup_steps": 1, "measure_steps": 2, "timeout_s": 60, "device": "cpu"},
    "budget": {"max_trials": 3}, "sampler": "model",
}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if value := predicate():
                return value
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not happen within {timeout_s} s")


@pytest.mark.distributed
def test_submit_over_http_worker_runs_it_best_matches_database(tmp_path: Path) -> None:
    port = _free_port()
    db = f"sqlite:///{tmp_path / 'serve.db'}"
    env = {
        **os.environ,
        "TUNER_DATABASE_URL": db,
        "TUNER_WORK_DIR": str(tmp_path / "runs"),
        "TUNER_API_TOKEN": TOKEN,
    }
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen([TUNER, "serve", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            _wait(lambda: httpx.get(f"{url}/healthz").status_code == 200, 60, "the server answering")
        except TimeoutError as e:
            raise AssertionError(f"{e}; its log:\n{(tmp_path / 'serve.log').read_text()[-4000:]}") from None
        body = yaml.safe_dump({**TINY, "name": "e2e"})
        r = httpx.post(f"{url}/api/studies", content=body,
                       headers={"Content-Type": "application/yaml", "Authorization": f"Bearer {TOKEN}"})  # fmt: skip
        assert r.status_code == 201, r.text
        study_id = r.json()["id"]
        _wait(
            lambda: httpx.get(f"{url}/api/studies/{study_id}").json()["status"] == "complete",
            300,
            "the study done",
        )
        best = httpx.get(f"{url}/api/best", params={"model": "gpt-tiny"}).json()
        with connect(db)() as s:
            study = store.get_study(s, study_id)
            top = store.best_trial(s, study)
            assert len(store.trials(s, study)) == 3
            assert (best[0]["trial_number"], best[0]["config"], best[0]["tokens_per_s"]) == (
                top.number, top.config, top.tokens_per_s)  # fmt: skip
        cli = subprocess.run([TUNER, "best", "--model", "gpt-tiny", "--url", url, "--json"], capture_output=True,
                             text=True, env={**os.environ, "TUNER_DATABASE_URL": "sqlite:////nonexistent/x.db"})  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout) == best
        direct = subprocess.run([TUNER, "best", "--model", "gpt-tiny", "--json"], capture_output=True, text=True,
                                env={**os.environ, "TUNER_DATABASE_URL": db})  # fmt: skip
        assert json.loads(direct.stdout) == best  # the same figures from the database
        text = subprocess.run(
            [TUNER, "best", "--model", "gpt-tiny", "--url", url], capture_output=True, text=True
        )
        assert best[0]["layout"] in text.stdout
        # the client's other verbs against the server
        listed = json.loads(subprocess.run([TUNER, "studies", "--url", url, "--json"], capture_output=True,
                                           text=True).stdout)  # fmt: skip
        assert [(r["id"], r["status"], r["progress"]["finished"]) for r in listed] == [
            (study_id, "complete", 3)
        ]

        csv = subprocess.run(
            [TUNER, "trials", str(study_id), "--url", url, "--csv"], capture_output=True, text=True
        )
        assert len(csv.stdout.strip().splitlines()) == 4
        wrong = subprocess.run([TUNER, "cancel", str(study_id), "--url", url, "--token", "nope"], capture_output=True,
                               text=True)  # fmt: skip
        assert wrong.returncode != 0 and "invalid token" in (wrong.stdout + wrong.stderr)
        second = tmp_path / "second.yaml"
        second.write_text(yaml.safe_dump({**TINY, "name": "e2e-2", "budget": {"max_trials": 1}}))
        no_token = {k: v for k, v in os.environ.items() if k != "TUNER_API_TOKEN"}
        refused = subprocess.run([TUNER, "submit", str(second), "--url", url], capture_output=True, text=True,
                                 env=no_token)  # fmt: skip
        assert refused.returncode != 0 and "missing bearer token" in refused.stdout + refused.stderr
        waited = subprocess.run([TUNER, "submit", str(second), "--url", url, "--wait"], capture_output=True,
                                text=True, timeout=300, env={**os.environ, "TUNER_API_TOKEN": TOKEN})  # fmt: skip
        assert waited.returncode == 0 and f"study {study_id + 1}: complete" in waited.stdout, (
            waited.stdout + waited.stderr
        )
        exported = subprocess.run([TUNER, "export", str(study_id), "--format", "megatron", "--url", url],
                                  capture_output=True, text=True)  # fmt: skip
        assert "--micro-batch-size" in exported.stdout
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    assert TOKEN not in (tmp_path / "serve.log").read_text()  # no token in the logs


@pytest.mark.distributed
def test_two_workers_on_postgresql_run_each_study_exactly_once(postgres_url: str, tmp_path: Path) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    engine.dispose()
    sessions = connect(postgres_url)
    from tuner.spec import parse_spec

    with sessions.begin() as s:
        for i in range(4):
            # trials of several seconds, so that a worker that starts a little later still finds one
            trial = {**TINY["trial"], "measure_steps": 30, "stable_rel_ci": None}  # all 30 steps
            store.create_study(s, parse_spec({**TINY, "name": f"shared-{i}", "budget": {"max_trials": 1},
                                              "trial": trial}))  # fmt: skip
    env = {**os.environ, "TUNER_DATABASE_URL": postgres_url, "TUNER_WORK_DIR": str(tmp_path / "runs")}
    workers = [subprocess.Popen([TUNER, "worker", "--exit-when-idle", "--poll-s", "0.2"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]  # fmt: skip
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), outputs
    claimed = [line for out in outputs for line in out.splitlines() if line.startswith("running study")]
    assert sorted(claimed) == sorted(f"running study {i + 1} 'shared-{i}'" for i in range(4))  # each once
    with sessions() as s:
        studies = store.list_studies(s)
        assert [st.status for st in studies] == ["COMPLETE"] * 4
        for st in studies:
            trials = store.trials(s, st)
            assert [(t.state, t.attempts) for t in trials] == [("COMPLETE", 1)]
        workers_seen = {st.lease_owner for st in studies}  # the last holder stays on a finished study
    assert len(workers_seen) == 2, outputs  # both took part


def test_a_worker_started_while_the_database_is_down_waits_for_it(tmp_path: Path) -> None:
    """A database restart must not take workers down (bench/chaos.py found workers that exited
    because PostgreSQL was down as they started)."""
    from tests.postgres import postgres_instance

    with postgres_instance() as pg:
        pg.stop()
        env = {**os.environ, "TUNER_DATABASE_URL": pg.url, "TUNER_WORK_DIR": str(tmp_path)}
        worker = subprocess.Popen([TUNER, "worker", "--exit-when-idle", "--poll-s", "0.2"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        seen = []
        try:
            # Start the database only once the worker has found it down and said it retries (its
            # start-up alone takes seconds on a loaded machine: a fixed sleep raced it).
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not any("retrying" in line for line in seen):
                if select.select([worker.stdout], [], [], 1.0)[0]:
                    line = worker.stdout.readline()
                    if not line:
                        break
                    seen.append(line)
            assert worker.poll() is None, seen  # still waiting, not exited
            pg.start()
            out, _ = worker.communicate(timeout=60)
            out = "".join(seen) + out
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    assert worker.returncode == 0 and "retrying" in out and "cannot reach the database" in out, out
