"""The dashboard in a real browser: `tuner serve --no-worker` (uvicorn) in a subprocess, headless
Chromium driven by Playwright, trials written to the database the way a worker writes them.

Needs Debian's chromium at /usr/bin/chromium (`make system-deps`); Playwright's own browser
download is not used. Screenshots of every page go under each test's tmp dir; with
TUNER_DASHBOARD_SCREENSHOT=docs/dashboard-study.png the study page is also saved there (README).
"""

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
import pytest
from sqlalchemy import func, insert, select

from trainer.config import ParallelConfig
from tuner import store
from tuner.db import Study, Trial, connect, utcnow
from tuner.outcome import FailureKind, Outcome, TrialState
from tuner.space import SearchSpace
from tuner.spec import parse_spec

pytestmark = pytest.mark.browser

TUNER = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"
CHROMIUM = "/usr/bin/chromium"
TOKEN = "dashboard-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SPEC = {"model": "gpt-1.3b", "cluster": "a100-80gb", "num_gpus": 8, "training": {"global_batch_size": 256},
        "space": {"tp": [1, 2, 4, 8], "pp": [1, 2], "micro_batch_size": [1, 2, 4, 8], "zero_stage": [0, 2, 3],
                  "activation_checkpoint": ["none", "selective", "full"], "sequence_parallel": [False]},
        "budget": {"max_trials": 60}}  # fmt: skip
CHARTS = ("history", "memory", "parcoords", "predicted", "failures")
WAIT_MS = 15_000


@dataclass
class Server:
    base: str
    database_url: str
    http: httpx.Client


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serve(tmp: Path, read_auth: bool) -> Iterator[Server]:
    port = _free_port()
    url = f"sqlite:///{tmp / 'db.sqlite'}"
    env = {**os.environ, "TUNER_DATABASE_URL": url, "TUNER_API_TOKEN": TOKEN, "TUNER_WORK_DIR": str(tmp / "runs"),
           "TUNER_READ_AUTH": "1" if read_auth else "0"}  # fmt: skip
    log = (tmp / "server.log").open("w")
    proc = subprocess.Popen([TUNER, "serve", "--no-worker", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
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


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with _serve(tmp_path_factory.mktemp("serve"), read_auth=False) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} missing: make system-deps (apt-get install chromium)"
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])  # fmt: skip
        yield browser
        browser.close()


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


@pytest.fixture
def tab(browser, server: Server, tmp_path: Path) -> Iterator[Tab]:
    t = Tab(browser, server.base, tmp_path)
    yield t
    t.context.close()


# --- trials as a worker stores them ----------------------------------------------------------


def _submit(server: Server, name: str, **changes) -> int:
    r = server.http.post("/api/studies", json={**SPEC, "name": name, **changes})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _layouts(name: str) -> list[ParallelConfig]:
    return SearchSpace.from_spec(parse_spec({**SPEC, "name": name})).enumerate().valid


def _figures(c: ParallelConfig, rng: random.Random) -> tuple[Outcome, dict]:
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
        return Outcome.failed(
            kind, f"{kind.value}: rank 3 at step 2\nCUDA out of memory (made up)"
        ), predicted
    mfu = tokens_per_s * 6 * 1.3e9 / (8 * 312e12)
    return Outcome(ok=True, tokens_per_s=tokens_per_s, tflops_per_device=mfu * 312, mfu=mfu,
                   peak_memory_bytes=int(memory_gb * 1e9), step_time_s=256 * 2048 / tokens_per_s), predicted  # fmt: skip


def _add_trials(
    server: Server, study_id: int, num_trials: int, seed: int = 0, finish: bool = True
) -> list[int]:
    """Trials as the study loop stores them: added WAITING, started, then finished."""
    rng = random.Random(seed)
    sessions = connect(server.database_url)
    numbers = []
    with sessions.begin() as s:
        study = s.get(Study, study_id)
        taken = {t.layout_key for t in store.trials(s, study)}
        layouts = [c for c in _layouts(study.name) if store.layout_key(c) not in taken]
        for c in rng.sample(layouts, num_trials):
            outcome, predicted = _figures(c, rng)
            t = store.add_trial(s, study, c, predicted, TrialState.WAITING)
            store.start_trial(t, f"{4000 + t.number}@runs/{study.name}/{t.number}", f"runs/{t.number}/log")
            s.flush()
            if finish:
                store.finish_trial(t, outcome)
            numbers.append(t.number)
    return numbers


