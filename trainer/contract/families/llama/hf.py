"""The Llama block's Hugging Face architectures: LlamaForCausalLM, MistralForCausalLM and
Qwen2ForCausalLM (a bias on q, k and v), Qwen3ForCausalLM (per-head q/k norms, heads wider than
hidden / heads), and the mixtures of experts on it: MixtralForCausalLM, Qwen3MoeForCausalLM,
OlmoeForCausalLM (q/k norms over the whole projections). docs/models.md has the table."""

from __future__ import annotations

from typing import Any

from trainer.contract.families.hf import (
    HFConfigError,
    block_fields,
    int_field,
    refuse_biases,
    refuse_sliding_window,
    rope_fields,
)

# architectures entry -> model_type, as transformers pairs them
ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}  # fmt: skip
MOE_TYPES = ("mixtral", "qwen3_moe", "olmoe")
# q/k norms before RoPE: per head over head_dim (Qwen3's q_norm/k_norm), or over all heads of the
# projection (OLMoE's RMSNorm(hidden) on q and RMSNorm(kv heads x head_dim) on k).
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "proj"}
# Types whose head_dim may differ from hidden / heads (Qwen3: 32 heads of 128 on a 2048 stream).
WIDE_HEADS = ("qwen3", "qwen3_moe")


def read(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """ModelConfig's fields from a parsed config.json of one of ARCHITECTURES."""
    _refuse(config, model_type)
    fields = block_fields(config, qkv_bias=model_type == "qwen2")
    fields |= _heads(config, model_type, fields["hidden_size"], fields["num_heads"])
    if model_type in QK_NORM:
        fields["qk_norm"] = QK_NORM[model_type]
    if model_type in MOE_TYPES:
        fields |= _experts(config, model_type, fields["num_layers"])
    return fields | rope_fields(config)


def _refuse(config: dict[str, Any], model_type: str) -> None:
    """Fields whose value would build a model the fields cannot describe."""
    refuse_biases(config)
    if model_type == "olmoe" and config.get("clip_qkv") is not None:
        raise HFConfigError(f"clip_qkv {config['clip_qkv']} is not supported: q, k and v are not clipped")
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if config.get("use_sliding_window"):
            window = config.get("sliding_window")
            raise HFConfigError(f"use_sliding_window true (sliding_window {window}) is not supported: "
                                "attention is over the whole sequence")  # fmt: skip
        if config.get("use_mrope"):
            raise HFConfigError("use_mrope true is not supported: multimodal rotary positions")
    else:
        refuse_sliding_window(config)


def _heads(config: dict[str, Any], model_type: str, hidden: int, heads: int) -> dict[str, Any]:
    """num_kv_heads (None: multi-head) and attention_head_dim (None: hidden / heads)."""
    # LlamaConfig reads a missing num_key_value_heads as multi-head attention (Llama 1 files have
    # none); the other configs default to other numbers, so those files must say it.
    kv = (
        int_field(config, "num_key_value_heads")
        if model_type != "llama" or "num_key_value_heads" in config
        else heads
    )
    out: dict[str, Any] = {"num_kv_heads": kv if kv != heads else None}
    head_dim = config.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != hidden:
        if model_type not in WIDE_HEADS:
            raise HFConfigError(
                f"head_dim {head_dim} is not hidden_size / num_attention_heads ({hidden} / {heads}); attention "
                f"wider or narrower than the residual stream is not supported but for model_type {list(WIDE_HEADS)}"
            )
        out["attention_head_dim"] = int_field(config, "head_dim")
    return out


def _experts(config: dict[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """Mixtral (num_local_experts of intermediate_size, top-k renormalised), Qwen3-MoE
    (num_experts of moe_intermediate_size, norm_topk_prob, dense layers in mlp_only_layers),
    OLMoE (num_experts of intermediate_size, norm_topk_prob false): softmax routers, the Switch
    auxiliary loss over the batch (transformers' load_balancing_loss_func) x router_aux_loss_coef."""
    shared = {k: config[k] for k in ("shared_expert_intermediate_size", "n_shared_experts") if config.get(k)}
    if shared:
        raise HFConfigError(
            f"{shared} is not supported with model_type {model_type!r}: its block has no shared expert"
        )
    count = "num_local_experts" if model_type == "mixtral" else "num_experts"
    width = "moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"
    out = {
        "num_experts": int_field(config, count), "moe_top_k": int_field(config, "num_experts_per_tok"),
        "moe_ffn_hidden_size": int_field(config, width), "moe_router_score": "softmax",
        # Mixtral takes the softmax over the top-k logits: weights that sum to 1
        "moe_norm_topk": True if model_type == "mixtral" else bool(config.get("norm_topk_prob", False)),
        "moe_aux_loss_coef": float(config.get("router_aux_loss_coef") or 0.0), "moe_aux_loss": "batch",
    }  # fmt: skip
    if model_type == "qwen3_moe":
        out["moe_dense_layers"] = _qwen3_dense_layers(config, layers)
    return out


def _qwen3_dense_layers(config: dict[str, Any], layers: int) -> int:
    """Qwen3-MoE's layer i has experts unless i is in mlp_only_layers or (i + 1) is not a multiple
    of decoder_sparse_step (transformers' Qwen3MoeDecoderLayer); the model's dense layers are the
    first ones only."""
    step = config.get("decoder_sparse_step", 1)
    if step != 1:
        raise HFConfigError(
            f"decoder_sparse_step {step} is not supported: experts in every layer after the first "
            "dense ones (decoder_sparse_step 1)"
        )
    dense = config.get("mlp_only_layers") or []
    if sorted(dense) != list(range(len(dense))) or len(dense) >= layers:
        raise HFConfigError(
            f"mlp_only_layers {dense} is not supported: the dense layers must be the first ones "
            f"([0, 1, ..., k-1], k < num_hidden_layers {layers})"
        )
    return len(dense)
