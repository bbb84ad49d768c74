"""The column degree of 2D tensor parallelism (tp_col) in the tuner: the search space enumerates it
when the spec asks for it (default [1]: studies without it are unchanged), every rejection with its
reason; exports to stacks that cannot run it refuse it; the performance model prices it and the
plan says why a column layout wins or loses."""

from __future__ import annotations

import pytest

from tests.records import record_trial
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner import store
from tuner.db import connect
from tuner.exports import export_layout
from tuner.hardware import cluster_preset
from tuner.outcome import Outcome
from tuner.perfmodel import estimate
from tuner.plan import plan
from tuner.space import RULE_CROSS_NODE_TENSOR, RULE_GPUS, SearchSpace
from tuner.spec import ClusterSpec, SpaceSpec, parse_spec

MODEL = ModelConfig(num_layers=4, hidden_size=72, num_heads=6, vocab_size=1000, seq_len=64)
KNOBS = {"pp": [1], "micro_batch_size": [1], "zero_stage": [0], "activation_checkpoint": ["none"]}


def _space(**space) -> SearchSpace:
    return SearchSpace(MODEL, num_gpus=16, gpus_per_node=8, global_batch_size=16, space=SpaceSpec(**space))


def test_default_space_has_no_column_axis() -> None:
    assert SpaceSpec().tp_col == [1]
    assert all(c.tp_col == 1 for c in _space(tp=[1, 2], **KNOBS).enumerate().valid)


def test_column_degrees_enumerated_with_reasons() -> None:
    space = _space(tp=[1, 2, 4], tp_col=[1, 2, 4, 16, 32], sequence_parallel=[False, True], **KNOBS)
    result = space.enumerate()
    grids = {(c.tp, c.tp_col) for c in result.valid}
    # 6 heads: tp 4 never; hidden 72: tp_col 16 never; 32 GPUs: tp_col 32 never
    assert grids == {(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4)}
    for c in result.valid:
        assert c.world_size == 16 and c.dp == 16 // (c.tp * c.tp_col)
        assert not (c.sequence_parallel and c.tp_col > 1)
    assert {"tp must divide num_heads", "tp_col must divide hidden_size", RULE_GPUS} <= set(result.rejected)
    assert "sequence_parallel needs tp_col 1" in result.rejected
    assert result.space_size == len(result.valid) + result.num_rejected
    # the vocabulary is split by tp alone: padded for tp (1000 -> 1024 at tp 2), never for tp_col
    assert "tp must divide vocab_size" not in result.rejected


def test_row_by_column_group_inside_a_node_unless_allowed() -> None:
    knobs = {**KNOBS, "tp": [2], "tp_col": [8]}
    kept = _space(allow_cross_node_tp=False, **{**knobs, "tp": [2], "tp_col": [2, 8]}).enumerate()
    assert {c.tp_col for c in kept.valid} == {2}
    assert kept.rejected[RULE_CROSS_NODE_TENSOR] > 0
    assert "tp (2) x tp_col (8) = 16 > gpus_per_node (8)" in kept.examples[RULE_CROSS_NODE_TENSOR]
    model = ModelConfig(num_layers=4, hidden_size=96, num_heads=8, vocab_size=1000, seq_len=64)
    allowed = SearchSpace(model, 16, 8, 16, SpaceSpec(allow_cross_node_tp=True, **knobs)).enumerate()
    assert [(c.tp, c.tp_col) for c in allowed.valid] == [(2, 8)]


@pytest.mark.parametrize("fmt", ["torchtitan", "megatron"])
def test_exports_refuse_a_column_axis(fmt: str) -> None:
    spec = parse_spec({"name": "s", "model": "gpt-tiny", "num_gpus": 4, "training": {"global_batch_size": 4}, "space": {"tp": [1, 2]},
                       "cluster": {"preset": "cpu-local", "gpus_per_node": 4}})  # fmt: skip
    layout = ParallelConfig(tp=2, tp_col=2, micro_batch_size=4)
    with pytest.raises(ValueError, match="neither Megatron-LM nor torchtitan implements"):
        export_layout(fmt, spec, layout)
    assert "tp_col" in export_layout("sbatch", spec, layout)  # our trainer runs it


def test_store_counts_the_column_axis_in_the_device_count(database_url: str) -> None:
    """World size is tp x tp_col x pp x dp in SQL too (bests per device count, incremental and
    rebuilt from the trials): tp_col is a trial column (migration 0007), not only config JSON."""
    spec = parse_spec({"name": "s", "model": "gpt-tiny", "cluster": {"preset": "cpu-local", "gpus_per_node": 4}, "num_gpus": 4,
                       "training": {"global_batch_size": 8}, "space": {"tp": [1, 2], "tp_col": [1, 2]}})  # fmt: skip
    grid, flat = ParallelConfig(tp=2, tp_col=2, micro_batch_size=8), ParallelConfig(tp=2, micro_batch_size=8)
    sessions = connect(database_url)
    with sessions.begin() as s:
        study = store.create_study(s, spec)
        for config, tps in ((grid, 300.0), (flat, 100.0)):
            record_trial(s, study, config, Outcome(ok=True, tokens_per_s=tps, tflops_per_device=0.01, mfu=0.1,
                                                   peak_memory_bytes=10, step_time_s=0.5))  # fmt: skip
    for rebuilt in (False, True):
        if rebuilt:
            with sessions.begin() as s:
                store.rebuild_bests(s)
        with sessions() as s:
            assert {(r["gpus"], r["tokens_per_s"]) for r in store.best_rows(s)} == {(4, 300.0), (2, 100.0)}
            (trial,) = [t for t in store.trials(s, store.get_study(s, "s")) if t.tp_col == 2]
            assert store.config_of(trial) == grid and store.world_size(trial) == 4


