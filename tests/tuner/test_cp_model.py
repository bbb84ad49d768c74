"""Context parallelism in the space, the performance model and the memory model
(tuner/cost/context.py, issue 28): what a study searches, the rules with their reasons, the terms
CP adds and that they add up, and the plan's choice at long and at ordinary sequence lengths."""

from __future__ import annotations

import dataclasses

import pytest

from tests.tuner.oracle_check import assert_every_rank_matches_the_oracle
from trainer.context_parallel import head_tail_chunks
from trainer.contract.axes import CP_FROM_SEQ_LEN
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from tuner.cost import context
from tuner.cost.case import Case
from tuner.hardware import cluster_preset
from tuner.memmodel import memory
from tuner.perfconstants import default_constants
from tuner.perfmodel import estimate
from tuner.plan import plan
from tuner.space import RULE_CROSS_NODE_CP, SearchSpace, cp_values
from tuner.spec import ClusterSpec, SpaceSpec, parse_spec

LLAMA_8B = MODEL_PRESETS["llama3.1-8b"]
H100 = ClusterSpec(**cluster_preset("h100-80gb"))


def _at(seq_len: int):
    return dataclasses.replace(LLAMA_8B, seq_len=seq_len)


def test_cp_is_searched_from_8k_tokens_by_default() -> None:
    assert cp_values(_at(CP_FROM_SEQ_LEN - 1), SpaceSpec(), 64) == [1]
    assert cp_values(_at(CP_FROM_SEQ_LEN), SpaceSpec(), 64) == [1, 2, 4, 8, 16]
    assert cp_values(_at(131072), SpaceSpec(), 4) == [1, 2, 4]
    assert cp_values(_at(2048), SpaceSpec(cp=[1, 2]), 64) == [1, 2]  # the spec's own list wins


def test_cp_rules_say_why() -> None:
    space = SearchSpace(_at(8196), 16, 8, 16, SpaceSpec(cp=[1, 4], allow_cross_node_cp=False))
    too_wide = ParallelConfig(tp=4, cp=4, dp_replicate=1, num_microbatches=16)  # 16 ranks > a node of 8
    rules = dict(space.violations(too_wide))
    assert "cp needs seq_len divisible by 2 x cp" in rules  # 8196 / 8
    assert "8196" in rules["cp needs seq_len divisible by 2 x cp"]
    assert RULE_CROSS_NODE_CP in rules and "gpus_per_node (8)" in rules[RULE_CROSS_NODE_CP]
    allowed = SearchSpace(_at(8192), 16, 8, 16, SpaceSpec(cp=[1, 4]))
    assert not allowed.explain(ParallelConfig(tp=4, cp=4, num_microbatches=16))
    enum = allowed.enumerate()
    assert {c.cp for c in enum.valid} == {1, 4}
    assert all(c.world_size == 16 for c in enum.valid)


def test_scored_pairs_are_the_trainers_masked_blocks() -> None:
    """Each local chunk c scores chunk-size x (c + 1) chunk-size pairs (trainer/context_parallel.py
    CPComm.attention); every rank the same under head-tail."""
    m = _at(64)
    for size in (2, 4, 8):
        p = ParallelConfig(cp=size)
        chunk = m.seq_len // (2 * size)
        for rank in range(size):
            pairs = sum(chunk * (c + 1) * chunk for c in head_tail_chunks(rank, size))
            assert pairs == context.scored_pairs(m, p)
    assert context.keys_per_query(m, ParallelConfig()) == 64


