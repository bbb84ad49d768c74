"""The dashboard on a real CPU study: `tuner serve` with its embedded worker runs 4 trials of
gpt-tiny on 2 local CPU ranks (the demo's model and cluster, fewer and shorter trials), then the
charts are checked against what was measured: axes in the unit of the trials' MB-sized peaks with
the ~GB device memory said to be off the scale, no plotly control over a heading, sizes in their
unit, and the model's predictions when proposed beside the study's calibrated model."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dashboard.helpers import CHARTS, Server, Tab, counts, serve

pytestmark = [pytest.mark.browser, pytest.mark.distributed]

SPEC = {
    "name": "tiny-cpu-dashboard", "model": "gpt-tiny", "cluster": "cpu-local", "num_gpus": 2,
    "training": {"global_batch_size": 8, "precision": "fp32"},
    "space": {"tp": [1, 2], "pp": [1, 2], "micro_batch_size": [1, 2, 4], "zero_stage": [0],
              "activation_checkpoint": ["none", "full"], "sequence_parallel": [False]},
    "trial": {"warmup_steps": 1, "measure_steps": 3, "timeout_s": 60, "device": "cpu"},
    "budget": {"max_trials": 4}, "sampler": "model",
}  # fmt: skip


def shown(x: float) -> str:
    """A number as the page prints sizes: 3 significant digits, no trailing zeros (lib.js: fmt)."""
    return f"{float(f'{x:.3g}'):,g}"


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int]]:
    """The study run for real by the server's worker, to the end (so it is calibrated)."""
    with serve(tmp_path_factory.mktemp("real"), read_auth=False, worker=True) as server:
        r = server.http.post("/api/studies", json=SPEC)
        assert r.status_code == 201, r.text
        study_id, t0 = r.json()["id"], time.monotonic()
        while (status := server.http.get(f"/api/studies/{study_id}").json()["status"]) in (
            "pending",
            "running",
        ):
            assert time.monotonic() - t0 < 300, "the 4-trial CPU study did not end in 5 minutes"
            time.sleep(1)
        print(f"real CPU study: {status} after {time.monotonic() - t0:.0f} s")
        assert status == "complete"
        yield server, study_id


@pytest.fixture
def tab(browser, study: tuple[Server, int], tmp_path: Path) -> Iterator[Tab]:
    t = Tab(browser, study[0].base, tmp_path)
    yield t
    t.context.close()


def test_charts_fit_the_measured_trials(tab: Tab, study: tuple[Server, int]) -> None:
    server, study_id = study
    trials = server.http.get(f"/api/studies/{study_id}/trials").json()["items"]
    device_bytes = (
        server.http.get(f"/api/studies/{study_id}").json()["spec"]["cluster"]["device_memory_gb"] * 1e9
    )
    done = [t for t in trials if t["state"] == "complete"]
    peak = max(t["peak_memory_bytes"] for t in done)
    assert len(done) >= 3 and 1e6 <= peak < 1e9 < device_bytes  # MB-sized peaks on a ~GB device
    tab.open(f"#/study/{study_id}")
    page = tab.page
    expected = counts(server, study_id)
    assert tab.charts() == {k: expected[k] for k in CHARTS}
    # Throughput vs memory: an MB axis that ends just past the largest peak, the device's memory
    # named in the note instead of stretching the axis to it.
    memory = page.locator('[data-chart="memory"]')
    assert (memory.get_attribute("data-unit"), memory.get_attribute("data-device-line")) == (
        "MB",
        "off-scale",
    )
    xs, top = page.evaluate("""(() => { const d = document.querySelector('[data-chart="memory"]');
                                        return [d.data[0].x, d.layout.xaxis.range[1]]; })()""")  # fmt: skip
    assert max(xs) == pytest.approx(peak / 1e6) and max(xs) < top <= 1.1 * max(xs)
    note = page.inner_text('figure:has([data-chart="memory"]) .chart-note')
    assert "off the scale" in note and f"{shown(device_bytes / 1e9)} GB" in note
    # Sizes in their unit: the trial table's peaks in MB.
    best = next(t for t in done if t["tokens_per_s"] == max(d["tokens_per_s"] for d in done))
    row = page.locator(f'table.trials tr[data-number="{best["number"]}"]').inner_text()
    assert f"{shown(best['peak_memory_bytes'] / 1e6)} MB" in row
    assert tab.errors == []


