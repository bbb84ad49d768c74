"""bench/model_validation.py's dev / held-out split and levels table, and bench/frontier_runs.py's
settings and metric (issue 25, item 9)."""

from __future__ import annotations

import dataclasses

import pytest

from bench import frontier_runs, model_validation
from bench.validation_data import load_tables


def test_tables_a_default_was_chosen_on_are_kept_apart() -> None:
    """vTrain h1024 chose the overheads, Korthikanti table 5 the price of memory-bound work."""
    split = model_validation.split
    assert split("vtrain_single_h1024_L12_2gpu_gbs16") == split("korthikanti_tab5_gpt3-175B_64gpu") == "dev"
    assert (
        split("vtrain_single_h2048_L12_2gpu_gbs16")
        == split("amp_homogeneous_gpt2-345M_16gpu_gbs32")
        == ("held out")
    )


def test_levels_cover_every_layout_that_ran_with_its_device_and_size() -> None:
    tables = {tid: rows for tid, rows in load_tables().items() if tid.startswith(("korthikanti", "amp"))}
    rows = model_validation.levels(tables)
    ran = sum(r.status == "ok" and bool(r.iteration_time_s) for t in tables.values() for r in t)
    assert len(rows) == ran  # tables under MIN_ROWS layouts too (Korthikanti's have 2)
    assert {(r["device"], r["split"]) for r in rows} == {("A100", "dev"), ("T4", "held out")}
    assert {r["size"] for r in rows if r["table"].startswith("amp")} == {"< 1B"}
    assert {r["size"] for r in rows if "1T" in r["table"]} == {">= 100B"}


def test_frontier_runs_use_the_stated_settings_and_count_recompute_as_megatron_does() -> None:
    rows = frontier_runs.rows()
    for run in frontier_runs.RUNS:
        mine = [r for r in rows if r["run"] == run.name]
        scaled = [r for r in mine if "scaled" in r["case"]]
        scripted = [r for r in mine if "as scripted" in r["case"]]
        assert {(r["gcds"], r["global_batch"]) for r in scaled} == {(run.gcds, run.global_batch)}
        assert {(r["gcds"], r["global_batch"]) for r in scripted} == {run.script[:2]}
        assert all("ac=full" in r["layout"] for r in scaled + scripted)
    # their metric: 24 f B s l h^2 (1 + s/6h + V/16lh), f = 4 with recompute, 3 without
    spec = frontier_runs.study(frontier_runs.RUNS[0], 16, 640)
    full = frontier_runs.authors_layout(1, 8, 0, 16, 640)
    est = frontier_runs.Pricing.for_study(spec).estimate(full)
    none = dataclasses.replace(full, activation_checkpoint="none")
    ratio = frontier_runs.their_metric(spec, full, est) / frontier_runs.their_metric(spec, none, est)
    assert ratio == pytest.approx(4 / 3)
    with pytest.raises(ValueError, match="not a multiple of dp 6"):
        frontier_runs.authors_layout(4, 128, 1, 3072, 1024)
