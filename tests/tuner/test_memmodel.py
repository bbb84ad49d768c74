"""The analytic memory model (tuner/cost/memory.py over each axis's part; its entry point
tuner/memmodel.py): the papers' numbers where the trainer agrees with them, the memory oracle's
recorded simulations where it does not (bench/memory_oracle.py)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.tuner.oracle_check import assert_every_rank_matches_the_oracle
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig
from tuner.cost.case import Case
from tuner.cost.data import model_state_bytes
from tuner.cost.layer import activation_bytes_per_token, layer_params
from tuner.cost.memory import phase_bytes, rank_bytes
from tuner.cost.pipeline import _ops_with_microbatches, in_flight, interleaved_order, v_idle, v_order
from tuner.hardware import cluster_preset
from tuner.perfconstants import ModelConstants
from tuner.perfmodel import estimate
from tuner.spec import ClusterSpec

GPT3 = ModelConfig(num_layers=96, hidden_size=12288, num_heads=96, seq_len=2048, vocab_size=51200)
FLASH, NO_FLASH = ModelConstants(), ModelConstants(flash_attention=False)
SBH = 2048 * 1 * 12288  # Korthikanti table 2's unit for GPT-3 175B, micro-batch 1: 25,165,824


def a100(nodes: int) -> ClusterSpec:
    return ClusterSpec(**{**cluster_preset("a100-80gb"), "num_nodes": nodes})


@pytest.mark.parametrize(
    ("zero", "gb"),
    # ZeRO (Rajbhandari et al. 2020) figure 1: a 7.5B-parameter model, 64-way data parallel,
    # K = 12: baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB per device.
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_model_state_matches_zero_figure_1(zero: int, gb: float) -> None:
    assert sum(model_state_bytes(7.5e9, "bf16", zero, 64)) / 1e9 == pytest.approx(gb, abs=0.05)


def _layer(tp: int = 8, **knobs) -> float:
    """One GPT-3 layer's activation bytes for one micro-batch of 1 sequence, bf16."""
    p = ParallelConfig(tp=tp, **knobs)
    return activation_bytes_per_token(GPT3, p, 2, FLASH) * 2048


def test_full_recompute_keeps_the_layer_input_as_korthikanti_counts_it() -> None:
    """Korthikanti sec. 4.1 / table 2: 2sbh per layer with full recompute, 2sbh/t with SP."""
    assert _layer(activation_checkpoint="full") == 2 * SBH
    assert _layer(activation_checkpoint="full", sequence_parallel=True) == 2 * SBH / 8


def test_without_recompute_the_layer_stores_korthikanti_less_dropout_masks() -> None:
    """Table 2: sbh (10 + 24/t + 5as/(ht)) bytes. Dropout 0 stores no masks (2 sbh), SDPA no
    scores (5as/(ht) sbh); it stores its fp32 log-sum-exp (4as/t bytes) and the norms their fp32
    mean and rstd (16 s b bytes) instead."""
    extra = 4 * 96 / 8 * 2048 + 16 * 2048
    assert _layer() == pytest.approx(SBH * (10 + 24 / 8) - 2 * SBH + extra)
    scores = 5 * 96 * 2048 / (12288 * 8) * SBH
    no_flash = activation_bytes_per_token(GPT3, ParallelConfig(tp=8), 2, NO_FLASH) * 2048
    assert no_flash - _layer() == pytest.approx(scores)


def test_sequence_parallel_keeps_the_norm_output_shards() -> None:
    """Korthikanti sec. 4.2.2: 34 sbh/t with SP. The trainer keeps the two norm outputs' shards
    (2 x 2sbh/t) for its linears and gathers them again in the backward, as Megatron-LM does
    (trainer/model.py gather_again; torch's SequenceParallel alone would keep them all-gathered,
    2 x 2sbh, as the trainer did until issue 37); under autocast the linears' own casts stay whole."""
    sp = _layer(sequence_parallel=True, activation_checkpoint="selective")
    korthikanti = 34 * SBH / 8 - 2 * SBH / 8  # less the dropout masks' 2 sbh/t
    assert sp - 16 * 2048 / 8 == pytest.approx(korthikanti)