def _set_status(server: Server, study_id: int, status: str) -> None:
    with connect(server.database_url).begin() as s:
        study = s.get(Study, study_id)
        if status == "RUNNING":
            store.claim_study(s, study)
        else:
            store.finish_study(s, study, status)


def _counts(server: Server, study_id: int) -> dict[str, int]:
    """What each chart should draw, from the database."""
    with connect(server.database_url)() as s:
        rows = s.scalars(select(Trial).where(Trial.study_id == study_id)).all()
    done = [t for t in rows if t.state == "COMPLETE" and t.tokens_per_s is not None]
    failed = [t for t in rows if t.state in ("FAIL", "PRUNED")]
    return {"history": len(done), "memory": sum(t.peak_memory_bytes is not None for t in done),
            "parcoords": len(done), "predicted": sum(t.predicted_tokens_per_s is not None for t in done),
            "failures": len({t.failure_kind for t in failed}), "num_failed": len(failed), "total": len(rows)}  # fmt: skip


@pytest.fixture(scope="module")
def studies(server: Server) -> dict[str, int]:
    """A finished 1.3B study with 45 trials, a running one, a pending one, and a 350M study."""
    ids = {"done": _submit(server, "gpt-1.3b on 8 x A100 <b>")}
    _add_trials(server, ids["done"], 45)
    _set_status(server, ids["done"], "COMPLETE")
    ids["running"] = _submit(server, "running-1.3b")
    _add_trials(server, ids["running"], 6, seed=1)
    _set_status(server, ids["running"], "RUNNING")
    ids["pending"] = _submit(server, "pending-1.3b", sampler="random")
    ids["small"] = _submit(server, "gpt-350m", model="gpt-350m")
    _add_trials(server, ids["small"], 10, seed=2)
    _set_status(server, ids["small"], "COMPLETE")
    return ids


# --- tests -----------------------------------------------------------------------------------


def test_studies_list_shows_progress_best_and_filters(
    tab: Tab, server: Server, studies: dict[str, int]
) -> None:
    tab.open("")
    page = tab.page
    listed = server.http.get("/api/studies").json()["items"]
    rows = page.locator("table.studies tbody tr")
    assert rows.count() == len(listed)
    done = next(s for s in listed if s["id"] == studies["done"])
    row = page.locator(f'table.studies tr[data-id="{studies["done"]}"]')
    text = row.inner_text()
    assert done["name"] in text and "gpt-1.3b" in text and "a100-80gb" in text and "done" in text
    assert f"{done['progress']['finished']} / 60" in text and f"{round(done['best_tokens_per_s']):,}" in text
    assert row.locator("a").inner_text() == "gpt-1.3b on 8 x A100 <b>"  # names are text, not HTML
    tab.shot("studies")
    page.select_option('select[aria-label="state"]', "running")
    page.wait_for_function("location.hash.includes('status=running')")
    page.wait_for_selector("#view[data-loaded]")
    assert [r.get_attribute("data-id") for r in page.locator("table.studies tbody tr").all()] == [
        str(studies["running"])
    ]
    page.fill('input[aria-label="model"]', "gpt-350m")
    page.press('input[aria-label="model"]', "Enter")
    page.wait_for_selector("#view[data-loaded] table.studies td.muted")  # running and gpt-350m: none
    page.select_option('select[aria-label="state"]', "")
    page.wait_for_selector(f'table.studies tr[data-id="{studies["small"]}"]')
    assert page.locator("table.studies tbody tr").count() == 1
    page.click(f'table.studies tr[data-id="{studies["small"]}"] a')
    page.wait_for_selector('[data-chart="history"][data-points]')
    assert page.evaluate("location.hash") == f"#/study/{studies['small']}"
    assert tab.errors == []


