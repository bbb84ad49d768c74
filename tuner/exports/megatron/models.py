"""The study's model as Megatron-LM flags (megatron-core 0.19.2), part by part: each block part
says its own flag (trainer/contract/blocks.py: NormPart.megatron's --normalization, MLPPart.megatron's
--swiglu; rotary positions are --position-embedding-type rope), and Megatron's defaults are GPT's block
(a family with Family.megatron_defaults needs only its shape). Then the attention variants and the
mixtures of experts:
- experts: --num-experts, --moe-router-topk, --moe-ffn-hidden-size, a shared expert's
  --moe-shared-expert-intermediate-size, the dense first layers as a --moe-layer-freq pattern,
  --moe-grouped-gemm and the all-to-all dispatcher (--moe-token-dispatcher-type alltoall), the
  one our trainer runs (issue 27: all_to_all_single);
- the router: --moe-router-score-function; softmax with the top-k weights renormalised is
  Megatron's default (softmax over the top-k logits: the same weights), unnormalised (OLMoE) is
  --moe-router-pre-softmax; sigmoid scores are always renormalised (megatron/core/transformer/moe/
  moe_utils.py: topk_routing_with_score_function), so sigmoid without renormalising is refused;
  --moe-router-topk-scaling-factor, group-limited routing (--moe-router-num-groups,
  --moe-router-group-topk), the auxiliary-loss-free expert bias (--moe-router-enable-expert-bias,
  --moe-router-bias-update-rate; Megatron takes it with sigmoid scores only), the router's matmul
  in fp32 (--moe-router-dtype fp32);
- load balancing: ModelConfig.moe_aux_loss_coef x the form moe_aux_loss (its comment in
  trainer/contract/model.py): the sequence-wise loss is Megatron's seq_aux_loss, the batch's its
  aux_loss at a coefficient of the same gradient (megatron_aux_loss); none without it; --moe-router-force-load-balancing
  for a study measured with balanced routing (BenchmarkConfig.moe_routing);
- parallelism: --expert-model-parallel-size ep and --expert-tensor-parallel-size 1 (experts are
  never split over tp: trainer/contract/rules.py, ep_rules); Megatron's expert grid
  ETP x EP x EDP x PP then has the trainer's expert data parallelism (edp = dp x cp x tp / ep);
- attention: --kv-channels for heads wider than hidden / heads, --qk-layernorm for per-head q/k
  norms (OLMoE's norms over the whole projections have no Megatron flag: refused), and
  --multi-latent-attention with its ranks and widths, plain RoPE (--rope-type rope; Megatron's
  latent attention defaults to YaRN, whose fused kernel is YaRN only: --no-rope-fusion) and
  --qk-layernorm for the q and kv latents' norms.
tests/tuner/test_export.py checks Megatron's parse of the flags (docs/exports.md).
"""

from __future__ import annotations

import shlex

from trainer.contract.families import family_of
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.exports.common import DEFAULT_NORM, DEFAULT_NORM_EPS, label

# Megatron-LM's Llama 3.1 RoPE scaling (--use-rope-scaling) takes the factor as a flag
# (--rope-scaling-factor) and fixes the rest (megatron/core/models/common/embeddings/
# rotary_pos_embedding.py: RotaryEmbedding._apply_scaling): low/high frequency factors, original context.
MEGATRON_ROPE_SCALING_FIXED = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                               "rope_original_max_positions": 8192}  # fmt: skip


def megatron_unsupported(m: ModelConfig) -> list[str]:
    reasons = megatron_attention_unsupported(m) + megatron_moe_unsupported(m)
    if m.positions_kind.rotary and m.rope_theta != int(m.rope_theta):
        reasons.append(f"rope_theta {m.rope_theta:g}: Megatron-LM's --rotary-base is an integer")
    if m.rope_scaling_factor is not None:
        for field, fixed in MEGATRON_ROPE_SCALING_FIXED.items():
            if getattr(m, field) != fixed:
                reasons.append(f"{field} {getattr(m, field):g}: Megatron-LM's Llama 3.1 RoPE scaling "
                               f"fixes it at {fixed:g} (only the factor is a flag)")  # fmt: skip
    return reasons


