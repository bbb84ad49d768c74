"""The dashboard tests' machinery: `tuner serve` in a subprocess, a browser tab that collects
console errors, and trials written to the database the way a worker writes them (made-up but
plausible figures for gpt-1.3b on 8 x A100-80GB; test_real_study.py measures its own)."""

from __future__ import annotations

import math
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy import insert, select

from tests import records
from tests.records import record_trial
from trainer.contract.parallel import ParallelConfig
from tuner import store
from tuner.db import Study, Trial, connect, utcnow
from tuner.outcome import FailureKind, Outcome, StudyStatus, TrialState
from tuner.space import SearchSpace
from tuner.spec import parse_spec

TUNER = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"
CHROMIUM = "/usr/bin/chromium"
TOKEN = "dashboard-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SPEC = {"model": "gpt-1.3b", "cluster": "a100-80gb", "num_gpus": 8, "training": {"global_batch_size": 256},
        "space": {"tp": [1, 2, 4, 8], "pp": [1, 2], "micro_batch_size": [1, 2, 4, 8], "zero_stage": [0, 2, 3],
                  "activation_checkpoint": ["none", "selective", "full"], "sequence_parallel": [False]},
        "budget": {"max_trials": 60}}  # fmt: skip
FAILURES = {  # made-up messages, in the trainer's words
    FailureKind.OOM: "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (rank 3, step 2)",
    FailureKind.CRASH: "rank 5 exited with code 1: RuntimeError: NCCL communicator was aborted",
    FailureKind.TIMEOUT: "timed out after 600 s (the trial's timeout_s)",
}
CHARTS = ("history", "memory", "parcoords", "predicted", "failures")
WAIT_MS = 15_000


@dataclass
class Server:
    base: str
    database_url: str
    http: httpx.Client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(tmp: Path, read_auth: bool, worker: bool = False) -> Iterator[Server]:
    """`tuner serve` on a free port over a fresh SQLite file; with `worker`, its embedded trial
    worker runs the studies submitted (real trials, local processes)."""
    port = free_port()
    url = f"sqlite:///{tmp / 'db.sqlite'}"
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("TUNER_") or k == "TUNER_CACHE_DIR"}
    env = {**inherited, "TUNER_DATABASE_URL": url, "TUNER_API_TOKEN": TOKEN, "TUNER_WORK_DIR": str(tmp / "runs"),
           "TUNER_READ_AUTH": "1" if read_auth else "0"}  # fmt: skip
    log = (tmp / "server.log").open("w")
    proc = subprocess.Popen([TUNER, "serve", *([] if worker else ["--no-worker"]), "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=30, headers=AUTH) as http:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if http.get("/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, (tmp / "server.log").read_text()
                time.sleep(0.2)
            yield Server(base, url, http)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


class Tab:
    """A fresh browser context (its own sessionStorage) at 1280x800, collecting console errors."""

    def __init__(self, browser, base: str, shots: Path):
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.page = self.context.new_page()
        self.base, self.shots, self.errors = base, shots, []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(f"console: {m.text}"))
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.set_default_timeout(WAIT_MS)

    def open(self, route: str) -> None:
        self.page.goto(f"{self.base}/{route}")
        self.page.wait_for_selector("#view[data-loaded]")

    def charts(self) -> dict[str, int]:
        for name in CHARTS:  # parallel coordinates are drawn once scrolled to
            self.page.locator(f'[data-chart="{name}"]').scroll_into_view_if_needed()
            self.page.wait_for_selector(f'[data-chart="{name}"][data-points]')
        return {
            name: int(self.page.get_attribute(f'[data-chart="{name}"]', "data-points")) for name in CHARTS
        }

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path))
        return path


def submit(server: Server, name: str, **changes) -> int:
    r = server.http.post("/api/studies", json={**SPEC, "name": name, **changes})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def valid_layouts(name: str) -> list[ParallelConfig]:
    return SearchSpace.from_spec(parse_spec({**SPEC, "name": name})).enumerate().valid


def figures(c: ParallelConfig, rng: random.Random) -> tuple[Outcome, dict]:
    """Made-up but plausible figures for gpt-1.3b on 8 x A100-80GB: big micro-batches and no
    recomputation are faster and bigger; too big runs out of memory."""
    ac = {"none": (1.0, 1.0), "selective": (0.95, 0.55), "full": (0.78, 0.3)}[c.activation_checkpoint]
    memory_gb = (
        9 + 26 / (c.tp * c.pp) * (1 - 0.2 * (c.zero_stage > 0)) + 20 * c.micro_batch_size * ac[1] / c.tp
    )
    tokens_per_s = (
        8 * 15_000 * ac[0] * (1 - 0.07 * math.log2(c.tp)) * (1 - 0.25 * (c.pp - 1) / c.num_microbatches)
    )
    tokens_per_s *= (0.8 + 0.06 * math.log2(c.micro_batch_size)) * rng.uniform(0.95, 1.05)
    predicted = {
        "tokens_per_s": tokens_per_s * math.exp(rng.gauss(0, 0.12)),
        "memory_bytes": memory_gb * 1e9 * 0.95,
    }
    if memory_gb > 80 or rng.random() < 0.05:
        kind = FailureKind.OOM if memory_gb > 80 else rng.choice([FailureKind.CRASH, FailureKind.TIMEOUT])
        return Outcome.failed(kind, FAILURES[kind]), predicted
    mfu = tokens_per_s * 6 * 1.3e9 / (8 * 312e12)
    return Outcome(ok=True, tokens_per_s=tokens_per_s, tflops_per_device=mfu * 312, mfu=mfu,
                   peak_memory_bytes=int(memory_gb * 1e9), step_time_s=256 * 2048 / tokens_per_s), predicted  # fmt: skip


