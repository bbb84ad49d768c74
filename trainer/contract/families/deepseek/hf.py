"""DeepseekV3ForCausalLM: latent attention, sigmoid group-limited routing with an expert bias,
shared experts, dense first layers. What the preset leaves out on purpose (the YaRN scaling, the
multi-token prediction) is left out and said by `notes`."""

from __future__ import annotations

from typing import Any

from trainer.contract.families.hf import (
    DEFAULTS,
    HFConfigError,
    block_fields,
    int_field,
    refuse_biases,
    refuse_sliding_window,
)

ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3"}
MOE_TYPES = ("deepseek_v3",)
# DeepSeek-V3's expert-bias update speed gamma (DeepSeek-V3 report, section 4.2: 0.001 for the first
# 14.3T tokens): its config.json says the bias is used (topk_method "noaux_tc") but not the rate.
DEEPSEEK_BIAS_UPDATE_RATE = 0.001


def read(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    refuse_biases(config)
    refuse_sliding_window(config)
    fields = block_fields(config, qkv_bias=False)
    return fields | _latent_attention(config) | _experts(config, fields["num_layers"])


def notes(config: dict[str, Any]) -> list[str]:
    """What the file holds that the model read from it leaves out or takes from elsewhere, one
    sentence each: the YaRN RoPE scaling and multi-token-prediction module, the expert-bias rate
    its file does not carry, FP8 weights."""
    notes = []
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, "default"):
        notes.append(
            f"rope_scaling {kind!r} (factor {scaling.get('factor')}, original context "
            f"{scaling.get('original_max_position_embeddings')}) left out: it extends the context after "
            "pre-training; the model trains with plain RoPE at its pre-training context"
        )
    if config.get("num_nextn_predict_layers"):
        notes.append(
            f"num_nextn_predict_layers {config['num_nextn_predict_layers']}: the multi-token-prediction "
            "module is left out (not part of the main model's layers)"
        )
    if config.get("topk_method") == "noaux_tc":
        notes.append(
            f"topk_method 'noaux_tc': the auxiliary-loss-free expert bias, updated at "
            f"moe_bias_update_rate {DEEPSEEK_BIAS_UPDATE_RATE} (the DeepSeek-V3 report's gamma; the file "
            "does not carry it)"
        )
    if config.get("aux_loss_alpha") and config.get("seq_aux", True):
        notes.append(
            f"aux_loss_alpha {config['aux_loss_alpha']} read as moe_aux_loss_coef (the file's; the DeepSeek-V3 "
            "report trains with 0.0001, as the deepseek-v3 preset does)"
        )
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        notes.append(
            f"quantization_config {method!r}: the stored weights' format; the study's precision is what is priced"
        )
    return notes


def _latent_attention(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention: q through a q_lora_rank bottleneck (null: none),
    k and v from a kv_lora_rank latent and a shared rotary key. Plain RoPE (notes: YaRN), its
    dims as interleaved pairs (trainer/model.py LatentAttention; transformers' rope_interleave,
    true unless the file says otherwise: a file with halves is refused)."""
    if config.get("rope_interleave", True) is not True:
        raise HFConfigError(
            f"rope_interleave {config['rope_interleave']!r} is not supported: the trainer's latent attention "
            "rotates interleaved pairs (DeepSeek's layout, transformers' default true)"
        )
    out: dict[str, Any] = {"attention": "mla", "q_lora_rank": int(config.get("q_lora_rank") or 0)}
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        out[name] = int_field(config, name)
    theta = config.get("rope_theta", DEFAULTS["rope_theta"])
    return out | {"rope_theta": float(theta)}


def _experts(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """DeepSeek-V3's experts (transformers' DeepseekV3MoE): n_routed_experts of
    moe_intermediate_size, n_shared_experts of the same width always on, the first
    first_k_dense_replace layers dense; sigmoid (or softmax) scores over n_group groups of which
    tokens see topk_group, weights renormalised (norm_topk_prob) and scaled by
    routed_scaling_factor; the sequence-wise auxiliary loss aux_loss_alpha (seq_aux), the expert
    bias with topk_method 'noaux_tc'."""
    freq = config.get("moe_layer_freq", 1)
    if freq != 1:
        raise HFConfigError(
            f"moe_layer_freq {freq} is not supported: experts in every layer after the dense ones"
        )
    method = config.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise HFConfigError(
            f"topk_method {method!r} is not supported; supported: 'greedy', 'group_limited_greedy', 'noaux_tc'"
        )
    score = config.get("scoring_func", "softmax")
    if score not in ("softmax", "sigmoid"):
        raise HFConfigError(f"scoring_func {score!r} is not supported; supported: 'softmax', 'sigmoid'")
    width = int_field(config, "moe_intermediate_size")
    grouped = method != "greedy"
    dense = config.get("first_k_dense_replace", 0)
    if not isinstance(dense, int) or not 0 <= dense < layers:
        raise HFConfigError(
            f"first_k_dense_replace {dense!r} must be an integer in [0, num_hidden_layers {layers})"
        )
    return {
        "num_experts": int_field(config, "n_routed_experts"), "moe_top_k": int_field(config, "num_experts_per_tok"),
        "moe_ffn_hidden_size": width, "moe_shared_ffn_hidden_size": int(config.get("n_shared_experts") or 0) * width,
        "moe_dense_layers": dense, "moe_router_score": score, "moe_norm_topk": bool(config.get("norm_topk_prob")),
        "moe_route_scale": float(config.get("routed_scaling_factor") or 1.0),
        "moe_groups": int_field(config, "n_group") if grouped else 1,
        "moe_topk_groups": int_field(config, "topk_group") if grouped else 1,
        "moe_aux_loss_coef": float(config.get("aux_loss_alpha") or 0.0) if config.get("seq_aux", True) else 0.0,
        "moe_bias_update_rate": DEEPSEEK_BIAS_UPDATE_RATE if method == "noaux_tc" else 0.0,
        "moe_router_fp32": True,  # transformers' DeepseekV3TopkRouter: F.linear of fp32 casts
    }  # fmt: skip