def test_cp_terms_add_up_and_kv_traffic_follows_the_kv_heads_and_the_tier() -> None:
    m = _at(131072)
    one_node = ParallelConfig(tp=2, cp=4, num_microbatches=8)  # 8 ranks: cp inside a node
    two_nodes = ParallelConfig(tp=2, cp=8, num_microbatches=8)  # 16 ranks: cp across 2 nodes
    inside, across = estimate(m, one_node, H100), estimate(m, two_nodes, H100)
    for est in (inside, across):
        assert est.step_time_s == pytest.approx(sum(est.terms.as_dict().values()))
    assert inside.terms.cp_comm_intra_s > 0 and inside.terms.cp_comm_inter_s == 0
    assert across.terms.cp_comm_inter_s > 0 and across.terms.cp_comm_intra_s == 0
    assert estimate(m, ParallelConfig(tp=2, num_microbatches=8), H100).terms.cp_comm_intra_s == 0
    # GQA: 8 KV heads of 32 move a quarter of what multi-head attention's K/V would
    mha = dataclasses.replace(m, num_kv_heads=m.num_heads)
    c = default_constants(H100)
    gqa, heads = Case(m, one_node, "bf16", c, H100), Case(mha, one_node, "bf16", c, H100)
    assert context.kv_bytes(heads) == 4 * context.kv_bytes(gqa)
    assert context.kv_traffic(heads).total > 3 * context.kv_traffic(gqa).total


def test_cp_divides_activations_but_keeps_the_gathered_keys() -> None:
    m, c = _at(32768), default_constants(H100)
    alone = memory(m, ParallelConfig(dp_shard=4, zero_stage=3), "bf16", c)
    split = memory(m, ParallelConfig(dp_shard=2, cp=2, zero_stage=3), "bf16", c)
    # FSDP2 shards over dp_shard x cp: the same 4 ranks hold the same shards of the weights
    assert split["weights_bytes"] == pytest.approx(alone["weights_bytes"])
    # half the tokens, but every layer keeps the whole sequence's K and V
    assert split["activations_bytes"] < alone["activations_bytes"]
    gathered = context.gathered_kv_bytes(m, ParallelConfig(cp=2), 2) * m.num_layers
    assert gathered > 0 and split["activations_bytes"] > alone["activations_bytes"] / 2 + 0.9 * gathered


def _plan(seq_len: int) -> dict:
    spec = parse_spec({
        "model": "llama3.1-8b", "cluster": {"preset": "h100-80gb", "num_nodes": 8}, "num_gpus": 64,
        "training": {"global_batch_size": 64, "seq_len": seq_len},
        "space": {"tp": [1, 2, 4, 8], "pp": [1, 2], "micro_batch_size": [1], "zero_stage": [2, 3],
                  "activation_checkpoint": ["none", "full"], "sequence_parallel": [True],
                  "pp_schedule": ["1f1b"]},
    })  # fmt: skip
    return plan(spec, top=20)


def test_the_plan_uses_cp_at_128k_and_not_at_8k() -> None:
    """issue 28's "done when": at 131,072 tokens layouts with cp > 1 fit and the winner has one,
    its K/V term named; at 8,192 the same study prefers cp 1."""
    long, short = _plan(131072), _plan(8192)
    fits = [c for c in long["candidates"] if c["predicted"]["fits"]]
    assert fits and any(c["config"]["cp"] > 1 for c in fits)
    winner = long["candidates"][0]
    assert winner["config"]["cp"] > 1
    terms = winner["predicted"]["terms"]
    assert terms["cp_comm_intra_s"] + terms["cp_comm_inter_s"] > 0
    assert short["candidates"][0]["config"]["cp"] == 1
    assert any(c["config"]["cp"] > 1 for c in short["candidates"])  # searched, not chosen


def test_full_recompute_keeps_no_gathered_keys_and_the_masks_are_made_once() -> None:
    m = _at(131072)
    full = ParallelConfig(cp=8, dp_shard=8, zero_stage=3, activation_checkpoint="full")
    assert context.gathered_kv_bytes(m, full, 2) == 0  # only the layer input; the recompute holds them again
    none = dataclasses.replace(full, activation_checkpoint="none")
    chunk = 131072 // 16
    assert context.mask_bytes(m, none, 2) == 17 * chunk * chunk * 2  # (2cp + 1) L^2 in bf16
    # the same masks whatever the micro-batch and tp (broadcast over the batch and the heads)
    wider = dataclasses.replace(none, micro_batch_size=4, tp=2)
    assert context.mask_bytes(m, wider, 2) == context.mask_bytes(m, none, 2)
    assert context.mask_bytes(m, dataclasses.replace(none, cp=1), 2) == 0
    # one set per stage module: an interleaved rank holds one per virtual stage
    interleaved = dataclasses.replace(none, pp=2, virtual_stages=2, pp_schedule="interleaved_1f1b")
    assert context.mask_bytes(m, interleaved, 2) == 2 * context.mask_bytes(m, none, 2)