def megatron_model_args(m: ModelConfig) -> list[tuple[str, object]]:
    """The model's flags, from --num-layers to the dropouts: Megatron's defaults are GPT's block
    (learned absolute positions, LayerNorm eps 1e-5, GELU, multi-head attention, a head tied to the
    embedding, biases), so a GPT-2/3 model needs only its shape, --untie... and --disable-bias-linear.
    --kv-channels is left out: Megatron's default is hidden / heads, which is ours."""
    args: list[tuple[str, object]] = [
        ("--num-layers", m.num_layers),
        ("--hidden-size", m.hidden_size),
        ("--num-attention-heads", m.num_heads),
    ]
    if m.kv_heads != m.num_heads:  # Megatron's query groups are the KV heads
        args += [("--group-query-attention", None), ("--num-query-groups", m.kv_heads)]
    args += megatron_attention_args(m)  # wide heads, q/k norms, latent attention (below)
    args += [
        ("--ffn-hidden-size", m.ffn_size),
        ("--seq-length", m.seq_len),
        ("--max-position-embeddings", m.seq_len),
    ]
    if m.norm_kind.megatron != DEFAULT_NORM:
        args.append(("--normalization", m.norm_kind.megatron))
    if m.norm_kind.megatron != DEFAULT_NORM or m.norm_eps != DEFAULT_NORM_EPS:
        args.append(("--norm-epsilon", f"{m.norm_eps:g}"))
    if m.mlp_kind.megatron:
        args.append((m.mlp_kind.megatron, None))
    if m.positions_kind.rotary:
        args += [("--position-embedding-type", "rope"), ("--rotary-base", int(m.rope_theta))]
        if m.rope_scaling_factor is not None:
            args += [("--use-rope-scaling", None), ("--rope-scaling-factor", f"{m.rope_scaling_factor:g}")]
    if not m.tie_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    args.append(("--disable-bias-linear", None))
    if m.qkv_bias:
        args.append(("--add-qkv-bias", None))
    args += [("--attention-dropout", m.dropout), ("--hidden-dropout", m.dropout)]
    return args


def megatron_model_note(m: ModelConfig) -> str:
    if family_of(m).megatron_defaults:
        return "Megatron's defaults match the rest of the model: learned absolute positions, LayerNorm, GELU."
    note = f"the {label(m)} block is in the flags below (Megatron's defaults are GPT's)"
    if m.positions_kind.rotary:
        note += "; Megatron's RoPE rotates the two halves of each head, as our trainer does"
    return note + "."


# --- attention variants and mixtures of experts ---


def megatron_attention_unsupported(m: ModelConfig) -> list[str]:
    if m.qk_norm == "proj":
        return [
            "qk_norm 'proj' (OLMoE's RMSNorm over the whole q and k projections): Megatron-LM's "
            "--qk-layernorm normalises each head"
        ]
    return []


def megatron_attention_args(m: ModelConfig) -> list[tuple[str, object]]:
    """Flags for the attention beyond multi-head / grouped-query attention of hidden / heads."""
    if m.attention_kind.latent:
        args: list[tuple[str, object]] = [("--multi-latent-attention", None)]
        if m.q_lora_rank:
            args.append(("--q-lora-rank", m.q_lora_rank))
        return [
            *args, ("--kv-lora-rank", m.kv_lora_rank), ("--qk-head-dim", m.qk_nope_head_dim),
            ("--qk-pos-emb-head-dim", m.qk_rope_head_dim), ("--v-head-dim", m.v_head_dim),
            ("--qk-layernorm", None), ("--rope-type", "rope"), ("--no-rope-fusion", None),
        ]  # fmt: skip
    args = [("--kv-channels", m.attention_head_dim)] if m.attention_head_dim else []
    if m.qk_norm == "head":
        args.append(("--qk-layernorm", None))
    return args


def megatron_moe_unsupported(m: ModelConfig) -> list[str]:
    if not m.moe:  # the router's refusals: a mixture of experts only
        return []
    reasons = []
    if m.moe_router_score == "sigmoid" and not m.moe_norm_topk and m.moe_top_k > 1:
        reasons.append(
            "sigmoid router scores without renormalising the top-k (moe_norm_topk false): Megatron-LM "
            "always renormalises sigmoid scores"
        )
    if m.moe_router_score == "softmax" and m.moe_norm_topk and m.moe_top_k == 1:
        reasons.append(
            "softmax top-1 routing renormalised (a weight of 1): Megatron-LM needs --moe-router-pre-softmax "
            "for top-1, which keeps the softmax probability instead"
        )
    if m.moe_bias_update_rate and m.moe_router_score != "sigmoid":
        reasons.append(
            f"the expert bias (moe_bias_update_rate {m.moe_bias_update_rate:g}) with "
            f"{m.moe_router_score!r} scores: Megatron-LM's --moe-router-enable-expert-bias takes sigmoid scores only"
        )
    return reasons


def moe_layer_pattern(m: ModelConfig) -> str:
    """--moe-layer-freq's pattern for the dense first layers: '([0]*3+[1]*58)' (1: experts)."""
    return f"([0]*{m.moe_dense_layers}+[1]*{m.num_moe_layers})"


