"""What the exports (tuner/export.py) add for context parallelism (ParallelConfig.cp): each sequence
split over cp ranks, head-tail (2 x cp chunks, rank r holds chunks r and 2cp-1-r), K/V all-gathered
over the cp group before attention (trainer/context_parallel.py). Data parallelism spans dp x cp:
the cp ranks hold the same weights, their gradients are averaged with the dp ranks', and FSDP2
shards over dp_shard x cp.

torchtitan 0.3.0 (read from its source):
- `parallelism.context_parallel_degree` and `context_parallel_load_balancer` ("headtail", its
  default: torch's _HeadTailLoadBalancer gives rank r chunks r and 2cp-1-r, as ours; "ptrr" or
  None otherwise). The export sets both.
- Attention: language models run FlexAttention only ("sdpa is no longer supported for language
  models": models/common/config_utils.py), and with cp > 1 its default spmd_types backend refuses
  SDPA and varlen (distributed/full_dtensor.py: validate_config; llama3/qwen3 update_from_config
  refuse varlen too). K/V are all-gathered over cp at the attention's local_map boundary
  (models/common/decoder_sharding.py: set_gqa_inner_attention_local_map), as ours.
- FSDP always spans dp_shard x cp when cp > 1 (distributed/parallel_dims.py: "fsdp" mesh), even
  without dp_shard: a zero_stage 0 layout's weights are then sharded over cp.
- Trainer.__init__ (trainer.py) requires seq_len divisible by 2 x cp x (tp with sequence
  parallelism), stricter than our trainer's seq_len / cp divisible by tp.
- Expert parallelism borrows from dp_shard x cp x tp (tuner/export_moe.py).

Megatron-LM (megatron-core 0.19.2):
- `--context-parallel-size cp` and `--cp-comm-type all_gather` (Transformer Engine's
  AttnFuncWithCPAndKVAllGather: K/V all-gathered before attention, not overlapped; the default is
  the p2p ring). Its batch loader gives rank r chunks r and 2cp-1-r (megatron/core/utils.py:
  _get_batch_on_this_cp_rank_per_sequence_balancing), as ours; validate_args asserts seq_length
  divisible by 2 x cp, and, before Blackwell, CUDA_DEVICE_MAX_CONNECTIONS=1 with cp > 1 as with tp.
- Its data-parallel size excludes cp (world / (tp x pp x cp) = dp); gradients, the distributed
  optimizer and --use-torch-fsdp2 span dp x cp (get_data_parallel_group(with_context_parallel=True)).
- Only Transformer Engine's attention runs cp > 1 (core/transformer/dot_product_attention.py
  asserts cp 1), and its all_gather path refuses latent attention whose k and v heads differ in
  width (transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py:
  attn_forward_func_with_cp, "cannot support MLA": p2p or a2a+p2p only): refused.
"""

from __future__ import annotations

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig

TORCHTITAN_CP_LOAD_BALANCER = "headtail"
MEGATRON_CP_COMM_TYPE = "all_gather"


def describe_cp(m: ModelConfig, config: ParallelConfig) -> str:
    """The header's words for cp > 1 ('' without): the split and where data parallelism runs."""
    c = config
    if c.cp == 1:
        return ""
    return (
        f"cp {c.cp}: each sequence of {m.seq_len} in {2 * c.cp} head-tail chunks of {m.seq_len // (2 * c.cp)}, "
        f"{m.seq_len // c.cp} tokens a rank, K/V all-gathered over cp; data parallelism spans dp x cp "
        f"({c.dp} x {c.cp} = {c.dp * c.cp} ranks hold the same weights)"
    )


# --- torchtitan 0.3.0 ---


def torchtitan_cp_unsupported(m: ModelConfig, config: ParallelConfig) -> list[str]:
    c = config
    if c.cp == 1:
        return []
    divisor = 2 * c.cp * (c.tp if c.sequence_parallel else 1)
    if m.seq_len % divisor:
        sp = f" x tp ({c.tp}, sequence parallelism)" if c.sequence_parallel else ""
        return [
            f"seq_len ({m.seq_len}) is not a multiple of 2 x cp ({c.cp}){sp} = {divisor}: torchtitan's trainer "
            "requires it (trainer.py: Trainer.__init__), our trainer only seq_len / cp divisible by tp"
        ]
    return []


