"""bench/measure_table.py: a table's rows, as bench/validation_data.py reads them back. No cluster:
the runs are made-up results with the placement a 4-node job records (trainer/contract/topology.py)."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest

from bench.measure_table import (
    CP_COLUMNS,
    OWN_COLUMNS,
    ROW_COLUMNS,
    SPACES,
    cluster_label,
    measured_layouts,
    report,
    table_columns,
    table_row,
)
from bench.validation_data import CLUSTERS, load_csv
from trainer.contract.parallel import ParallelConfig as P
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig, BenchmarkResult, trainer_problems
from trainer.contract.topology import placement
from tuner.space import SearchSpace

HOSTS = [f"n{r // 2}" for r in range(8)]  # 4 nodes x 2 ranks, in blocks


def _result(layout: P, step_times_s: list[float]) -> BenchmarkResult:
    return BenchmarkResult(status="ok", step_times_s=step_times_s, tokens_per_s=1000.0,
                           peak_memory_bytes=5_000_000, placement=placement(layout, HOSTS))  # fmt: skip


def _write_and_load(
    tmp_path: Path, layout: P, results: list[BenchmarkResult], mbit: int | None, model: str = "gpt-tiny",
    space: str = "default", seq_len: int | None = None,
):  # fmt: skip
    gpt = dataclasses.replace(MODEL_PRESETS[model], seq_len=seq_len or MODEL_PRESETS[model].seq_len)
    cfg = BenchmarkConfig(model=gpt, parallel=layout, warmup_steps=1, measure_steps=3)
    path = tmp_path / "own_test.csv"
    row = table_row(layout, cfg, results, model_name=model, table_id=path.stem, source="test",
                    gpu_type=cluster_label(4, mbit), gpus_per_node=2, with_placement=True)  # fmt: skip
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, table_columns(cfg.model, space), extrasaction="ignore")
        writer.writeheader()
        writer.writerow(row)
    (measurement,) = load_csv(path)
    return row, measurement


@pytest.mark.parametrize(("num_nodes", "mbit", "name"), [(1, None, "cpu-local"), (4, 200, "cpu-4node-200mbit"),
                                                         (4, None, "cpu-4node-unshaped")])  # fmt: skip
def test_each_label_names_exactly_one_cluster(num_nodes: int, mbit: int | None, name: str) -> None:
    label = cluster_label(num_nodes, mbit)
    assert [c["name"] for key, c in CLUSTERS.items() if key in label] == [name]


def test_a_4_node_row_reads_back_as_the_layout_on_the_emulated_cluster(tmp_path: Path) -> None:
    layout = P(tp=2, dp_replicate=4, micro_batch_size=4)  # tp inside a node, dp across 4
    runs = [_result(layout, [1.0, 1.2, 1.1]), _result(layout, [1.4, 1.3, 1.5])]
    _, m = _write_and_load(tmp_path, layout, runs, mbit=200)
    assert m.parallel == layout and m.status == "ok"
    assert m.iteration_time_s == pytest.approx(1.25)  # median of the per-run medians 1.1 and 1.4
    assert m.cluster["name"] == "cpu-4node-200mbit"
    assert (m.cluster["num_nodes"], m.cluster["gpus_per_node"], m.cluster["cores_per_node"]) == (4, 2, 0.5)
    assert m.cluster["inter_node_gbps"] == 0.025  # 200 Mbit/s
    assert (
        "per-run medians 1.1000, 1.4000; placement: 4 nodes x 2 ranks; dp_replicate 4 nodes, tp 1 node"
        in m.notes
    )


def test_a_column_row_reads_back_with_its_column_degree(tmp_path: Path) -> None:
    """Our tables' extra tp_col column (bench/data/README.md): num_gpus = tp x tp_col x pp x dp."""
    layout = P(tp=2, tp_col=2, dp_replicate=2)
    row, m = _write_and_load(tmp_path, layout, [_result(layout, [0.7])], mbit=200)
    assert (row["tp"], row["tp_col"], row["dp"], row["num_gpus"]) == (2, 2, 2, 8)
    assert m.parallel == layout


def test_a_zero3_row_reads_back_sharded_and_a_failed_run_fails_the_row(tmp_path: Path) -> None:
    layout = P(tp=1, pp=2, dp_shard=4, zero_stage=3, micro_batch_size=2, num_microbatches=2)
    ok = _result(layout, [0.5])
    _, m = _write_and_load(tmp_path, layout, [ok, ok], mbit=None)
    assert m.parallel == layout and m.cluster["name"] == "cpu-4node-unshaped"
    crashed = BenchmarkResult(status="error", error="Slurm job 7 ended FAILED (exit 1:0) without a result")
    row, m = _write_and_load(tmp_path, layout, [ok, crashed], mbit=None)
    assert (row["status"], row["measured_value"], m.iteration_time_s) == ("fail", "", None)
    assert "error: Slurm job 7 ended FAILED" in m.notes