def test_study_page_charts_table_detail_and_export(tab: Tab, server: Server, studies: dict[str, int]) -> None:
    study_id = studies["done"]
    tab.open(f"#/study/{study_id}")
    page = tab.page
    expected = _counts(server, study_id)
    drawn = tab.charts()
    assert drawn == {k: expected[k] for k in CHARTS}
    assert all(drawn[k] > 0 for k in CHARTS)
    assert page.get_attribute('[data-chart="failures"]', "data-failures") == str(expected["num_failed"])
    # plotly drew the marks: one SVG point per completed trial in the history chart
    assert (
        page.locator('[data-chart="history"] .scatterlayer .trace:first-child .point').count()
        == expected["history"]
    )
    tab.shot("study")
    if target := os.environ.get("TUNER_DASHBOARD_SCREENSHOT"):
        shutil.copy(tab.shots / "study.png", target)

    rows = page.locator("table.trials tbody tr")
    assert rows.count() == expected["total"]
    assert "of 45 trials" in page.inner_text(".page-info")
    # Sort by tokens/s, fastest first: the study's best on top.
    best = server.http.get(f"/api/studies/{study_id}").json()["best"]
    page.click('table.trials th[data-key="tokens_per_s"]')
    page.click('table.trials th[data-key="tokens_per_s"]')
    assert rows.first.get_attribute("data-number") == str(best["number"])
    # Filter: only the OOM trials.
    page.fill('input[aria-label="filter trials"]', "oom")
    with connect(server.database_url)() as s:
        num_oom = s.scalar(
            select(func.count()).where(Trial.study_id == study_id, Trial.failure_kind == "oom")
        )
    page.wait_for_function(f"document.querySelectorAll('table.trials tbody tr').length === {num_oom}")
    # A failed trial's detail: its message, job id, config and JSON.
    failed = rows.first
    number = failed.get_attribute("data-number")
    failed.click()
    detail = page.locator("aside.detail")
    detail.wait_for(state="visible")
    text = detail.inner_text()
    assert f"Trial #{number}" in text and "out of memory" in text and f"{4000 + int(number)}@runs/" in text
    assert '"failure_kind": "oom"' in text and "micro_batch_size" in text
    tab.shot("study-detail")
    page.click("aside.detail .close")
    # Export the best layout: what the API returns, in a <pre>, with a copy button.
    page.click('button[data-format="megatron"]')
    page.wait_for_selector('.export[data-format="megatron"] pre')
    exported = server.http.get(f"/api/studies/{study_id}/export", params={"format": "megatron"}).text
    assert page.inner_text(".export pre").strip() == exported.strip()
    page.click('button[data-format="torchtitan"]')
    page.wait_for_selector('.export[data-format="torchtitan"] pre')
    page.click(".export button:has-text('copy')")
    page.wait_for_function("document.querySelector('.export button').textContent !== 'copy'")
    tab.shot("study-export")
    assert tab.errors == []