def test_selective_recompute_saves_only_the_log_sum_exp_under_sdpa() -> None:
    assert _layer() - _layer(activation_checkpoint="selective") == pytest.approx(4 * 96 / 8 * 2048)


@pytest.mark.parametrize(
    ("schedule", "v", "stage", "inflight"),
    [("gpipe", 1, 0, 64), ("1f1b", 1, 0, 8), ("1f1b", 1, 7, 1), ("1f1b", 1, 3, 5),
     # Korthikanti sec. 4.2.3: the first rank x (1 + (p - 1)/(p v))
     ("interleaved_1f1b", 2, 0, 8 * (1 + 7 / 16)), ("interleaved_1f1b", 4, 0, 8 * (1 + 7 / 32))],
)  # fmt: skip
def test_microbatches_in_flight_follow_the_schedule(
    schedule: str, v: int, stage: int, inflight: float
) -> None:
    """Narayanan et al. 2021 sec. 2.2: GPipe keeps all m, 1F1B at most pp - stage."""
    p = ParallelConfig(tp=8, pp=8, num_microbatches=64, pp_schedule=schedule, virtual_stages=v)
    assert in_flight(p, stage) == pytest.approx(inflight)


def test_175b_on_one_node_does_not_fit_but_on_64_gpus_it_can() -> None:
    one_node = estimate(GPT3, ParallelConfig(tp=8, micro_batch_size=1, num_microbatches=8), a100(1))
    assert not one_node.fits  # 175B x 16 bytes / 8 GPUs = 350 GB each
    spread = ParallelConfig(tp=8, pp=8, dp_shard=8, zero_stage=3, micro_batch_size=1, num_microbatches=16,
                            activation_checkpoint="selective", sequence_parallel=True)  # fmt: skip
    assert estimate(GPT3, spread, a100(64)).fits


def test_gpipe_holds_every_microbatch_1f1b_pp() -> None:
    base = ParallelConfig(tp=8, pp=8, dp_replicate=8, micro_batch_size=1, num_microbatches=64)
    one_f = estimate(GPT3, base, a100(64))
    gpipe = estimate(GPT3, dataclasses.replace(base, pp_schedule="gpipe"), a100(64))
    assert gpipe.activations_bytes > 6 * one_f.activations_bytes


# 2D tensor parallelism against the memory oracle, simulated here (a few seconds each): the
# column-split stream and norms, the row-split heads and ffn repeated on every column rank.
COLUMN_LAYOUTS = [
    pytest.param(ParallelConfig(tp_col=2, micro_batch_size=2, num_microbatches=2), id="col2"),
    pytest.param(
        ParallelConfig(tp=2, tp_col=2, dp_shard=2, zero_stage=3, micro_batch_size=2, num_microbatches=2),
        id="2x2-zero3",
    ),
    pytest.param(ParallelConfig(tp_col=2, pp=2, micro_batch_size=1, num_microbatches=4), id="col2-pp2"),
    pytest.param(
        ParallelConfig(tp_col=4, activation_checkpoint="full", micro_batch_size=2, num_microbatches=2),
        id="col4-full-ac",
    ),
]


@pytest.mark.oracle
@pytest.mark.parametrize("parallel", COLUMN_LAYOUTS)
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_column_degree_matches_the_oracle(parallel: ParallelConfig, device: str) -> None:
    from trainer.contract.result import BenchmarkConfig
    from trainer.memcheck import memcheck
    from tuner.memmodel import memory

    model = ModelConfig(num_layers=8, hidden_size=128, num_heads=4, vocab_size=1024, seq_len=256)
    oracle = memcheck(BenchmarkConfig(model=model, parallel=parallel, device=device)).peak_bytes
    c = ModelConstants(memory_scale=1.0, workspace_bytes=0.0)
    predicted = memory(model, parallel, "bf16" if device == "cuda" else "fp32", c)["memory_bytes"]
    assert abs(predicted - oracle) / oracle < 0.03, (predicted, oracle)


# bf16 without data parallelism is the trainer's autocast, not FSDP2's mixed precision: q, k and v
# keep their own casts of the norm output, and no bf16 weight gradients appear (GPU mode).
AUTOCAST_LAYOUTS = [
    pytest.param(ParallelConfig(micro_batch_size=2, num_microbatches=2), id="one-rank"),
    pytest.param(
        ParallelConfig(tp=2, sequence_parallel=True, micro_batch_size=2, num_microbatches=2), id="tp2-sp"
    ),
]