def torchtitan_cp_parallelism(config: ParallelConfig) -> list[str]:
    lines = [f"context_parallel_degree = {config.cp}"]
    if config.cp > 1:
        lines.append(
            f'context_parallel_load_balancer = "{TORCHTITAN_CP_LOAD_BALANCER}"  # chunks r and 2cp-1-r, as measured'
        )
    return lines


def torchtitan_cp_reshard(config: ParallelConfig, measured: str) -> str:
    """fsdp_reshard_after_forward: torchtitan applies FSDP over dp_shard x cp whenever cp > 1; for a
    zero_stage 0 layout 'never' keeps the gathered weights through backward, the nearest to replicas."""
    return "never" if config.cp > 1 and config.zero_stage == 0 else measured


def torchtitan_cp_notes(m: ModelConfig, config: ParallelConfig, *, builds: bool) -> list[str]:
    c = config
    if c.cp == 1:
        return []
    notes = [
        f"cp {c.cp}: context_parallel_load_balancer {TORCHTITAN_CP_LOAD_BALANCER!r} gives rank r chunks r and "
        f"2cp-1-r of {2 * c.cp}, as measured; torchtitan all-gathers K/V over cp at the attention (FlexAttention), "
        "as our trainer does (SDPA with an explicit mask per chunk).",
        "cp requires FlexAttention in torchtitan 0.3.0 (attn_backend 'flex' or 'flex_flash'): with cp > 1 its "
        "spmd_types backend refuses SDPA and varlen, and SDPA is no longer a language-model backend"
        + ("." if builds else "; the model you put in BASE must use it."),
        f"data parallelism spans dp x cp: torchtitan's FSDP runs over dp_shard x cp ({c.dp_shard} x {c.cp}) and "
        f"its loss over dp x cp, as measured.",
    ]
    if c.zero_stage == 0:
        notes.append(
            f"zero_stage 0 with cp {c.cp}: torchtitan always shards over dp_shard x cp with cp > 1 (its fsdp mesh), "
            "so weights are sharded over cp where the trainer replicated them; fsdp_reshard_after_forward 'never' "
            "keeps them gathered from forward to backward."
        )
    return notes


# --- Megatron-LM ---


def megatron_cp_unsupported(m: ModelConfig, config: ParallelConfig) -> list[str]:
    if config.cp == 1 or m.attention != "mla":
        return []
    k_width, v_width = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    if k_width == v_width:
        return []
    return [
        f"cp {config.cp} with latent attention (k heads of {k_width}, v heads of {v_width}): Transformer Engine's "
        f"--cp-comm-type {MEGATRON_CP_COMM_TYPE} (what our trainer measured) refuses k and v of different widths "
        "(attn_forward_func_with_cp: p2p or a2a+p2p only)"
    ]


def megatron_cp_args(config: ParallelConfig) -> list[tuple[str, object]]:
    if config.cp == 1:
        return []
    return [("--context-parallel-size", config.cp), ("--cp-comm-type", MEGATRON_CP_COMM_TYPE)]


def megatron_cp_notes(config: ParallelConfig) -> list[str]:
    c = config
    if c.cp == 1:
        return []
    return [
        f"cp {c.cp}: --cp-comm-type {MEGATRON_CP_COMM_TYPE} all-gathers K/V before attention (Transformer Engine), "
        "as measured (Megatron's default p2p passes them around a ring); its batch loader gives rank r chunks r "
        f"and 2cp-1-r of {2 * c.cp}, as ours. It needs Transformer Engine's attention (the default "
        "--transformer-impl; Megatron's local attention refuses cp > 1).",
        f"data parallelism spans dp x cp: Megatron's data-parallel size is {c.dp} (world / (tp x pp x cp)), and "
        f"its gradients and optimizer shards span dp x cp ({c.dp * c.cp} ranks), as measured.",
    ]