def test_new_trials_appear_live_and_cancel_needs_the_token(
    tab: Tab, server: Server, studies: dict[str, int]
) -> None:
    study_id = _submit(server, "live-1.3b")
    _add_trials(server, study_id, 4, seed=3)
    _set_status(server, study_id, "RUNNING")
    tab.open(f"#/study/{study_id}")
    page = tab.page
    before = tab.charts()
    page.evaluate("window.notReloaded = true")
    # A worker stores more trials: one still running, then finished; the page follows without reload.
    _add_trials(server, study_id, 3, seed=4)
    [running] = _add_trials(server, study_id, 1, seed=5, finish=False)
    t0 = time.monotonic()
    page.wait_for_function(
        "document.querySelector('.page-info').textContent.includes('of 8 trials')", timeout=5000
    )
    print(f"new trials shown after {time.monotonic() - t0:.1f} s")
    assert page.locator(f'table.trials tr[data-number="{running}"] td').nth(1).inner_text() == "RUNNING"
    with connect(server.database_url).begin() as s:
        trial = s.scalars(select(Trial).where(Trial.study_id == study_id, Trial.number == running)).one()
        store.finish_trial(trial, Outcome(ok=True, tokens_per_s=1.5e5, tflops_per_device=150, mfu=0.5,
                                          peak_memory_bytes=30 * 10**9, step_time_s=3.5))  # fmt: skip
    page.wait_for_function(f"""document.querySelector('table.trials tr[data-number="{running}"] td:nth-child(2)')
                               .textContent === 'COMPLETE'""", timeout=5000)  # fmt: skip
    expected = _counts(server, study_id)
    page.wait_for_function(
        f"""document.querySelector('[data-chart="history"]').dataset.points === '{expected["history"]}'"""
    )
    assert tab.charts() == {k: expected[k] for k in CHARTS} and tab.charts()["history"] > before["history"]
    assert "150,000" in page.inner_text(".study-head")  # the new best, in the refreshed header
    assert page.evaluate("window.notReloaded") is True
    # Cancel is a write: without a token the page asks for it, then cancels.
    page.click("button:has-text('Cancel study')")
    page.wait_for_selector("#token-form:not([hidden])")
    page.fill("#token-input", TOKEN)
    page.click("#token-form button[type=submit]")
    page.click("button:has-text('Cancel study')")
    page.click("button:has-text('Really cancel')")
    page.wait_for_selector(".study-head .badge.cancelled")
    assert server.http.get(f"/api/studies/{study_id}").json()["status"] == "cancelled"
    assert page.evaluate("sessionStorage.getItem('tuner.token')") == TOKEN
    assert page.evaluate("localStorage.length") == 0
    tab.shot("study-cancelled")
    assert tab.errors == []


def test_best_per_model_size(tab: Tab, server: Server, studies: dict[str, int]) -> None:
    tab.open("#/best")
    page = tab.page
    best = server.http.get("/api/best").json()
    page.wait_for_selector('[data-chart="best"][data-points]')
    assert int(page.get_attribute('[data-chart="best"]', "data-points")) == len(best) >= 2
    assert page.locator("table.best tbody tr").count() == len(best)
    first = page.locator("table.best tbody tr").first.inner_text()  # smallest model first
    small = min(best, key=lambda b: b["num_params"])
    assert small["model"] in first and f"{round(small['tokens_per_s'] / small['gpus']):,}" in first
    tab.shot("best")
    assert tab.errors == []


def test_reads_behind_a_token(browser, tmp_path: Path) -> None:
    with _serve(tmp_path, read_auth=True) as server:
        study_id = _submit(server, "secret-study")
        assert httpx.get(f"{server.base}/api/studies").status_code == 401
        tab = Tab(browser, server.base, tmp_path)
        page = tab.page
        sent = []
        page.on("request", lambda r: "/api/" in r.url and sent.append(r.headers.get("authorization")))
        page.goto(f"{server.base}/")
        page.wait_for_selector("#token-form:not([hidden])")
        assert "needs a token" in page.inner_text("#token-form") and sent == []  # asked, not refused
        tab.shot("token")
        page.fill("#token-input", "wrong")
        page.click("#token-form button[type=submit]")
        page.wait_for_function("document.querySelector('#token-reason').textContent.includes('refused')")
        assert [e for e in tab.errors if "401" not in e] == []  # the refused token's 401, nothing else
        tab.errors.clear()
        page.fill("#token-input", TOKEN)
        page.click("#token-form button[type=submit]")
        page.wait_for_selector(f'table.studies tr[data-id="{study_id}"]')
        page.click(f'table.studies tr[data-id="{study_id}"] a')
        page.wait_for_selector('[data-chart="history"][data-points="0"]')
        assert sent and set(sent[sent.index(f"Bearer {TOKEN}") :]) == {f"Bearer {TOKEN}"}
        tab.shot("token-accepted")
        assert tab.errors == []
        tab.context.close()