@pytest.mark.oracle
@pytest.mark.parametrize("parallel", AUTOCAST_LAYOUTS)
def test_autocast_layouts_match_the_oracle(parallel: ParallelConfig) -> None:
    from trainer.contract.result import BenchmarkConfig
    from trainer.memcheck import memcheck
    from tuner.memmodel import memory

    model = ModelConfig(num_layers=8, hidden_size=128, num_heads=4, vocab_size=1024, seq_len=256)
    oracle = memcheck(BenchmarkConfig(model=model, parallel=parallel, device="cuda")).peak_bytes
    c = ModelConstants(memory_scale=1.0, workspace_bytes=0.0)
    predicted = memory(model, parallel, "bf16", c)["memory_bytes"]
    assert abs(predicted - oracle) / oracle < 0.02, (predicted, oracle)


# --- the Llama family (issue 26) ---------------------------------------------------------------

LLAMA_8B = MODEL_PRESETS["llama3.1-8b"]  # h 4096, 32 heads / 8 KV heads, ffn 14336


@pytest.mark.parametrize(
    ("cb", "res", "device", "per_token"),
    [
        # FSDP2 in bf16 on GPUs: each norm keeps its bf16 input (the residual stream) and its output,
        # q and the attention output 2 x 4096, k and v their 8 KV heads (2 x 1024), SwiGLU's four
        # ffn-wide tensors, fp32 LSE and rstd
        (2, 2, "gpu", 2 * 2 * 4096 + 2 * 2 * 4096 + 2 * (2 * 4096 + 2 * 1024 + 4 * 14336) + 4 * 32 + 2 * 4),
        # autocast (bf16 without DP): an fp32 residual; q, k, v, gate and up cast the norm outputs apiece
        (2, 4, "gpu", 2 * 4 * 4096 + 5 * 2 * 4096 + 2 * (2 * 4096 + 2 * 1024 + 4 * 14336) + 4 * 32 + 2 * 4),
        # fp32 on CPU: torch's composite RMSNorm keeps the (fp32) input and the normalised input
        (4, 4, "cpu", 2 * 8 * 4096 + 2 * 4 * 4096 + 4 * (2 * 4096 + 2 * 1024 + 4 * 14336) + 4 * 32 + 2 * 4),
    ],
)  # fmt: skip
def test_a_llama_layer_keeps_what_its_block_saves(cb: int, res: int, device: str, per_token: int) -> None:
    """docs/perfmodel.md, "Activations of the Llama block". GQA keeps k and v as their KV heads
    (SDPA's enable_gqa, no repeat): multi-head attention's 32 keep 2 x (4096 - 1024) values a token
    more; RoPE keeps nothing."""
    p = ParallelConfig()
    assert activation_bytes_per_token(LLAMA_8B, p, cb, FLASH, res, device) == per_token
    mha = dataclasses.replace(LLAMA_8B, num_kv_heads=None)
    assert activation_bytes_per_token(mha, p, cb, FLASH, res, device) == per_token + 2 * (4096 - 1024) * cb


def test_llama_tensor_and_sequence_parallelism_split_what_gpt_splits() -> None:
    """tp 8 with SP: the norms' inputs, outputs (their shards, gathered again in the backward) and
    statistics over t, the attention and the MLP over t."""
    p = ParallelConfig(tp=8, sequence_parallel=True)
    expected = (
        2 * 2 * 4096 / 8
        + 2 * 2 * 4096 / 8
        + 2 * (2 * 4096 + 2 * 1024 + 4 * 14336) / 8
        + 4 * 32 / 8
        + 2 * 4 / 8
    )
    assert activation_bytes_per_token(LLAMA_8B, p, 2, FLASH, 2) == pytest.approx(expected)


def _params(m: ModelConfig, p: ParallelConfig, stage: int) -> float:
    return rank_bytes(Case(m, p, "bf16", FLASH), stage).params