# --- the performance model prices the column axis (tuner/perfmodel.py, tuner/plan.py) -----------

GPT80B = ModelConfig(num_layers=64, hidden_size=10240, num_heads=80, seq_len=2048, vocab_size=51200)


def _a100(nodes: int) -> ClusterSpec:
    return ClusterSpec(**{**cluster_preset("a100-80gb"), "num_nodes": nodes})


def _est(tp: int, tp_col: int, **knobs):
    p = ParallelConfig(
        tp=tp, tp_col=tp_col, pp=8, dp_replicate=8, micro_batch_size=1, num_microbatches=4, **knobs
    )
    return estimate(GPT80B, p, _a100(128))


def test_column_axis_splits_the_weights_not_the_attention_core() -> None:
    """GEMM FLOPs divide by tp x tp_col; the attention core (the row group's heads) and the
    residual stream's elementwise work do not: compute of tp 8 x 2 lies between tp 16 (with
    sequence parallelism) and tp 8, its parameters' memory is close to tp 16's."""
    tp8, tp8x2, tp16 = _est(8, 1, sequence_parallel=True), _est(8, 2), _est(16, 1, sequence_parallel=True)
    assert tp16.compute_s < tp8x2.compute_s < tp8.compute_s
    assert tp8x2.weights_bytes == pytest.approx(tp16.weights_bytes, rel=0.02)


def test_column_alone_moves_more_than_megatron_but_crossing_nodes_it_moves_less() -> None:
    """Column only (tp 1 x 8) all-reduces whole q, k, v and ffn outputs (12h per token per layer,
    Megatron 4h; part of it hidden behind dW): more tensor-parallel time than tp 8 in a node. Past a node the row group's traffic shrinks by tp_col: tp 8 x 2
    spends less on tensor-parallel communication than tp 16 over two nodes."""
    assert _est(1, 8).tp_comm_s > 1.5 * _est(8, 1).tp_comm_s
    assert _est(8, 2).tp_comm_s < _est(16, 1).tp_comm_s


def test_backward_traffic_overlaps_weight_gradients() -> None:
    """trainer/tp2d.py overlaps the backward all-reduces with dW: on links slow enough that they
    exceed it, the hidden part is capped by the weight-gradient compute."""
    slow = ClusterSpec(**{**cluster_preset("a100-80gb"), "num_nodes": 128, "intra_node_gbps": 5.0})
    p = ParallelConfig(tp=4, tp_col=2, pp=8, dp_replicate=16, micro_batch_size=1, num_microbatches=4)
    fast_est, slow_est = estimate(GPT80B, p, _a100(128)), estimate(GPT80B, p, slow)
    assert slow_est.tp_comm_s > 5 * fast_est.tp_comm_s
    assert slow_est.step_time_s > fast_est.step_time_s


def test_plan_says_why_the_column_axis_wins_or_loses() -> None:
    spec = parse_spec(
        {
            "name": "x", "model": {"num_layers": 64, "hidden_size": 10240, "num_heads": 80, "vocab_size": 51200},
            "cluster": {"preset": "perlmutter-a100-40gb", "num_nodes": 256},
            "training": {"global_batch_size": 32},
            "space": {"tp": [4, 8, 16], "tp_col": [1, 2, 4], "pp": [4, 8], "micro_batch_size": [1],
                      "zero_stage": [0], "activation_checkpoint": ["none"]},
        }
    )  # fmt: skip
    result = plan(spec, top=50)
    assert any(c["config"]["tp_col"] > 1 for c in result["candidates"])
    by_col = {e["tp_col"]: e for e in result["column"]}
    assert set(by_col) == {2, 4}
    for entry in by_col.values():
        assert entry["why"].startswith(("wins", "loses")) and "s per step" in entry["why"]
        assert entry["versus"] and entry["speedup"] > 0
        terms = result["candidates"][0]["predicted"]["terms"]
        assert set(entry["term_deltas_s"]) == set(terms)


def test_the_external_samplers_tell_column_layouts_apart() -> None:
    """tp1x4 dpr2 and tp1x8 share every other knob at a fixed device count: optuna and deephyper
    see tp_col as a knob whenever a candidate has one, so every layout stays reachable."""
    from tuner.samplers.external import KNOBS as SAMPLER_KNOBS
    from tuner.samplers.external import OptunaSampler

    with_col = _space(tp=[1, 2], tp_col=[1, 2, 4, 8], **KNOBS).enumerate().valid
    sampler = OptunaSampler(with_col, seed=0, kind="tpe")
    assert sampler.knobs[:2] == ("tp", "tp_col") and len(sampler.index) == len(with_col)
    seen = set()
    while (config := sampler.ask()) is not None:
        seen.add(config)
        sampler.tell(config, Outcome(ok=True, tokens_per_s=1.0 + len(seen), step_time_s=1.0))
    assert seen == set(with_col)
    plain = _space(tp=[1, 2], **KNOBS).enumerate().valid
    assert OptunaSampler(plain, seed=0).knobs == SAMPLER_KNOBS  # a study without the axis: as before
