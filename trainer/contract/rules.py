"""The layout rules of each axis: what a ParallelConfig must satisfy to run a model. Each function
is one axis's validity hook in the axis table (trainer/contract/axes.py) and returns (rule,
message) pairs: the rule a stable short text (rejections are counted by it), the message with the
numbers. Torch-free."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.contract.model import ModelConfig
    from trainer.contract.parallel import ParallelConfig

Violations = list[tuple[str, str]]

# zero_stage -> FSDP2 mode (docs/parallelism.md): 0 no sharding, 2 fully_shard without resharding
# after forward (params, grads, optimizer state sharded between steps; params whole during
# forward+backward), 3 fully_shard resharding after forward. Stage 1 is not offered: FSDP2 cannot
# shard optimizer state alone, and stage 2 moves the same bytes (reduce-scatter + all-gather =
# all-reduce) while holding less.
ZERO_STAGES = (0, 2, 3)
ACTIVATION_CHECKPOINTS = (
    "none", "selective", "moe_act", "layernorm", "layernorm+moe_act", "mla_up_proj", "mla_up_proj+moe_act",
    "layernorm+mla_up_proj+moe_act", "op", "full", "offload",
)  # fmt: skip
# Megatron's --recompute-modules the values above combine (trainer/model.py, trainer/moe.py)
RECOMPUTE_MODULES = ("layernorm", "mla_up_proj", "moe_act")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
# Two stages a rank placed in a V (rank r: stages r and 2 pp - 1 - r), backward split into its input
# and weight halves (torch.distributed.pipelining's ScheduleZBVZeroBubble and ScheduleDualPipeV)
V_SCHEDULES = ("zbv", "dualpipev")
# Schedules with more than one stage a rank (virtual_stages > 1)
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", *V_SCHEDULES)


def tp_rules(p: ParallelConfig, model: ModelConfig) -> Violations:
    out = []
    if model.num_heads % p.tp:
        out.append(("tp must divide num_heads", f"tp ({p.tp}) must divide num_heads ({model.num_heads})"))
    if model.kv_heads % p.tp:
        out.append((
            "tp must divide num_kv_heads",
            f"tp ({p.tp}) must divide num_kv_heads ({model.kv_heads}): each rank holds whole KV heads "
            "(Megatron's num_query_groups % tp, torchtitan's n_kv_heads % tp)",
        ))  # fmt: skip
    if model.ffn_size % p.tp:
        out.append((
            "tp must divide ffn_hidden_size", f"tp ({p.tp}) must divide ffn_hidden_size ({model.ffn_size})"
        ))  # fmt: skip
    if model.vocab_size % p.tp:
        out.append((
            "tp must divide vocab_size",
            f"tp ({p.tp}) must divide vocab_size ({model.vocab_size}): the embedding and head are "
            "vocab-parallel; pad the vocabulary",
        ))  # fmt: skip
    if model.hidden_size % p.tp_col:
        out.append((
            "tp_col must divide hidden_size",
            f"tp_col ({p.tp_col}) must divide hidden_size ({model.hidden_size}): the residual "
            "stream is split over the column group",
        ))  # fmt: skip
    if p.sequence_parallel and p.tp_col > 1:
        out.append((
            "sequence_parallel needs tp_col 1",
            "sequence_parallel with tp_col > 1 is not implemented (2D tensor parallelism keeps "
            "every token on every rank)",
        ))  # fmt: skip
    if p.sequence_parallel and p.tp == 1:
        out.append(("sequence_parallel needs tp > 1", "sequence_parallel needs tp > 1"))
    if p.sequence_parallel and p.cp == 1 and model.seq_len % p.tp:
        out.append((
            "sequence_parallel needs tp to divide seq_len",
            f"sequence_parallel: tp ({p.tp}) must divide seq_len ({model.seq_len})",
        ))  # fmt: skip
    return out


def pp_rules(p: ParallelConfig, model: ModelConfig) -> Violations:
    out = []
    if p.pp_schedule not in PIPELINE_SCHEDULES:
        return []  # the schedule's own choice check names it (axes.py)
    if model.num_layers < p.num_stages:
        out.append((
            "every pipeline stage needs a layer",
            f"num_layers ({model.num_layers}) < pp ({p.pp}) * virtual_stages ({p.virtual_stages}): "
            "every pipeline stage needs a layer",
        ))  # fmt: skip
    interleaved = p.pp_schedule == "interleaved_1f1b"
    v_shaped = p.pp_schedule in V_SCHEDULES
    if p.virtual_stages > 1 and not (p.pp_schedule in MULTI_STAGE_SCHEDULES and p.pp > 1):
        out.append((
            "virtual_stages > 1 needs a multi-stage schedule with pp > 1",
            f"virtual_stages > 1 needs pp > 1 and pp_schedule one of {list(MULTI_STAGE_SCHEDULES)}",
        ))  # fmt: skip
    if p.pp == 1:
        return out
    if interleaved and p.virtual_stages < 2:
        out.append((
            "interleaved_1f1b needs virtual_stages >= 2",
            "pp_schedule 'interleaved_1f1b' needs virtual_stages >= 2",
        ))  # fmt: skip
    if v_shaped and p.virtual_stages != 2:
        out.append((
            "a V schedule needs virtual_stages 2",
            f"pp_schedule {p.pp_schedule!r} places two stages on each rank (a V): virtual_stages must be 2, "
            f"got {p.virtual_stages}",
        ))  # fmt: skip
    if v_shaped and p.activation_checkpoint in ("selective", "op", "full"):
        # torch's split backward keeps the graph from its input half to its weight half, and a
        # checkpointed block's recompute with it; the weight half recomputes again
        out.append((
            "a V schedule with block recompute is not priced",
            f"pp_schedule {p.pp_schedule!r} with activation_checkpoint {p.activation_checkpoint} holds more than "
            "the memory model prices (the memory oracle: Qwen3-30B-A3B tp1 pp2 ZBV with full recompute 71.4 "
            "GiB a rank, priced 46.0; its split backward's recompute, not yet traced); use none or a module "
            "recompute (moe_act, layernorm)",
        ))  # fmt: skip
    if v_shaped and p.num_microbatches < 2 * p.pp:
        out.append((
            "a V schedule needs num_microbatches >= 2 pp",
            f"pp_schedule {p.pp_schedule!r} needs num_microbatches ({p.num_microbatches}) >= its stages "
            f"(2 x pp = {2 * p.pp})",
        ))  # fmt: skip
    if p.pp_schedule == "1f1b" and p.num_microbatches < p.pp:
        out.append((
            "1F1B needs num_microbatches >= pp",
            f"1F1B needs num_microbatches ({p.num_microbatches}) >= pp ({p.pp})",
        ))  # fmt: skip
    if interleaved:
        rounds = max(1, p.num_microbatches // p.pp)
        if p.num_microbatches % rounds:
            out.append((
                "interleaved 1F1B needs num_microbatches to be a multiple of num_microbatches // pp",
                f"interleaved 1F1B needs num_microbatches ({p.num_microbatches}) to be a multiple of "
                f"num_microbatches // pp ({rounds})",
            ))  # fmt: skip
    return out


def zero_rules(p: ParallelConfig, model: ModelConfig) -> Violations:
    if p.zero_stage not in ZERO_STAGES:
        return [(
            "zero_stage not offered by the trainer",
            f"zero_stage {p.zero_stage} is not one of {list(ZERO_STAGES)} (1 is not offered: FSDP2 "
            "cannot shard optimizer state alone; 2 moves the same bytes)",
        )]  # fmt: skip
    if p.dp_shard > 1 and p.zero_stage == 0:
        return [
            ("dp_shard > 1 needs zero_stage 2 or 3", f"dp_shard ({p.dp_shard}) > 1 needs zero_stage 2 or 3")
        ]
    if p.dp_shard == 1 and p.zero_stage != 0 and p.cp == 1:
        return [(
            "zero_stage > 0 needs dp > 1",
            f"zero_stage {p.zero_stage} needs dp_shard > 1 or cp > 1 (FSDP2 shards over dp_shard x cp; "
            "got dp_shard 1, cp 1)",
        )]  # fmt: skip
    return []


def ep_rules(p: ParallelConfig, model: ModelConfig) -> Violations:
    """Mixture-of-experts rules: experts split whole over ep, ep folded into dp x tp, and each
    tensor-parallel rank routing its own tokens (sequence parallelism: experts are not split
    over tp, torchtitan's choice since it removed expert-TP; Megatron requires SP whenever
    EP > 1 and TP > 1)."""
    out = []
    if not model.moe:
        if p.ep > 1:
            out.append(("ep > 1 needs a mixture of experts", f"ep ({p.ep}) > 1 needs a model with experts"))
        return out
    if model.num_experts % p.ep:
        out.append((
            "ep must divide num_experts",
            f"ep ({p.ep}) must divide num_experts ({model.num_experts}): each rank holds whole experts",
        ))  # fmt: skip
    if p.cp == 1 and (p.dp * p.tp) % p.ep:
        out.append((
            "ep must divide dp x tp",
            f"ep ({p.ep}) must divide dp_replicate x dp_shard x tp ({p.dp * p.tp}): expert "
            "parallelism borrows the ranks of data and tensor parallelism (torchtitan's and Megatron's folding)",
        ))  # fmt: skip
    if p.cp > 1 and (p.dp * p.cp * p.tp) % p.ep:
        out.append((
            "ep must divide dp x cp x tp",
            f"ep ({p.ep}) must divide dp_replicate x dp_shard x cp x tp ({p.dp * p.cp * p.tp}): "
            "expert parallelism borrows the ranks of data, context and tensor parallelism (torchtitan's folding)",
        ))  # fmt: skip
    if p.tp_col > 1:
        out.append((
            "a mixture of experts needs tp_col 1",
            "a mixture of experts with tp_col > 1 is not implemented (2D tensor parallelism keeps every "
            "token on every rank of the column group)",
        ))  # fmt: skip
    if p.tp > 1 and not p.sequence_parallel:
        out.append((
            "a mixture of experts with tp > 1 needs sequence_parallel",
            f"a mixture of experts with tp ({p.tp}) > 1 needs sequence_parallel: each tensor-parallel "
            "rank routes its own tokens (experts are not split over tp; Megatron requires sequence "
            "parallelism when EP > 1 and TP > 1)",
        ))  # fmt: skip
    return out


def ac_rules(p: ParallelConfig, model: ModelConfig) -> Violations:
    """Activation offload (trainer/offload.py) with one stage a rank and 1D tensor parallelism,
    where the oracle checks it. Op-level checkpointing (trainer/parallelize.py op_sac_policy) runs where its memory is
    priced and checked against the oracle: 1D tensor parallelism without context parallelism.
    moe_act recomputes the routed experts' activation (trainer/moe.py GroupedExperts): a mixture
    of experts only."""
    ac = p.activation_checkpoint
    if ac == "offload":
        out = []
        if p.virtual_stages > 1:
            out.append((
                "offload needs one stage a rank",
                f"activation_checkpoint offload with {p.pp_schedule} ({p.virtual_stages} stages a rank) is not "
                "priced yet (its memory walk has no offloaded moment); use 1f1b or gpipe",
            ))  # fmt: skip
        if p.tp_col > 1:
            out.append((
                "offload needs tp_col 1",
                f"activation_checkpoint offload with tp_col ({p.tp_col}) > 1 is not checked against the memory "
                "oracle (2D tensor parallelism's norms and collectives under its hooks); use none, selective or full",
            ))  # fmt: skip
        return out
    if "mla_up_proj" in ac.split("+"):
        if not model.attention_kind.latent:
            return [(
                "mla_up_proj needs latent attention",
                f"activation_checkpoint {ac} recomputes latent attention's up-projections: this model's "
                f"attention is {model.attention!r}; use none, selective, layernorm, op or full",
            )]  # fmt: skip
        if p.cp > 1:
            return [(
                "mla_up_proj needs cp 1",
                f"activation_checkpoint {ac} with cp ({p.cp}) > 1 is not built (the gathered keys and values "
                "would be kept anyway); use none, selective or full",
            )]  # fmt: skip
    if "moe_act" in ac.split("+") and not model.moe:
        return [(
            "moe_act needs a mixture of experts",
            f"activation_checkpoint {ac} recomputes the routed experts' activation: this model has no "
            "experts; use none, selective, layernorm, op or full",
        )]  # fmt: skip
    if "layernorm" in ac.split("+"):
        out = []
        if p.tp > 1 and not p.sequence_parallel:
            out.append((
                "layernorm recompute needs sequence parallelism with tp > 1",
                f"activation_checkpoint {ac} with tp ({p.tp}) > 1 needs sequence_parallel: without it "
                "each linear wraps the norm's output in its own DTensor (not built)",
            ))  # fmt: skip
        if p.tp_col > 1 or p.cp > 1:
            out.append((
                "layernorm recompute needs tp_col 1 and cp 1",
                f"activation_checkpoint {ac} with tp_col ({p.tp_col}) or cp ({p.cp}) > 1 is not built or "
                "priced; use none, selective or full",
            ))  # fmt: skip
        return out
    if p.activation_checkpoint != "op":
        return []
    out = []
    if p.tp_col > 1:
        out.append((
            "op checkpointing needs tp_col 1",
            f"activation_checkpoint op with tp_col ({p.tp_col}) > 1 is not built: 2D tensor "
            "parallelism's ops (trainer/tp2d.py) are not in its policy; use none, selective or full",
        ))  # fmt: skip
    if p.cp > 1:
        out.append((
            "op checkpointing needs cp 1",
            f"activation_checkpoint op with cp ({p.cp}) > 1 is not priced yet (the gathered K/V and "
            "masks under its policy); use none, selective or full",
        ))  # fmt: skip
    return out


def cp_rules(p: ParallelConfig, model: ModelConfig) -> Violations:
    """Context-parallel rules: 2 x cp equal chunks of every sequence (head-tail load balancing),
    sequence parallelism splitting each rank's seq_len / cp tokens over tp, and no 2D tensor
    parallelism (not built with cp)."""
    if p.cp == 1:
        return []
    out = []
    if model.seq_len % (2 * p.cp):
        out.append((
            "cp needs seq_len divisible by 2 x cp",
            f"cp ({p.cp}) needs seq_len ({model.seq_len}) divisible by 2 x cp ({2 * p.cp}): head-tail "
            "load balancing gives each rank two of 2 x cp equal chunks of every sequence",
        ))  # fmt: skip
    elif p.sequence_parallel and (model.seq_len // p.cp) % p.tp:
        out.append((
            "sequence_parallel needs tp to divide seq_len / cp",
            f"sequence_parallel with cp ({p.cp}): tp ({p.tp}) must divide seq_len / cp "
            f"({model.seq_len} / {p.cp} = {model.seq_len // p.cp}), the tokens each cp rank holds",
        ))  # fmt: skip
    if p.tp_col > 1:
        out.append((
            "cp needs tp_col 1",
            f"cp ({p.cp}) > 1 with tp_col ({p.tp_col}) > 1 is not implemented: use cp with 1D tensor "
            "parallelism (tp_col 1)",
        ))  # fmt: skip
    return out


def gathers_norms_again(p: ParallelConfig) -> bool:
    """Sequence parallelism keeps the norms' output shards and all-gathers them again in the
    backward (trainer/model.py Block.gather_norms_again, trainer/parallelize.py; Megatron-LM's way), unless the layout
    recomputes them anyway: layernorm recompute keeps no norm output, full and op-level
    checkpointing recompute whole blocks (tuner/cost prices the same rule), or offloads its
    activations: the gathered inputs go to host memory with the rest (trainer/offload.py)."""
    recomputed = (
        p.activation_checkpoint in ("full", "op", "offload") or "layernorm" in p.activation_checkpoint
    )
    return p.sequence_parallel and p.tp > 1 and not recomputed