def test_a_tied_head_is_one_weight_on_one_stage_and_a_copy_on_each_end_of_a_pipeline() -> None:
    """Llama 3.2 1B ties its head to the token embedding: with pp 1 the one V x h weight is
    stored once; with a pipeline the first stage holds the embedding and the last a copy for the
    head (trainer/pipeline.py cuts stages from deep copies), as an untied model does."""
    tied = MODEL_PRESETS["llama3.2-1b"]
    untied = dataclasses.replace(tied, tie_embeddings=False)
    h, v, layer = tied.hidden_size, tied.vocab_size, tied.num_layer_params
    one = ParallelConfig()
    assert _params(tied, one, 0) == tied.num_params == 16 * layer + v * h + h
    assert _params(untied, one, 0) - _params(tied, one, 0) == v * h
    two = ParallelConfig(pp=2, num_microbatches=2)
    assert _params(tied, two, 0) == _params(untied, two, 0) == 8 * layer + v * h
    assert _params(tied, two, 1) == _params(untied, two, 1) == 8 * layer + v * h + h


# Small Llama layouts against the oracle, simulated here (a few seconds each): FSDP2 and
# replicated DP, autocast, recompute, a 1F1B pipeline, a tied head on both ends of it.
SMALL_LLAMA = dataclasses.replace(MODEL_PRESETS["llama-small"], num_layers=8, seq_len=256)
LLAMA_LAYOUTS = [
    pytest.param(SMALL_LLAMA, ParallelConfig(micro_batch_size=2, num_microbatches=2), id="one-rank"),
    pytest.param(
        SMALL_LLAMA,
        ParallelConfig(
            dp_shard=2, zero_stage=3, micro_batch_size=2, num_microbatches=2, activation_checkpoint="full"
        ),
        id="zero3-full-ac",
    ),
    pytest.param(
        SMALL_LLAMA,
        ParallelConfig(
            dp_replicate=2, micro_batch_size=2, num_microbatches=3, activation_checkpoint="selective"
        ),
        id="replicated-selective",
    ),
    pytest.param(
        dataclasses.replace(SMALL_LLAMA, tie_embeddings=True),
        ParallelConfig(pp=2, dp_replicate=2, micro_batch_size=2, num_microbatches=4),
        id="tied-pp2",
    ),
    # Qwen3's RMSNorm on each head of q and k (wider heads than h / heads), OLMoE's over the projections
    pytest.param(
        dataclasses.replace(SMALL_LLAMA, attention_head_dim=64, qk_norm="head"),
        ParallelConfig(
            dp_shard=2,
            zero_stage=2,
            micro_batch_size=2,
            num_microbatches=2,
            activation_checkpoint="selective",
        ),
        id="qk-norm-head",
    ),
    pytest.param(
        dataclasses.replace(SMALL_LLAMA, qk_norm="proj"),
        ParallelConfig(micro_batch_size=2, num_microbatches=2),
        id="qk-norm-proj-autocast",
    ),
]


@pytest.mark.oracle
@pytest.mark.parametrize(("model", "parallel"), LLAMA_LAYOUTS)
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_llama_block_matches_the_oracle_on_every_stage(
    model: ModelConfig, parallel: ParallelConfig, device: str
) -> None:
    from trainer.contract.result import BenchmarkConfig

    assert_every_rank_matches_the_oracle(BenchmarkConfig(model=model, parallel=parallel, device=device), 0.03)


# Op-level checkpointing (torchtitan's SelectiveAC policy, trainer/parallelize.py): what it keeps of
# a block (tuner.cost.layer.op_checkpoint) matched the oracle to the byte on these layouts (the
# peak's difference from the same layout without it); the recompute's transient is an upper
# bound (up to +2 % beside the layout without it: llama pp2's first rank).
OP_LAYOUTS = [
    pytest.param(SMALL_LLAMA, ParallelConfig(tp=2, sequence_parallel=True, micro_batch_size=2,
                                             activation_checkpoint="op"), "cuda", id="cuda-tp2-sp"),
    pytest.param(SMALL_LLAMA, ParallelConfig(dp_shard=2, zero_stage=3, micro_batch_size=2, num_microbatches=2,
                                             activation_checkpoint="op"), "cpu", id="cpu-zero3"),
    pytest.param(SMALL_LLAMA, ParallelConfig(pp=2, micro_batch_size=2, num_microbatches=4,
                                             activation_checkpoint="op"), "cuda", id="cuda-pp2"),
]  # fmt: skip


