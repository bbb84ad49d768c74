"""`tuner memcheck` and `tuner plan --verify-memory`, run as a user runs them."""

from __future__ import annotations

import json

import pytest

from tests.tuner.test_cli import tuner
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig
from trainer.memcheck import memcheck

# A model small enough to simulate in seconds, with 8 heads so that the default space's tp 8 is valid.
SHAPE = ["--layers", "4", "--hidden", "64", "--heads", "8", "--vocab", "256", "--seq", "32"]
MODEL = ModelConfig(num_layers=4, hidden_size=64, num_heads=8, vocab_size=256, seq_len=32)


@pytest.mark.oracle
def test_memcheck_reports_the_oracles_peak_of_the_pinned_layout() -> None:
    proc = tuner("memcheck", *SHAPE, "--cluster", "cpu-local", "--gpus", "4", "--global-batch", "8",
                 "--config", "tp=2,pp=2,mbs=1,pp_schedule=1f1b,sp=false,ac=none", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    p = ParallelConfig.from_dict(out["config"])
    assert (p.tp, p.pp, p.micro_batch_size, p.num_microbatches, p.pp_schedule) == (2, 2, 1, 8, "1f1b")
    oracle = out["oracle"]
    # cpu-local: a CPU trial, fp32, exactly what its trainer measures
    direct = memcheck(BenchmarkConfig(model=MODEL, parallel=p, device="cpu", dtype="fp32"))
    assert oracle["tensor_bytes"] == direct.peak_bytes == sum(oracle["breakdown"].values())
    assert oracle["device"] == "cpu" and [r["rank"] for r in oracle["ranks"]] == [0, 2]
    assert oracle["memory_bytes"] == oracle["tensor_bytes"]  # no calibrated workspace on CPU ranks
    assert out["predicted"]["tensor_bytes"] > 0 and oracle["fits"] and out["predicted"]["fits"]


@pytest.mark.oracle
def test_plan_verify_memory_checks_each_listed_layout() -> None:
    proc = tuner("plan", *SHAPE, "--cluster", "a100-80gb", "--gpus", "8", "--global-batch", "16", "--top", "2",
                 "--verify-memory", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    candidates = json.loads(proc.stdout)["candidates"]
    assert len(candidates) == 2
    for cand in candidates:
        check = cand["memcheck"]
        assert check["oracle"]["device"] == "cuda" and check["oracle"]["dtype"] == "bfloat16"
        # a GPU adds the calibrated workspace the tensors do not show
        assert (
            check["oracle"]["memory_bytes"]
            == check["oracle"]["tensor_bytes"] + check["calibrated"]["workspace_bytes"]
        )
        assert abs(check["predicted"]["tensor_bytes"] / check["oracle"]["tensor_bytes"] - 1) < 0.1


def test_memcheck_bad_pins_exit_2_without_traceback() -> None:
    proc = tuner("memcheck", *SHAPE, "--cluster", "cpu-local", "--gpus", "4", "--config", "tp=3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


@pytest.mark.oracle
def test_memcheck_of_a_mixture_of_experts_simulates_balanced_routing() -> None:
    """A study of learned routing: the oracle needs tokens per expert it can know, so it and the
    model beside it take balanced routing, and the output says so; the plan's candidate (with its
    ep) pins the layout."""
    proc = tuner("memcheck", "--spec", "studies/tiny-moe-cpu.yaml", "--config", "ep=2", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    p = ParallelConfig.from_dict(out["config"])
    assert p.ep == 2 and out["oracle"]["moe_routing"].startswith("balanced")
    model = MODEL_PRESETS["moe-tiny"]
    direct = memcheck(
        BenchmarkConfig(model=model, parallel=p, device="cpu", dtype="fp32", moe_routing="balanced")
    )
    assert out["oracle"]["tensor_bytes"] == direct.peak_bytes