# Small Llama layouts with context parallelism against the oracle, simulated here (seconds each):
# the gathered K/V kept without full recompute, the explicit masks made once, FSDP2 over
# dp_shard x cp and over cp alone, TP + SP, a pipeline.
CP_LLAMA = dataclasses.replace(MODEL_PRESETS["llama-small"], num_layers=4, seq_len=2048)
CP_LAYOUTS = [
    pytest.param(ParallelConfig(cp=2, micro_batch_size=1, num_microbatches=2), id="cp2-none"),
    pytest.param(ParallelConfig(cp=2, dp_shard=2, zero_stage=3, activation_checkpoint="full",
                                micro_batch_size=1, num_microbatches=2), id="cp2-dps2-full"),
    pytest.param(ParallelConfig(cp=4, tp=2, sequence_parallel=True, activation_checkpoint="selective",
                                micro_batch_size=1, num_microbatches=2), id="cp4-tp2-selective"),
    pytest.param(ParallelConfig(cp=2, pp=2, dp_replicate=2, activation_checkpoint="full", micro_batch_size=1,
                                num_microbatches=4), id="cp2-pp2-full"),
    # FSDP2 over the cp ranks alone (dp_shard 1): the weights in cp shards
    pytest.param(ParallelConfig(cp=4, zero_stage=3, activation_checkpoint="selective", micro_batch_size=1,
                                num_microbatches=2), id="cp4-zero3-over-cp"),
]  # fmt: skip


@pytest.mark.oracle
@pytest.mark.parametrize("parallel", CP_LAYOUTS)
def test_cp_layouts_match_the_oracle(parallel: ParallelConfig) -> None:
    from trainer.contract.result import BenchmarkConfig

    assert_every_rank_matches_the_oracle(
        BenchmarkConfig(model=CP_LLAMA, parallel=parallel, device="cuda"), 0.03
    )


def test_the_external_samplers_tell_cp_layouts_apart() -> None:
    """cp2 dpr4 and cp1 dpr8 (8 ranks, tp 1, micro-batch 1) share every other knob: optuna and
    deephyper see cp as a knob whenever a candidate has it, so every layout stays reachable."""
    from tuner.outcome import Outcome
    from tuner.samplers.external import KNOBS, OptunaSampler

    space = SpaceSpec(tp=[1, 2], pp=[1], cp=[1, 2, 4, 8], micro_batch_size=[1], zero_stage=[0, 3],
                      sequence_parallel=[True], activation_checkpoint=["none"])  # fmt: skip
    valid = SearchSpace(_at(8192), 8, 8, 8, space).enumerate().valid
    assert {c.cp for c in valid} == {1, 2, 4, 8}
    sampler = OptunaSampler(valid, seed=0, kind="tpe")
    assert sampler.knobs[:3] == ("tp", "pp", "cp") and len(sampler.index) == len(valid)
    assert sampler.choices["cp"] == [1, 2, 4, 8]
    seen = set()
    while (config := sampler.ask()) is not None:
        seen.add(config)
        sampler.tell(config, Outcome(ok=True, tokens_per_s=1.0 + len(seen), step_time_s=1.0))
    assert seen == set(valid)
    without_cp = [c for c in valid if c.cp == 1]
    assert OptunaSampler(without_cp, seed=0).knobs == KNOBS  # a study without the axis: as before