@pytest.mark.oracle
@pytest.mark.parametrize(("model", "parallel", "device"), OP_LAYOUTS)
def test_op_level_checkpointing_matches_the_oracle(
    model: ModelConfig, parallel: ParallelConfig, device: str
) -> None:
    from trainer.contract.result import BenchmarkConfig

    assert_every_rank_matches_the_oracle(BenchmarkConfig(model=model, parallel=parallel, device=device), 0.04)


def test_op_level_checkpointing_keeps_every_other_matmul_attention_and_the_input() -> None:
    """A Llama block at tp 1, bf16 with an fp32 residual: q (1st matmul), v (3rd), SDPA's output and
    log-sum-exp, the gate (5th) and the down projection (7th), and the block's input; k, the
    out-projection and up (2nd, 4th, 6th) recomputed. 2,192 B a token on llama-small: the oracle's
    per-layer growth less autocast's weight cache (bench: docs/benchmarks.md)."""
    m = MODEL_PRESETS["llama-small"]
    h, q, kv, f = m.hidden_size, m.q_size, m.kv_size, m.ffn_size
    expected = 4 * h + 2 * (q + kv + q + f + h) + 4 * m.num_heads
    op = ParallelConfig(activation_checkpoint="op")
    assert activation_bytes_per_token(m, op, 2, ModelConstants(), 4, "gpu") == expected == 2192
    # on CPU the attention kernel is not among the ops the policy keeps
    assert (
        activation_bytes_per_token(m, op, 2, ModelConstants(), 4, "cpu") == expected - 2 * q - 4 * m.num_heads
    )


@pytest.mark.parametrize("preset", ["llama3.1-8b", "gpt-22b", "qwen3-30b-a3b"])
def test_op_level_checkpointing_sits_between_none_and_full(preset: str) -> None:
    """In memory full < op < none, in step time none < op < full (it recomputes every other matmul
    and the memory-bound work, not attention)."""
    m = MODEL_PRESETS[preset]
    base = dict(
        tp=2, dp_shard=4, zero_stage=3, sequence_parallel=True, micro_batch_size=1, num_microbatches=4
    )
    if m.moe:
        base["ep"] = 4
    h100 = ClusterSpec(**{**cluster_preset("h100-80gb"), "num_nodes": 1})
    est = {
        ac: estimate(m, ParallelConfig(**base, activation_checkpoint=ac), h100)
        for ac in ("none", "op", "full")
    }
    assert est["full"].memory_bytes < est["op"].memory_bytes < est["none"].memory_bytes
    assert est["none"].step_time_s < est["op"].step_time_s < est["full"].step_time_s


# Moments of a pipelined step the Llama suite found missing (bench/memory_oracle.py --suite llama),
# as true of GPT's block: (model, layout, pipeline rank, the model's error on main before).
SMALL_GPT = ModelConfig(num_layers=8, hidden_size=128, num_heads=4, vocab_size=1024, seq_len=256)
MOMENT_LAYOUTS = [
    # 1F1B with no more micro-batches than stages after the first: every forward precedes the
    # first backward, as with GPipe, so no gradient has accumulated at the activations' peak
    # (+13.9 %, +15.0 %: the model added whole fp32 gradients)
    pytest.param(SMALL_GPT, ParallelConfig(pp=2, dp_replicate=2, micro_batch_size=2, num_microbatches=2), 0,
                 id="1f1b-n-equals-pp"),
    pytest.param(SMALL_GPT, ParallelConfig(pp=4, dp_replicate=2, micro_batch_size=1, num_microbatches=4), 0,
                 id="1f1b-pp4-n-equals-pp"),
    # GPipe's second loss: the first backward's gradients and the later micro-batches' logits at
    # once (-7.3 % at 16 layers; Llama 3.1 8B tp1 pp2 GPipe on 64 GPUs: -10.3 %, a 128256-token
    # vocabulary). 8 layers since issue 37 (make test's budget): the logits weigh more there
    pytest.param(dataclasses.replace(SMALL_LLAMA, num_layers=8, seq_len=64, vocab_size=8192),
                 ParallelConfig(pp=2, dp_shard=2, zero_stage=3, micro_batch_size=1, num_microbatches=4,
                                pp_schedule="gpipe", activation_checkpoint="full"), 1, id="gpipe-second-loss"),
]  # fmt: skip