def megatron_moe_args(
    m: ModelConfig, config: ParallelConfig, routing: str, capacity_factor: float | None = None
) -> list[tuple[str, object]]:
    """The experts' flags, after the model's (megatron_model_args), and the expert layout; token
    drop at `capacity_factor` (its "probs" policy, Megatron's default, as the trainer drops)."""
    if not m.moe:  # the experts' flags: a mixture of experts only
        return []
    args: list[tuple[str, object]] = [
        ("--num-experts", m.num_experts), ("--moe-router-topk", m.moe_top_k),
        ("--moe-ffn-hidden-size", m.expert_ffn_size),
    ]  # fmt: skip
    if m.moe_shared_ffn_hidden_size:
        args.append(("--moe-shared-expert-intermediate-size", m.moe_shared_ffn_hidden_size))
    if m.moe_dense_layers:
        args.append(("--moe-layer-freq", shlex.quote(moe_layer_pattern(m))))
    args.append(("--moe-router-score-function", m.moe_router_score))
    if m.moe_router_score == "softmax" and not m.moe_norm_topk:
        args.append(("--moe-router-pre-softmax", None))  # softmax over all experts, top-k weights as they are
    if m.moe_route_scale != 1:
        args.append(("--moe-router-topk-scaling-factor", f"{m.moe_route_scale:g}"))
    if m.moe_groups > 1:
        args += [("--moe-router-num-groups", m.moe_groups), ("--moe-router-group-topk", m.moe_topk_groups)]
    if m.moe_router_fp32:
        args.append(("--moe-router-dtype", "fp32"))
    if m.moe_bias_update_rate:
        args += [("--moe-router-enable-expert-bias", None),
                 ("--moe-router-bias-update-rate", f"{m.moe_bias_update_rate:g}")]  # fmt: skip
    if m.moe_aux_loss_coef:
        kind, coeff = megatron_aux_loss(m)
        args += [("--moe-router-load-balancing-type", kind), ("--moe-aux-loss-coeff", f"{coeff:.10g}")]
    else:
        args.append(("--moe-router-load-balancing-type", "none"))
    if routing == "balanced":
        args.append(("--moe-router-force-load-balancing", None))
    if capacity_factor is not None:
        args += [
            ("--moe-expert-capacity-factor", f"{capacity_factor:g}"),
            ("--moe-token-drop-policy", "probs"),
        ]
    return [
        *args, ("--moe-grouped-gemm", None), ("--moe-token-dispatcher-type", "alltoall"),
        ("--expert-model-parallel-size", config.ep), ("--expert-tensor-parallel-size", 1),
    ]  # fmt: skip


def megatron_aux_loss(m: ModelConfig) -> tuple[str, float]:
    """Megatron's load-balancing type and coefficient for the same gradient as ours. Sequence-wise:
    seq_aux_loss, as it is. Over the batch: Megatron's aux_loss (moe_utils.py:
    switch_load_balancing_loss_func) is transformers' value / top-k per layer and each layer's
    joins the loss; ours is transformers' value averaged over the MoE layers (trainer/moe.py:
    batch_aux_loss), so Megatron's coefficient is ours x top-k / MoE layers."""
    if m.moe_aux_loss == "sequence":
        return "seq_aux_loss", m.moe_aux_loss_coef
    return "aux_loss", m.moe_aux_loss_coef * m.moe_top_k / m.num_moe_layers


def megatron_moe_notes(
    m: ModelConfig, config: ParallelConfig, routing: str, capacity_factor: float | None = None
) -> list[str]:
    notes = []
    if m.attention_kind.latent:
        notes.append(
            "latent attention with plain RoPE (--rope-type rope), as the trainer builds it; Megatron's fused "
            "RoPE for latent attention is YaRN only (--no-rope-fusion)."
        )
    if not m.moe:  # the experts' notes: a mixture of experts only
        return notes
    c = config
    ranks, sizes = (
        ("dp x cp x tp", f"dp {c.dp} x cp {c.cp} x tp {c.tp}")
        if c.cp > 1
        else ("dp x tp", f"dp {c.dp} x tp {c.tp}")
    )
    notes.append(
        f"experts: ep {c.ep} x etp 1 over the {ranks} ranks of each stage, so expert data parallelism is "
        f"{c.edp} ({sizes} / ep {c.ep}), as measured; "
        + ("dropless routing (no capacity factor)." if capacity_factor is None else
           f"token drop at capacity factor {capacity_factor:g} of each rank's assignments, the lowest routing "
           "weights dropped (--moe-token-drop-policy probs), unpadded, as measured.")
    )  # fmt: skip
    if m.moe_aux_loss_coef:
        kind, coeff = megatron_aux_loss(m)
        notes.append(
            f"load balancing: the sequence-wise auxiliary loss (seq_aux_loss) x {coeff:g}, ModelConfig.moe_aux_loss_coef."
            if kind == "seq_aux_loss"
            else f"load balancing: the auxiliary loss over the micro-batch (aux_loss) x {coeff:.4g}: the model's "
            f"{m.moe_aux_loss_coef:g} x top-k {m.moe_top_k} / {m.num_moe_layers} MoE layers (Megatron's per-layer "
            "loss is transformers' / top-k, summed over the layers; ours is transformers' averaged over them)."
        )
    notes.append(
        "--moe-router-force-load-balancing: routing forced balanced, as the study measured it."
        if routing == "balanced"
        else f"routing learned ({'dropless' if capacity_factor is None else 'with token drop'}), as measured: "
        "per-expert load follows the router."
    )
    return notes
