"""`tuner plan --export FORMAT`: a plan ranked over the layouts a framework can express, and the
fastest fitting one's launch config written from the plan (no study, no trial), in the library,
the CLI and the API."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cp_published
from tuner.exports import FORMATS, export_layout, refusal
from tuner.plan import PlanError, plan, planned
from tuner.pricing import Pricing
from tuner.space import SearchSpace, layout

TUNER = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"


def tuner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TUNER, *args], capture_output=True, text=True, timeout=600)


def _titan_256k():
    """torchtitan's published Llama 3.1 8B at 256k tokens on 8 GPUs (bench/cp_published.py): the
    planner's pick offloads activations, which torchtitan 0.3.0 does not run."""
    run = next(r for r in cp_published.RUNS if r.preset == "llama3.1-8b" and r.seq_len == 262144)
    return cp_published.study(run)


def test_an_export_plan_ranks_only_what_the_format_expresses_and_writes_its_pick() -> None:
    spec = _titan_256k()
    free = plan(spec, top=1)
    assert free["candidates"][0]["config"]["activation_checkpoint"] == "offload"
    doc = plan(spec, top=10_000, include_unfit=True, export="torchtitan")
    exported = doc["export"]
    assert exported["refused"]["activation_checkpoint 'offload'"] > 0
    assert (
        sum(exported["refused"].values()) + exported["expressible"] == doc["num_valid"] == free["num_valid"]
    )
    assert len(doc["candidates"]) == exported["expressible"]
    for cand in doc["candidates"]:
        assert refusal("torchtitan", spec, layout(**cand["config"])) is None
    best = next(c for c in doc["candidates"] if c["predicted"]["fits"])
    config = layout(**best["config"])
    assert exported["layout"] == config.describe() and exported["config"] == best["config"]
    ranked = Pricing.for_study(spec).rank(SearchSpace.from_spec(spec).enumerate().valid)
    est = next(e for c, e in ranked if c == config)
    assert exported["text"] == planned(export_layout("torchtitan", spec, config), est)
    assert (
        exported["text"].split("\n")[1].startswith("# planned, not measured: `tuner plan` picked this layout")
    )
    # a real cut: slower than the pick torchtitan cannot run, and the one bench/cp_published.py names
    assert exported["tokens_per_s"] == best["predicted"]["tokens_per_s"]
    assert exported["tokens_per_s"] < free["candidates"][0]["predicted"]["tokens_per_s"]
    cell = cp_published.exports_cell(spec, ranked, spec.devices)
    assert (
        f"its fastest: {config.describe()} at {exported['tokens_per_s'] / spec.devices:,.0f} tokens/s/GPU"
        in cell
    )


def test_an_export_plan_says_why_no_launch_config_is_written() -> None:
    spec = _titan_256k()
    doc = plan(spec, pins={"activation_checkpoint": "offload"}, export="megatron")
    assert doc["candidates"] == [] and doc["export"]["expressible"] == 0
    assert doc["export"]["text"] is None
    assert doc["export"]["why"] == "megatron: it can express none of the valid layouts"
    with pytest.raises(
        PlanError, match=r"--export: 'nemo' is not one of \['torchtitan', 'megatron', 'sbatch'\]"
    ):
        plan(spec, export="nemo")


def test_the_cli_writes_the_launch_config_or_exits_1_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "launch.sh"
    args = ["plan", "--model", "llama3.1-8b", "--cluster", "h100-80gb", "--gpus", "16", "--global-batch", "256",
            "--seq", "8192"]  # fmt: skip
    proc = tuner(*args, "--export", "megatron", "--output", str(out), "--top", "3")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(tuner(*args, "--export", "megatron", "--json").stdout)
    assert (
        out.read_text() == doc["export"]["text"] and "--tensor-model-parallel-size" in doc["export"]["text"]
    )
    assert f"megatron launch config for {doc['export']['layout']}" in proc.stdout
    assert f"written to {out}" in proc.stdout
    printed = tuner(*args, "--export", "megatron", "--top", "1")
    assert printed.returncode == 0 and printed.stdout.endswith(doc["export"]["text"])
    none = tuner(*args, "--config", "ac=offload", "--export", "megatron")
    assert none.returncode == 1
    assert "no megatron launch config: megatron: it can express none of the valid layouts" in none.stderr
    assert "activation_checkpoint 'offload'" in none.stdout
    bad = tuner(*args, "--output", str(tmp_path / "x"))
    assert bad.returncode == 2 and "--output: needs --export FORMAT" in bad.stderr
    assert not (tmp_path / "x").exists()
    wrong = tuner(*args, "--export", "nemo")
    assert wrong.returncode == 2 and f"--export: 'nemo' is not one of {list(FORMATS)}" in wrong.stderr
    assert "Traceback" not in wrong.stderr + bad.stderr + none.stderr


@pytest.mark.parametrize("fmt", ["megatron", "sbatch"])
def test_the_planned_note_keeps_each_format_runnable(fmt: str) -> None:
    """The note goes after the header's first comment: an sbatch script keeps its #! line first
    and its #SBATCH lines before any command."""
    spec = _titan_256k()
    text = plan(spec, export=fmt)["export"]["text"]
    lines = text.split("\n")
    note = next(i for i, line in enumerate(lines) if line.startswith("# planned, not measured"))
    assert lines[note - 1].startswith("# ") and not lines[note - 1].startswith("#SBATCH")
    if fmt == "sbatch":
        assert lines[0] == "#!/bin/bash" and all(line.startswith("#") for line in lines[:note])
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