@pytest.mark.oracle
@pytest.mark.parametrize(("model", "parallel", "stage"), MOMENT_LAYOUTS)
def test_pipeline_moments_match_the_oracle(model: ModelConfig, parallel: ParallelConfig, stage: int) -> None:
    from trainer.contract.result import BenchmarkConfig
    from trainer.memcheck import memcheck, rank_of

    cfg = BenchmarkConfig(model=model, parallel=parallel, device="cuda")
    oracle = memcheck(cfg, ranks=[rank_of(parallel, pp=stage)]).peak_bytes
    c = ModelConstants(memory_scale=1.0, workspace_bytes=0.0)
    phases = phase_bytes(Case(model, parallel, "bf16", c), stage)
    predicted = max(sum(parts.values()) for parts in phases.values())
    assert abs(predicted - oracle) / oracle < 0.03, (predicted, oracle)


# The V schedules as torch runs them (tuner/cost/pipeline.py v_moments): the activations kept to the
# weight half, the gradients the input half keeps for it, the input's gradient, the first stage's
# whole backward in its weight half, ZeRO-3's layers left gathered. Measured (model vs oracle, GPU
# kernels): GPT zbv pp4 +3.4 / -3.2 % (1F1B on the same shape +2.4 / -0.5 %), dualpipev pp2 -0.4 /
# +1.9 %, MoE zbv pp2 ZeRO-3 ep2 -0.8 / -3.0 %.
V_LAYOUTS = [
    pytest.param(SMALL_GPT, ParallelConfig(pp=4, pp_schedule="zbv", virtual_stages=2, micro_batch_size=1,
                                           num_microbatches=8), id="gpt-zbv-pp4"),
    pytest.param(SMALL_GPT, ParallelConfig(pp=2, dp_replicate=2, pp_schedule="dualpipev", virtual_stages=2,
                                           micro_batch_size=1, num_microbatches=8), id="gpt-dualpipev-pp2"),
    pytest.param(dataclasses.replace(MODEL_PRESETS["moe-tiny"], num_layers=8, hidden_size=256, moe_ffn_hidden_size=256,
                                     ffn_hidden_size=512, seq_len=256, vocab_size=1024),
                 ParallelConfig(pp=2, dp_shard=2, zero_stage=3, ep=2, pp_schedule="zbv", virtual_stages=2,
                                micro_batch_size=1, num_microbatches=4), id="moe-zbv-zero3-ep2"),
]  # fmt: skip


@pytest.mark.oracle
@pytest.mark.parametrize(("model", "parallel"), V_LAYOUTS)
def test_the_v_schedules_match_the_oracle(model: ModelConfig, parallel: ParallelConfig) -> None:
    from trainer.contract.result import BenchmarkConfig

    cfg = BenchmarkConfig(model=model, parallel=parallel, device="cuda", moe_routing="balanced")
    assert_every_rank_matches_the_oracle(cfg, 0.04)