def _bulk_trials(server: Server, study_id: int, num_trials: int) -> None:
    """Many trials at once (bulk insert, as bench/api_speed.py): 80 % complete, the rest failed."""
    rng = random.Random(7)
    with connect(server.database_url).begin() as s:
        study = s.get(Study, study_id)
        layouts, now, rows = _layouts(study.name), utcnow(), []
        for number in range(num_trials):
            c = layouts[number % len(layouts)]
            outcome, predicted = _figures(c, rng)
            ok = outcome.ok and rng.random() < 0.85
            rows.append({
                "study_id": study_id, "number": number, "state": "COMPLETE" if ok else "FAIL",
                "layout_key": f"bulk-{number}", "config": c.to_dict(), "tp": c.tp, "pp": c.pp, "dp": c.dp,
                "micro_batch_size": c.micro_batch_size, "num_microbatches": c.num_microbatches,
                "zero_stage": c.zero_stage, "activation_checkpoint": c.activation_checkpoint,
                "sequence_parallel": c.sequence_parallel, "pp_schedule": c.pp_schedule,
                "virtual_stages": c.virtual_stages, "predicted": predicted,
                "predicted_tokens_per_s": predicted["tokens_per_s"], "predicted_memory_bytes": predicted["memory_bytes"],
                "tokens_per_s": outcome.tokens_per_s if ok else None, "tflops_per_device": outcome.tflops_per_device if ok else None,
                "mfu": outcome.mfu if ok else None, "peak_memory_bytes": outcome.peak_memory_bytes if ok else None,
                "failure_kind": None if ok else (outcome.failure or FailureKind.CRASH).value,
                "failure_message": None if ok else outcome.message or "crash", "job_id": f"{number}@bulk",
                "attempts": 1, "created_at": now, "started_at": now, "finished_at": now,
            })  # fmt: skip
        s.execute(insert(Trial), rows)
        store.rebuild_bests(s)  # bulk inserts bypass finish_trial, which keeps study_bests
        store.finish_study(s, study, "COMPLETE")


def test_5000_trials_time_to_first_chart(tab: Tab, server: Server) -> None:
    study_id = _submit(server, "big-1.3b", budget={"max_trials": 5000})
    _bulk_trials(server, study_id, 5000)
    expected = _counts(server, study_id)
    page = tab.page
    marks = (
        "Object.fromEntries(performance.getEntriesByType('mark').map((m) => [m.name, m.startTime / 1000]))"
    )
    timings = {}
    for cache in ("cold", "warm"):  # a fresh browser context, then a reload (plotly.js cached)
        t0 = time.perf_counter()
        if cache == "cold":
            page.goto(f"{server.base}/#/study/{study_id}", wait_until="commit")
        else:
            page.reload(wait_until="commit")
        page.wait_for_selector('[data-chart="history"][data-points]')
        first_s = time.perf_counter() - t0
        page.wait_for_selector('[data-chart="failures"][data-points]')
        four_s = time.perf_counter() - t0
        page.locator('[data-chart="parcoords"]').scroll_into_view_if_needed()
        page.wait_for_selector('[data-chart="parcoords"][data-points]')
        timings[cache] = (first_s, four_s, time.perf_counter() - t0, page.evaluate(marks))
    for cache, (first_s, four_s, all_s, mark) in timings.items():
        print(f"5000 trials, {cache}: first chart {first_s:.2f} s after page.goto (performance.now(): trials "
              f"loaded {mark['tuner:trials-loaded']:.2f} s, first chart {mark['tuner:history']:.2f} s); "
              f"four charts {four_s:.2f} s; parallel coordinates, scrolled to, {all_s:.2f} s")  # fmt: skip
    drawn = tab.charts()
    assert drawn == {k: expected[k] for k in CHARTS}
    assert "page 1 of 50" in page.inner_text(".page-info")
    t0 = time.perf_counter()
    page.click('table.trials th[data-key="mfu"]')
    page.click("button[aria-label='last page']")
    page.wait_for_selector("text=page 50 of 50")
    print(f"sort 5000 by MFU and go to the last page: {time.perf_counter() - t0:.2f} s")
    assert page.locator("table.trials tbody tr").count() == 100
    tab.shot("study-5000")
    assert tab.errors == []
    assert timings["warm"][0] < 10  # the target is < 2 s on 2 cores; this bound only catches a hang
