"""What every export target shares: the header comment lines that open each exported file (which
study, layout, model and batch), comments(), the torchrun launcher line, the study's routing, and
the one-line descriptions of the model's block (describe), its attention variants and experts
(describe_moe) and context parallelism (describe_cp) that the header carries.
"""

from __future__ import annotations

from trainer.contract.families import family_of
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.dispatch.sbatch import layout_resources
from tuner.spec import StudySpec, benchmark_config, slug

# torchtitan's RMSNorm.Config default eps and Megatron-LM's --norm-epsilon default.
DEFAULT_NORM_EPS = 1e-5
# Megatron-LM's default --normalization (NormPart.megatron), GPT's: the header and the flags name the
# eps of any other norm, and of this one where it is not DEFAULT_NORM_EPS.
DEFAULT_NORM = "LayerNorm"


def header(spec: StudySpec, config: ParallelConfig, tool: str) -> list[str]:
    """Comment lines (without '# ') shared by every format: which study, layout, model, batch (the
    expert layout for a mixture of experts only)."""
    m, c = spec.as_model_config(), config
    nodes, per_node = layout_resources(benchmark_config(spec, config), spec.cluster.gpus_per_node)
    folded = "dp x cp x tp" if c.cp > 1 else "dp x tp"
    lines = [
        f"{tool} for study {slug(spec.name)} (parallel-tuner, tuner/exports/): {c.describe()}",
        f"{c.world_size} ranks = tp {c.tp}"
        + (f" x tp_col {c.tp_col}" if c.tp_col > 1 else "")
        + f" x pp {c.pp} x dp_replicate {c.dp_replicate} x dp_shard "
        f"{c.dp_shard}"
        + (f" x cp {c.cp}" if c.cp > 1 else "")
        + (f" (ep {c.ep} folded into {folded}: expert data parallelism {c.edp})" if m.moe else "")
        + f", on {nodes} node(s) x {per_node} of cluster {slug(spec.cluster.name)}",
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads"
        + (f" ({m.kv_heads} KV heads)" if m.kv_heads != m.num_heads else "")
        + f", ffn {m.ffn_size}, vocab {m.vocab_size}, seq {m.seq_len} ({describe(m)})",
        f"batch: global {c.global_batch_size} = micro-batch {c.micro_batch_size} x {c.num_microbatches} "
        f"micro-batches x dp {c.dp}; precision {spec.training.precision}",
    ]
    return lines + ([describe_cp(m, c)] if c.cp > 1 else [])


def comments(lines: list[str]) -> list[str]:
    return [f"# {line}" if line else "#" for line in lines]


def launcher(spec: StudySpec, config: ParallelConfig) -> tuple[str, list[str]]:
    """(the torchrun launcher, a note for several nodes) on the study's nodes."""
    nodes, per_node = layout_resources(benchmark_config(spec, config), spec.cluster.gpus_per_node)
    note = [f"run this on each of the {nodes} nodes with --node-rank and --master-addr (or "
            "--rdzv-backend=c10d --rdzv-endpoint)."] if nodes > 1 else []  # fmt: skip
    return f"torchrun --nproc-per-node={per_node} --nnodes={nodes}", note


def routing(spec: StudySpec, config: ParallelConfig) -> str:
    """How the study's trials route tokens (BenchmarkConfig.moe_routing: learned or balanced)."""
    return benchmark_config(spec, config).moe_routing


def capacity_factor(spec: StudySpec, config: ParallelConfig) -> float | None:
    """The experts' token-drop capacity factor the study's trials run (None: dropless;
    BenchmarkConfig.moe_capacity_factor)."""
    cfg = benchmark_config(spec, config)
    return cfg.moe_capacity_factor if cfg.model.moe else None


# --- the model, the attention and experts, and context parallelism, in words ---


def describe(m: ModelConfig) -> str:
    """The block in words, for the header of every export: 'GPT: learned positions, pre-LN, GELU MLP,
    untied head, no linear biases' for GPT-2/3. The family and the parts say their own labels
    (trainer/contract/families/, trainer/contract/blocks.py)."""
    positions = m.positions_kind.label
    if m.positions_kind.rotary:
        positions += f" base {_number(m.rope_theta)}"
        if m.rope_scaling_factor is not None:
            positions += (f" with Llama 3.1 scaling x{m.rope_scaling_factor:g} (frequency factors "
                          f"{m.rope_low_freq_factor:g}/{m.rope_high_freq_factor:g}, original context "
                          f"{m.rope_original_max_positions})")  # fmt: skip
    norm = m.norm_kind.label
    if m.norm_kind.megatron != DEFAULT_NORM or m.norm_eps != DEFAULT_NORM_EPS:
        norm += f" eps {m.norm_eps:g}"
    mlp = m.mlp_kind.label
    head = "head tied to the token embedding" if m.tie_embeddings else "untied head"
    biases = "biases on q, k and v only" if m.qkv_bias else "no linear biases"
    extra = describe_moe(m)  # attention variants and experts (below); '' for the dense families
    return f"{label(m)}: {positions}, {norm}, {mlp}, {head}, {biases}" + (f"; {extra}" if extra else "")


def _number(x: float) -> str:
    """500000.0 -> '500000' (not '5e+05'), 0.5 -> '0.5'."""
    return str(int(x)) if x == int(x) else repr(x)


def label(m: ModelConfig) -> str:
    """The family's label (Family.label), and whether its MLPs are experts: 'Llama mixture of experts'."""
    return family_of(m).label + (" mixture of experts" if m.moe else "")


def describe_moe(m: ModelConfig) -> str:
    """The attention and expert fields beyond the dense families, for the header: '' for those. The
    experts' words are the mixture of experts' own (`m.moe`)."""
    parts = []
    if m.attention_kind.latent:
        parts.append(
            f"latent attention (q rank {m.q_lora_rank}, kv rank {m.kv_lora_rank}, heads of {m.qk_nope_head_dim} + "
            f"{m.qk_rope_head_dim} rotary for q/k, {m.v_head_dim} for v)"
        )
    elif m.attention_head_dim:
        parts.append(f"heads of {m.attention_head_dim}")
    if m.qk_norm != "none":
        parts.append(
            {"head": "q/k norms per head", "proj": "q/k norms over the whole projections"}[m.qk_norm]
        )
    if m.moe:
        experts = f"{m.num_experts} experts of {m.expert_ffn_size}, top {m.moe_top_k}"
        if m.moe_shared_ffn_hidden_size:
            experts += f", a shared expert of {m.moe_shared_ffn_hidden_size}"
        if m.moe_dense_layers:
            experts += f", {m.moe_dense_layers} dense first layer(s)"
        router = f"{m.moe_router_score} router" + (
            " renormalised" if m.moe_norm_topk else " not renormalised"
        )
        if m.moe_route_scale != 1:
            router += f" x{m.moe_route_scale:g}"
        if m.moe_groups > 1:
            router += f", {m.moe_topk_groups} of {m.moe_groups} groups"
        if m.moe_bias_update_rate:
            router += f", expert bias rate {m.moe_bias_update_rate:g}"
        if m.moe_aux_loss_coef:
            form = "sequence-wise" if m.moe_aux_loss == "sequence" else "over the batch"
            router += f", auxiliary loss {m.moe_aux_loss_coef:g} ({form})"
        parts.append(f"{experts} ({router})")
    return "; ".join(parts)


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