@pytest.mark.parametrize(
    ("pp", "v", "n"), [(4, 2, 4), (4, 2, 8), (2, 4, 6), (8, 2, 16), (3, 3, 3), (4, 2, 12)]
)
def test_the_interleaved_order_is_torchs(pp: int, v: int, n: int) -> None:
    """tuner.cost.pipeline.interleaved_order walks a rank's forwards and backwards as torch's
    ScheduleInterleaved1F1B computes them (the model cannot import torch)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)  # its tables, no stages
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, v, n
    schedule.number_of_rounds = max(1, n // pp)
    schedule.microbatches_per_round = n // schedule.number_of_rounds
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    for rank in range(pp):
        ops = [a for a in schedule._calculate_single_rank_operations(rank) if a is not None]
        assert interleaved_order(pp, v, n, rank) == [
            (kinds[a.computation_type], a.stage_index // pp) for a in ops
        ]
        # ... and their micro-batches, which say when a held send is let go (_released)
        assert _ops_with_microbatches(pp, v, n, rank) == [
            (kinds[a.computation_type], a.stage_index // pp, a.microbatch_index) for a in ops
        ]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize(("pp", "n"), [(2, 4), (2, 5), (4, 8), (4, 9), (3, 7), (8, 24)])
def test_the_v_orders_are_torchs(schedule: str, pp: int, n: int) -> None:
    """tuner.cost.pipeline.v_order walks a V rank's forwards, backwards and split halves as torch's
    ScheduleZBVZeroBubble and ScheduleDualPipeV compute them (paired steps flattened)."""
    from torch.distributed.pipelining import schedules

    cls = {"zbv": schedules.ScheduleZBVZeroBubble, "dualpipev": schedules.ScheduleDualPipeV}[schedule]
    kinds = {schedules.FORWARD: "F", schedules.FULL_BACKWARD: "B", schedules.BACKWARD_INPUT: "I",
             schedules.BACKWARD_WEIGHT: "W"}  # fmt: skip
    for rank in range(pp):
        runner = cls.__new__(cls)  # its tables, no stages
        runner.pp_group_size, runner._n_microbatches, runner.n_local_stages = pp, n, 2
        runner._num_stages = runner.num_stages = 2 * pp
        runner.rank = rank
        want = [
            (kinds[a.computation_type], 0 if a.stage_index == rank else 1, a.microbatch_index)
            for action in runner._calculate_single_rank_operations(rank)
            if action is not None
            for a in (action.sub_actions or (action,))
        ]
        assert list(v_order(schedule, pp, n, rank)) == want


def test_a_v_schedules_bubble_is_smaller_than_interleaved_and_1f1b() -> None:
    """The bubble in stage-times (a rank's forward and backward of a micro-batch): 1F1B pp - 1,
    interleaved over two stages a rank (pp - 1) / 2, the V schedules' walked orders less with
    weight halves to move into the gaps, more without (no weight GEMMs: nothing to move)."""
    for pp, n in ((4, 16), (8, 32)):
        for schedule in ("zbv", "dualpipev"):
            split = v_idle(schedule, pp, n, 1 / 3)
            assert split < (pp - 1) / 2 < pp - 1
            assert v_idle(schedule, pp, n, 0.0) > split
    # forward, input and weight halves alike (1/6 of a stage-time each): one forward per rank short
    assert v_idle("zbv", 8, 32, 1 / 3) == pytest.approx(7 / 6, rel=0.01)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_the_interleaved_walk_without_its_middle_periods_finds_the_same_peak(
    zero_stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tuner.cost.pipeline._walk leaves out the steady state's middle periods (adding their held
    sends at once): the same peak moment on every rank as the whole walk, to rounding, for 1F1B
    rounds of pp micro-batches and for uneven ones (n not a multiple of pp)."""
    import tuner.cost.pipeline as pipeline

    m = MODEL_PRESETS["llama3.1-8b"]
    c = ModelConstants()
    for pp, v, n in [(4, 2, 64), (8, 4, 96), (4, 3, 50), (2, 2, 7), (16, 2, 160)]:
        p = ParallelConfig(pp=pp, virtual_stages=v, num_microbatches=n, pp_schedule="interleaved_1f1b",
                           dp_shard=2, zero_stage=zero_stage)  # fmt: skip
        short = [phase_bytes(Case(m, p, "bf16", c), stage) for stage in range(pp)]
        assert any(pipeline._walk(pp, v, n, stage)[2] for stage in range(pp)) == (n >= 4 * pp)
        with monkeypatch.context() as patched:
            patched.setattr(pipeline, "_walk", whole_walk)
            whole = [phase_bytes(Case(m, p, "bf16", c), stage) for stage in range(pp)]
        for a, b in zip(short, whole, strict=True):
            assert a.keys() == b.keys()
            for phase in a:
                assert a[phase] == pytest.approx(b[phase], rel=1e-12), (pp, v, n, phase)


def whole_walk(pp: int, v: int, n: int, rank: int) -> tuple:
    """tuner.cost.pipeline._walk without leaving anything out."""
    import tuner.cost.pipeline as pipeline

    order, released = pipeline._order(pp, v, n, rank), pipeline._released(pp, v, n, rank)
    return tuple((kind, j, r) for (kind, j), r in zip(order, released, strict=True)), 0, ()


@pytest.mark.oracle
def test_an_interleaved_rank_holds_its_sends_and_its_own_stages_gradients() -> None:
    """Llama-small, 8 layers, pp 4 x v 2, 4 micro-batches, against the oracle: +5 to +22 % by
    rank when the model counted every micro-batch's sends from the start and every local stage's
    gradients at the first backward (+1.0 to +4.4 % since; the last rank's peak comes at its
    second loss, with its last local stage's gradients only: the head's and a layer's)."""
    m = dataclasses.replace(MODEL_PRESETS["llama-small"], num_layers=8, seq_len=256)
    p = ParallelConfig(pp=4, virtual_stages=2, num_microbatches=4, dp_shard=2, zero_stage=2,
                       activation_checkpoint="selective", pp_schedule="interleaved_1f1b")  # fmt: skip
    assert_every_rank_matches_the_oracle(
        BenchmarkConfig(model=m, parallel=p, device="cuda", dtype="bf16"), 0.05
    )
    c = ModelConstants(memory_scale=1.0, workspace_bytes=0.0)
    case = Case(m, p, "bf16", c)
    last, r = phase_bytes(case, 3)["forward_backward"], rank_bytes(case, 3)
    # at its second micro-batch's loss: the fp32 gradients of the head and of its layer, whole
    assert last["grads"] == pytest.approx(4 * (r.root / r.cb + layer_params(m, 1)), rel=1e-6)


@pytest.mark.oracle
@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(pp=2, dp_shard=2, zero_stage=2, micro_batch_size=2, num_microbatches=4),
        ParallelConfig(dp_replicate=2, micro_batch_size=2, num_microbatches=4),
    ],
    ids=["pp2-dps2-z2", "dpr2-accumulating"],
)
def test_bf16_gradient_reduction_matches_the_oracle(parallel: ParallelConfig, device: str) -> None:
    """grad_reduce_dtype bf16 (FSDP2's and replicate's reduce_dtype): a pipeline's and no_sync's
    gradients accumulate whole in bf16, half the fp32 default's, and land in fp32 at the last
    backward's reduce (tuner/cost/memory.py forward_backward's `landed` moment). The oracle's peak
    falls, and the model follows it on every rank."""
    model = dataclasses.replace(MODEL_PRESETS["llama-small"], num_layers=4, seq_len=256)
    peaks = {}
    for dtype in ("fp32", "bf16"):
        cfg = BenchmarkConfig(model=model, parallel=parallel, device=device, grad_reduce_dtype=dtype)
        peaks[dtype] = assert_every_rank_matches_the_oracle(cfg, 0.05).peak_bytes
    assert peaks["bf16"] < peaks["fp32"], peaks