def add_trials(
    server: Server, study_id: int, num_trials: int, seed: int = 0, finish: bool = True
) -> list[int]:
    """Trials as the study loop stores them: added WAITING, started, then finished."""
    rng = random.Random(seed)
    sessions = connect(server.database_url)
    numbers = []
    with sessions.begin() as s:
        study = s.get(Study, study_id)
        taken = {t.layout_key for t in store.trials(s, study)}
        layouts = [c for c in valid_layouts(study.name) if store.layout_key(c) not in taken]
        for c in rng.sample(layouts, num_trials):
            outcome, predicted = figures(c, rng)
            t = record_trial(s, study, c, outcome if finish else None, predicted)
            numbers.append(t.number)
    return numbers


def set_status(server: Server, study_id: int, status: StudyStatus) -> None:
    with connect(server.database_url).begin() as s:
        if status is StudyStatus.RUNNING:
            records.hold(s, study_id)
        else:
            records.finish(s, study_id, status)


def counts(server: Server, study_id: int) -> dict[str, int]:
    """What each chart should draw, from the database."""
    with connect(server.database_url)() as s:
        rows = s.scalars(select(Trial).where(Trial.study_id == study_id)).all()
    done = [t for t in rows if t.state is TrialState.COMPLETE and t.tokens_per_s is not None]
    failed = [t for t in rows if t.state.is_finished() and t.failure_kind is not None]
    return {"history": len(done), "memory": sum(t.peak_memory_bytes is not None for t in done),
            "parcoords": len(done), "predicted": sum(t.predicted_tokens_per_s is not None for t in done),
            "failures": len({t.failure_kind for t in failed}), "num_failed": len(failed), "total": len(rows),
            "stopped": sum(store.pruned_while_running(t) for t in rows)}  # fmt: skip


def add_stopped_trial(server: Server, study_id: int) -> int:
    """A trial the trainer stopped early as too slow: PRUNED with its partial measurement."""
    with connect(server.database_url).begin() as s:
        study = s.get(Study, study_id)
        taken = {t.layout_key for t in store.trials(s, study)}
        c = next(c for c in valid_layouts(study.name) if store.layout_key(c) not in taken)
        slow = Outcome(ok=True, tokens_per_s=1000.0, tflops_per_device=1.0, mfu=0.003, peak_memory_bytes=20 * 10**9,
                       step_time_s=524.0, pruned=True,
                       message="pruned while running: 1,000 tokens/s < floor 90,000 tokens/s after 3 steps")  # fmt: skip
        return record_trial(s, study, c, slow, {"tokens_per_s": 9e4, "memory_bytes": 2e10}).number


def bulk_trials(server: Server, study_id: int, num_trials: int) -> None:
    """Many trials at once (bulk insert, as bench/api_speed.py): 80 % complete, the rest failed."""
    rng = random.Random(7)
    with connect(server.database_url).begin() as s:
        study = s.get(Study, study_id)
        layouts, now, rows = valid_layouts(study.name), utcnow(), []
        for number in range(num_trials):
            c = layouts[number % len(layouts)]
            outcome, predicted = figures(c, rng)
            ok = outcome.ok and rng.random() < 0.85
            rows.append({
                "study_id": study_id, "number": number, "state": TrialState.COMPLETE if ok else TrialState.FAIL,
                "layout_key": f"bulk-{number}", "config": c.to_dict(), **store.axis_columns(c), "predicted": predicted,
                "predicted_tokens_per_s": predicted["tokens_per_s"], "predicted_memory_bytes": predicted["memory_bytes"],
                "tokens_per_s": outcome.tokens_per_s if ok else None, "tflops_per_device": outcome.tflops_per_device if ok else None,
                "mfu": outcome.mfu if ok else None, "peak_memory_bytes": outcome.peak_memory_bytes if ok else None,
                "failure_kind": None if ok else (outcome.failure or FailureKind.CRASH).value,
                "failure_message": None if ok else outcome.message or "crash", "job_id": f"fake:{number}@bulk",
                "attempts": 1, "created_at": now, "started_at": now, "finished_at": now,
            })  # fmt: skip
        s.execute(insert(Trial), rows)
        store.rebuild_bests(s)  # bulk inserts bypass end_attempt, which keeps study_bests
        records.finish(s, study_id)