def test_a_moe_row_reads_back_with_its_experts_and_ep(tmp_path: Path) -> None:
    """A mixture of experts' table: ep (folded into dp x tp, not in num_gpus) and the whole model
    (the experts' fields have no shared column); the runs' routed imbalance in the notes, which
    --report reads beside the imbalance the model priced."""
    layout = P(
        tp=2, dp_shard=4, zero_stage=3, sequence_parallel=True, ep=4, micro_batch_size=2, num_microbatches=2
    )
    runs = [
        dataclasses.replace(
            _result(layout, [0.9]),
            moe={"routing": "learned", "imbalance": {"0": [1.2, 1.4, 1.6], "1": [2.0, 2.0, 2.0]}},
        )
    ]
    row, m = _write_and_load(tmp_path, layout, runs, mbit=200, model="moe-small")
    assert (row["ep"], row["num_gpus"]) == (4, 8)
    assert m.parallel == layout and m.model == MODEL_PRESETS["moe-small"]
    assert (
        "routed imbalance (max / mean tokens per expert; median over steps, mean over layers) per run: 1.700"
        in m.notes
    )
    lines = report(tmp_path / "own_test.csv")
    assert (
        "routed imbalance measured: median 1.70 (1.70-1.70) over 1 runs; the model priced 1.30" in lines[-1]
    )


def test_a_dense_row_keeps_the_shared_columns_and_tp_col() -> None:
    assert table_columns(MODEL_PRESETS["gpt-tiny"], "default") == OWN_COLUMNS


def test_the_cp_space_is_cp_x_tp_x_fsdp_and_the_trainer_builds_every_layout() -> None:
    """`--space cp` at llama-tiny's shape with 2048 tokens, 8 ranks, global batch 8: cp 1-8 against tp
    1-2 (SP) and replicated or FSDP-sharded data parallelism; cp 8 and tp 2 x cp 4 leave dp 1, where
    ZeRO-3 shards over the cp ranks alone; tp 2 x cp 8 needs 16 ranks."""
    model = dataclasses.replace(MODEL_PRESETS["llama-tiny"], seq_len=2048)
    for gpus_per_node in (8, 2):
        valid = SearchSpace(model, 8, gpus_per_node, 8, SPACES["cp"]).enumerate().valid
        assert sorted((c.tp, c.cp, c.dp, c.zero_stage) for c in valid) == [
            (1, 1, 8, 0), (1, 1, 8, 3), (1, 2, 4, 0), (1, 2, 4, 3), (1, 4, 2, 0), (1, 4, 2, 3), (1, 8, 1, 0),
            (1, 8, 1, 3), (2, 1, 4, 0), (2, 1, 4, 3), (2, 2, 2, 0), (2, 2, 2, 3), (2, 4, 1, 0), (2, 4, 1, 3),
        ]  # fmt: skip
        assert all(c.sequence_parallel == (c.tp > 1) and c.global_batch_size == 8 for c in valid)
        for c in valid:
            cfg = BenchmarkConfig(model=model, parallel=c, device="cpu")
            assert not c.problems(model) and not trainer_problems(cfg), c.describe()


def test_a_cp_row_reads_back_with_cp_and_its_llama_model(tmp_path: Path) -> None:
    """A context-parallel table: cp in num_gpus (tp 2 x dp 2 x cp 2 = 8) but not in the batch, the
    Llama-style model (GQA, SwiGLU, RoPE) and its long sequence from model_config, and --report
    prices the layout with its cp."""
    layout = P(tp=2, dp_shard=2, zero_stage=3, sequence_parallel=True, cp=2, num_microbatches=4)
    row, m = _write_and_load(tmp_path, layout, [_result(layout, [1.5, 1.6]), _result(layout, [1.7])],
                             mbit=200, model="llama-tiny", space="cp", seq_len=2048)  # fmt: skip
    assert sorted(row) == sorted(ROW_COLUMNS) and set(CP_COLUMNS) <= set(row)
    assert (row["tp"], row["dp"], row["cp"], row["num_gpus"], row["global_batch_size"]) == (2, 2, 2, 8, 8)
    assert m.parallel == layout and m.model == dataclasses.replace(MODEL_PRESETS["llama-tiny"], seq_len=2048)
    assert m.iteration_time_s == pytest.approx(1.625)  # median of the per-run medians 1.55 and 1.7
    assert "placement: 4 nodes x 2 ranks" in m.notes
    lines = report(tmp_path / "own_test.csv")
    assert "measured best: tp2 pp1 dps2(z3) mbs1x4 sp cp2 1.625 s" in lines[1]


@pytest.mark.parametrize("table", ["own_llama-tiny_8rank_cp_gbs8", "own_llama-tiny_4node_200mbit_cp_gbs8"])
def test_the_cp_tables_cover_the_cp_space(table: str) -> None:
    """Each committed cp table has a row for every layout of `--space cp` (measured_layouts, what
    --add-missing skips): the two of ZeRO-3 over the cp ranks alone were added when the space grew."""
    model = dataclasses.replace(MODEL_PRESETS["llama-tiny"], seq_len=2048)
    gpus_per_node = 8 if "8rank" in table else 2
    space = SearchSpace(model, 8, gpus_per_node, 8, SPACES["cp"]).enumerate().valid
    path = Path(__file__).parents[2] / "bench" / "own_tables" / f"{table}.csv"
    assert measured_layouts(path) == {c.describe() for c in space}