def test_the_studys_gradient_dtype_reaches_the_trials_and_the_pricing() -> None:
    """training.grad_reduce_dtype: validated at the spec (the field named), carried to the trials'
    BenchmarkConfig and to the pricing, where a pipeline's accumulated gradients halve."""
    from tuner.pricing import Pricing
    from tuner.spec import benchmark_config, parse_spec

    base = {"model": "llama3.1-8b", "cluster": "h100-80gb", "num_gpus": 8}
    with pytest.raises(ValueError, match=r"training.grad_reduce_dtype"):
        parse_spec({**base, "training": {"global_batch_size": 64, "grad_reduce_dtype": "fp16"}})
    layout = ParallelConfig(pp=2, dp_shard=4, zero_stage=2, num_microbatches=16)
    memory = {}
    for dtype in ("fp32", "bf16"):
        spec = parse_spec({**base, "training": {"global_batch_size": 64, "grad_reduce_dtype": dtype}})
        assert benchmark_config(spec, layout).grad_reduce_dtype == dtype
        pricing = Pricing.for_study(spec)
        assert pricing.grad_reduce_dtype == dtype
        memory[dtype] = pricing.estimate(layout).memory_bytes
    params = rank_bytes(Case(MODEL_PRESETS["llama3.1-8b"], layout, "bf16", ModelConstants()), 0).params
    halved = 2 * params * ModelConstants().memory_scale  # the dense gradients' bytes saved, scaled
    assert memory["fp32"] - memory["bf16"] == pytest.approx(halved, rel=0.02)