def test_the_predicted_chart_shows_the_model_learn(tab: Tab, study: tuple[Server, int]) -> None:
    """Each trial as predicted when proposed and by the study's calibration; the calibrated model
    is closer to the measurements (it was fitted to them: in-sample, and said so)."""
    server, study_id = study
    fit = server.http.get(f"/api/studies/{study_id}/calibration").json()
    assert (
        fit["calibration"]["study_id"] == study_id
        and fit["calibration"]["num_points"] == len(fit["trials"]) >= 3
    )

    def rms_log(key: str) -> float:
        return math.sqrt(
            sum(math.log(t[key] / t["tokens_per_s"]) ** 2 for t in fit["trials"]) / len(fit["trials"])
        )

    print(f"rms log error: {rms_log('proposed_tokens_per_s'):.2f} proposed, "
          f"{rms_log('calibrated_tokens_per_s'):.2f} calibrated")  # fmt: skip
    assert rms_log("calibrated_tokens_per_s") < rms_log("proposed_tokens_per_s")
    tab.open(f"#/study/{study_id}")
    page = tab.page
    chart = page.locator('[data-chart="predicted"][data-points]')
    chart.wait_for()
    assert chart.get_attribute("data-calibrated") == str(len(fit["trials"]))
    drawn = page.evaluate("""(() => { const d = document.querySelector('[data-chart="predicted"]');
                                      return Object.fromEntries(d.data.map((t) => [t.name, t.x])); })()""")  # fmt: skip
    assert sorted(drawn["calibrated model"]) == pytest.approx(
        sorted(t["calibrated_tokens_per_s"] for t in fit["trials"])
    )
    assert sorted(drawn["predicted when proposed"]) == pytest.approx(
        sorted(t["proposed_tokens_per_s"] for t in fit["trials"])
    )
    note = page.inner_text('figure:has([data-chart="predicted"]) .chart-note')
    pct = lambda x: f"{100 * x:.1f} %"  # noqa: E731
    assert pct(fit["median_error_proposed"]) in note and pct(fit["median_error_calibrated"]) in note
    assert "in-sample" in note
    tab.shot("predicted")
    assert tab.errors == []


def test_no_control_covers_a_heading(tab: Tab, study: tuple[Server, int]) -> None:
    """Headings are HTML above each plot; plotly's mode bar (shown on hover) stays below them."""
    tab.open(f"#/study/{study[1]}")
    page = tab.page
    tab.charts()
    assert page.locator(".gtitle").count() == 0  # no plotly title left to cover
    for name in CHARTS:
        plot = page.locator(f'[data-chart="{name}"]')
        plot.scroll_into_view_if_needed()
        plot.hover()
        bar = plot.locator(".modebar")
        bar.wait_for(state="visible")
        box = bar.bounding_box()
        for text in page.locator(f'figure:has([data-chart="{name}"]) :is(h2, .chart-note)').all():
            if text.is_visible():
                other = text.bounding_box()
                assert other["y"] + other["height"] <= box["y"], (
                    f"{name}: the mode bar covers {text.inner_text()!r}"
                )
    assert tab.errors == []


def test_best_page_sizes_in_their_unit(tab: Tab, study: tuple[Server, int]) -> None:
    server, _ = study
    (row,) = server.http.get("/api/best").json()
    assert row["model"] == "gpt-tiny" and row["num_params"] < 1e6
    tab.open("#/best")
    page = tab.page
    page.wait_for_selector('[data-chart="best"][data-points="1"]')
    cells = page.locator("table.best tbody tr").first.locator("td").all_inner_texts()
    assert cells[1] == f"{shown(row['num_params'] / 1e3)} K"  # e.g. 230 K, not "0 M"
    assert cells[8].endswith(" MB")  # peak memory
    ticks = page.locator('[data-chart="best"] .xtick text').all_text_contents()
    assert ticks and all(re.fullmatch(r"[\d.,]+ [KMB]", t) for t in ticks), ticks  # not plotly's SI "G"
    assert tab.errors == []
