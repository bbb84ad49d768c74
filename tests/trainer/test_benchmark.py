"""`python -m trainer.benchmark` under torchrun: valid results, and failures that are results (hangs,
time limits and hard crashes: test_launch.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.helpers import MODELS, assert_valid_result, tiny_config
from trainer.benchmark import slurm_threads, tasks_on_node
from trainer.contract.parallel import ParallelConfig
from trainer.contract.result import BenchmarkResult
from trainer.launch import local_env, run_local

P = ParallelConfig
TP2 = P(tp=2, micro_batch_size=8)

pytestmark = pytest.mark.distributed


def test_one_rank_under_torchrun(tmp_path: Path) -> None:
    cfg = tiny_config(P(micro_batch_size=8))
    result = run_local(cfg, tmp_path, timeout_s=120)
    assert_valid_result(result, cfg)
    assert (tmp_path / "result.json").exists()


def test_four_ranks_2d(tmp_path: Path) -> None:
    cfg = tiny_config(P(tp=2, dp_replicate=2, micro_batch_size=4), warmup_steps=2)
    assert_valid_result(run_local(cfg, tmp_path, timeout_s=300), cfg)


def test_llama_layout_end_to_end(tmp_path: Path) -> None:
    """A Llama-family trial through the launcher: tied head, FSDP2 and selective checkpointing on 2
    ranks; the result prices the family's own counts (SwiGLU's three matrices, GQA's narrower k
    and v, the tied head counted once in the parameters and as a matmul in the FLOPs)."""
    model = MODELS["llama-tied"]
    cfg = tiny_config(
        P(dp_shard=2, zero_stage=2, activation_checkpoint="selective", micro_batch_size=4), model
    )
    result = run_local(cfg, tmp_path, timeout_s=300)
    assert_valid_result(result, cfg)  # MFU and model TFLOP/s from the model's flops_per_token
    assert result.losses[0] > result.losses[-1]
    h, layers, ffn, kv, vocab, seq = 64, 4, 192, 32, 256, 32  # llama-tiny: 2 KV heads of 16
    layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h  # q, out; k, v; gate, fc, proj; 2 RMSNorms
    assert result.num_params == layers * layer + h + vocab * h  # final norm, one tied embedding
    assert result.flops_per_token == 6 * (layers * layer + h + vocab * h) + 12 * layers * h * seq
    assert result.mfu > 0


def test_invalid_layout_is_reported_with_reasons(tmp_path: Path) -> None:
    # tp=3 cannot split 4 heads; launched on 3 ranks, every rank refuses before any collective.
    result = run_local(tiny_config(P(tp=3, micro_batch_size=8)), tmp_path, timeout_s=120)
    assert result.status == "invalid"
    assert "tp (3) must divide num_heads (4)" in result.error
    assert result.tokens_per_s == 0 and result.failed_rank is None


def test_memory_cap_gives_oom(tmp_path: Path) -> None:
    cfg = tiny_config(TP2, max_memory_bytes=1_000_000)  # the tiny model needs ~3.5 MB per rank
    result = run_local(cfg, tmp_path, timeout_s=120)
    assert result.status == "oom"
    assert "over the cap max_memory_bytes" in result.error


def test_memory_cap_above_peak_passes(tmp_path: Path) -> None:
    cfg = tiny_config(TP2, max_memory_bytes=64 * 2**20)
    assert_valid_result(run_local(cfg, tmp_path, timeout_s=120), cfg)


@pytest.mark.parametrize(
    ("fault", "status"),
    [("raise:1:1", "error"), ("oom:1:1", "oom"), ("raise:0:2", "error")],
)
def test_failure_on_one_rank_is_written_by_rank_0(fault: str, status: str, tmp_path: Path) -> None:
    """Another rank fails mid-run: rank 0 still writes the result, naming the failed rank and its
    error, and nobody waits for a collective timeout (init timeout here is 10 minutes)."""
    started = time.monotonic()
    result = run_local(
        tiny_config(TP2, warmup_steps=2), tmp_path, timeout_s=120, env={"TRAINER_FAULT": fault}
    )
    assert result.status == status
    assert result.failed_rank == int(fault.split(":")[1])
    assert "injected" in result.error and "step" in result.error
    assert time.monotonic() - started < 60


def test_bad_config_file_exits_cleanly_with_invalid_result(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model": "gpt-tiny", "parallel": {"tp": 2, "tensor_parallel": 2}}))
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.benchmark", "--config", str(config), "--out", str(out)],
        env=local_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "unknown field(s) ['tensor_parallel']" in proc.stderr
    result = BenchmarkResult.from_json(out.read_text())
    assert result.status == "invalid" and "tensor_parallel" in result.error


def test_world_size_mismatch_is_invalid(tmp_path: Path) -> None:
    from trainer.contract.trial_dir import CONFIG_FILE
    from trainer.launch import torchrun_command

    cfg = tiny_config(TP2)
    (tmp_path / CONFIG_FILE).write_text(cfg.to_json())
    cmd = torchrun_command(1, tmp_path / CONFIG_FILE, tmp_path / "result.json")
    subprocess.run(cmd, env=local_env(), capture_output=True, timeout=120, check=False)
    result = BenchmarkResult.from_json((tmp_path / "result.json").read_text())
    assert result.status == "invalid"
    assert "needs 2 ranks, launched with 1" in result.error


def test_runs_from_slurm_environment_without_torchrun(tmp_path: Path) -> None:
    """Under `srun` each task is a plain process with SLURM_* set; ranks and the rendezvous
    address come from there. Two such processes, started the way srun starts them."""
    cfg = tiny_config(TP2)
    (tmp_path / "config.json").write_text(cfg.to_json())
    out = tmp_path / "result.json"
    procs, job_id = [], str(4242 + time.time_ns() % 1000)  # one job: one rendezvous port
    for rank in range(2):
        env = local_env({
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
            "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0",
            "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0",
        })  # fmt: skip
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"):
            env.pop(key, None)
        cmd = [
            sys.executable,
            "-m",
            "trainer.benchmark",
            "--config",
            str(tmp_path / "config.json"),
            "--out",
            str(out),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            p.kill()
    result = BenchmarkResult.from_json(out.read_text())
    assert_valid_result(result, cfg)
    assert result.device_name.endswith("(1 threads)"), result.device_name  # two ranks on one node


@pytest.mark.parametrize(
    ("env", "threads"),
    [
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURM_NODEID": "3"}, 1),
        ({"SLURM_STEP_TASKS_PER_NODE": "4,1", "SLURM_NODEID": "1"}, None),  # alone on its node
        ({"SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "0"}, None),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURM_CPUS_PER_TASK": "3"}, 3),  # the job's choice
        ({"SLURM_STEP_TASKS_PER_NODE": "2[x4]"}, None),  # not Slurm's form: torch's default, no failure
        ({}, None),
    ],
)
def test_threads_per_rank_under_srun(env: dict[str, str], threads: int | None) -> None:
    """Several ranks on a node get one thread each unless the job gave --cpus-per-task; without
    it 8 ranks of 4 emulated nodes on 2 cores ran a pp4 layout 10x slower (docs/benchmarks.md)."""
    assert slurm_threads(env) == threads


def test_slurm_tasks_per_node_is_parsed_or_refused() -> None:
    assert [tasks_on_node("2(x3),1", n) for n in range(5)] == [2, 2, 2, 1, 0]
    with pytest.raises(ValueError, match="tasks per node"):
        tasks_on_node("2[x3]", 0)
