"""A model from a Hugging Face `config.json`: the file transformers saves next to a checkpoint,
read from disk (never fetched) into trainer.contract.model.ModelConfig's fields.

The architectures build one decoder block (RMSNorm, SwiGLU, rotary positions, grouped-query
attention): LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM (a bias on q, k and v),
Qwen3ForCausalLM (per-head q/k norms, heads wider than hidden / heads), and the mixtures of
experts on it: MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM (q/k norms over the
whole projections) and DeepseekV3ForCausalLM (latent attention, sigmoid group-limited routing with
an expert bias, shared experts, dense first layers; tuner/hfconfig_moe.py reads the experts).
Anything in the file that would build another model than the one the fields describe is refused
with the field and its value: a sliding attention window, biases on o or the MLP, mixture-of-experts
fields on a dense architecture, a RoPE scaling other than Llama 3.1's. What a preset leaves out on
purpose (DeepSeek-V3's YaRN scaling and multi-token prediction) is left out and said by
hf_config_notes(). docs/models.md has the table.

seq_len is not the file's max_position_embeddings: that is the context the model supports
(131072 for Llama 3.1, reached by long-context training after pre-training at 8192, Llama 3 paper
section 3.4), not the sequence a run trains at. The model's seq_len is DEFAULT_SEQ_LEN (Llama 3's
pre-training context) capped at max_position_embeddings; a study sets its own with
training.seq_len, or `model: {hf_config: ..., seq_len: ...}`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# architectures entry -> model_type, as transformers pairs them
SUPPORTED = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe", "DeepseekV3ForCausalLM": "deepseek_v3",
}  # fmt: skip
MOE_TYPES = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3")
# q/k norms before RoPE: per head over head_dim (Qwen3's q_norm/k_norm), or over all heads of the
# projection (OLMoE's RMSNorm(hidden) on q and RMSNorm(kv heads x head_dim) on k).
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "proj"}
# Types whose head_dim may differ from hidden / heads (Qwen3: 32 heads of 128 on a 2048 stream).
WIDE_HEADS = ("qwen3", "qwen3_moe")
DEFAULT_SEQ_LEN = 8192
# Fields that make a mixture of experts (Mixtral, Qwen2-MoE, DeepSeek): the block is not dense.
MOE_FIELDS = (
    "num_local_experts", "num_experts", "num_experts_per_tok", "n_routed_experts", "n_shared_experts",
    "moe_intermediate_size", "shared_expert_intermediate_size",
)  # fmt: skip
# transformers' defaults for fields a file may leave out (LlamaConfig, MistralConfig, Qwen2Config
# agree on these).
DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
# DeepSeek-V3's expert-bias update speed gamma (DeepSeek-V3 report, section 4.2: 0.001 for the first
# 14.3T tokens): its config.json says the bias is used (topk_method "noaux_tc") but not the rate.
DEEPSEEK_BIAS_UPDATE_RATE = 0.001
_SUPPORTED_TEXT = ", ".join(f"{a} (model_type {t!r})" for a, t in SUPPORTED.items())


class HFConfigError(ValueError):
    """A config.json this reader cannot turn into the model it describes; names the field."""


def _load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise HFConfigError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFConfigError(f"{path}: not a JSON file: {e}") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """ModelConfig's fields from the config.json at `path`."""
    config = _load(path)
    try:
        return hf_config_fields(config)
    except HFConfigError as e:
        raise HFConfigError(f"{path}: {e}") from None


def read_hf_config_notes(path: str | Path) -> list[str]:
    """hf_config_notes() of the config.json at `path` (none when it cannot be read: the fields'
    reader says why)."""
    try:
        return hf_config_notes(_load(path))
    except HFConfigError:
        return []


def hf_config_notes(config: dict[str, Any]) -> list[str]:
    """What the file holds that the model read from it leaves out or takes from elsewhere, one
    sentence each (`tuner plan --hf-config` prints them): DeepSeek-V3's YaRN RoPE scaling and
    multi-token-prediction module, the expert-bias rate its file does not carry, FP8 weights."""
    notes = []
    if config.get("model_type") != "deepseek_v3":
        return notes
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


def hf_config_fields(config: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields from a parsed config.json (docs/models.md, "From a Hugging Face config")."""
    model_type = config.get("model_type")
    moe = {k: config[k] for k in MOE_FIELDS if config.get(k)}
    if moe and model_type not in MOE_TYPES:  # first: named for its experts, not its model_type
        raise HFConfigError(
            f"mixture of experts ({moe}) is not supported with model_type {model_type!r}; mixtures of "
            f"experts are read for model_type {list(MOE_TYPES)}"
        )
    model_type = _architecture(config)
    _refuse_unsupported(config, model_type)
    get = lambda name: config.get(name, DEFAULTS.get(name))  # noqa: E731
    if get("hidden_act") != "silu":
        raise HFConfigError(f"hidden_act {get('hidden_act')!r} is not supported: the SwiGLU MLP uses 'silu'")
    layers, hidden, heads = (
        _int(config, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads")
    )
    max_positions = config.get("max_position_embeddings") or DEFAULT_SEQ_LEN
    fields: dict[str, Any] = {
        "num_layers": layers, "hidden_size": hidden, "num_heads": heads,
        "ffn_hidden_size": _int(config, "intermediate_size"),
        "vocab_size": _int(config, "vocab_size"), "seq_len": min(DEFAULT_SEQ_LEN, int(max_positions)),
        "norm": "rmsnorm", "norm_eps": float(get("rms_norm_eps")), "mlp": "swiglu", "positions": "rope",
        "tie_embeddings": bool(get("tie_word_embeddings")), "qkv_bias": model_type == "qwen2",
    }  # fmt: skip
    if model_type == "deepseek_v3":
        return fields | _latent_attention(config) | _deepseek_experts(config, layers)
    fields |= _heads(config, model_type, hidden, heads)
    if model_type in QK_NORM:
        fields["qk_norm"] = QK_NORM[model_type]
    if model_type in MOE_TYPES:
        fields |= _experts(config, model_type, layers)
    return fields | _rope(config)


def _heads(config: dict[str, Any], model_type: str, hidden: int, heads: int) -> dict[str, Any]:
    """num_kv_heads (None: multi-head) and attention_head_dim (None: hidden / heads)."""
    # LlamaConfig reads a missing num_key_value_heads as multi-head attention (Llama 1 files have
    # none); the other configs default to other numbers, so those files must say it.
    kv = (
        _int(config, "num_key_value_heads")
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
        out["attention_head_dim"] = _int(config, "head_dim")
    return out


def _experts(config: dict[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """Mixtral (num_local_experts of intermediate_size, top-k renormalised), Qwen3-MoE
    (num_experts of moe_intermediate_size, norm_topk_prob, dense layers in mlp_only_layers),
    OLMoE (num_experts of intermediate_size, norm_topk_prob false): softmax routers, an auxiliary
    loss of router_aux_loss_coef."""
    shared = {k: config[k] for k in ("shared_expert_intermediate_size", "n_shared_experts") if config.get(k)}
    if shared:
        raise HFConfigError(
            f"{shared} is not supported with model_type {model_type!r}: its block has no shared expert"
        )
    count = "num_local_experts" if model_type == "mixtral" else "num_experts"
    width = "moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"
    out = {
        "num_experts": _int(config, count), "moe_top_k": _int(config, "num_experts_per_tok"),
        "moe_ffn_hidden_size": _int(config, width), "moe_router_score": "softmax",
        # Mixtral takes the softmax over the top-k logits: weights that sum to 1
        "moe_norm_topk": True if model_type == "mixtral" else bool(config.get("norm_topk_prob", False)),
        "moe_aux_loss_coef": float(config.get("router_aux_loss_coef") or 0.0),
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


def _latent_attention(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention: q through a q_lora_rank bottleneck (null: none),
    k and v from a kv_lora_rank latent and a shared rotary key. Plain RoPE (hf_config_notes: YaRN)."""
    out: dict[str, Any] = {"attention": "mla", "q_lora_rank": int(config.get("q_lora_rank") or 0)}
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        out[name] = _int(config, name)
    theta = config.get("rope_theta", DEFAULTS["rope_theta"])
    return out | {"rope_theta": float(theta)}


def _deepseek_experts(config: dict[str, Any], layers: int) -> dict[str, Any]:
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
    width = _int(config, "moe_intermediate_size")
    grouped = method != "greedy"
    dense = config.get("first_k_dense_replace", 0)
    if not isinstance(dense, int) or not 0 <= dense < layers:
        raise HFConfigError(
            f"first_k_dense_replace {dense!r} must be an integer in [0, num_hidden_layers {layers})"
        )
    return {
        "num_experts": _int(config, "n_routed_experts"), "moe_top_k": _int(config, "num_experts_per_tok"),
        "moe_ffn_hidden_size": width, "moe_shared_ffn_hidden_size": int(config.get("n_shared_experts") or 0) * width,
        "moe_dense_layers": dense, "moe_router_score": score, "moe_norm_topk": bool(config.get("norm_topk_prob")),
        "moe_route_scale": float(config.get("routed_scaling_factor") or 1.0),
        "moe_groups": _int(config, "n_group") if grouped else 1,
        "moe_topk_groups": _int(config, "topk_group") if grouped else 1,
        "moe_aux_loss_coef": float(config.get("aux_loss_alpha") or 0.0) if config.get("seq_aux", True) else 0.0,
        "moe_bias_update_rate": DEEPSEEK_BIAS_UPDATE_RATE if method == "noaux_tc" else 0.0,
    }  # fmt: skip


def _architecture(config: dict[str, Any]) -> str:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED.values():
        raise HFConfigError(f"model_type {model_type!r} is not supported; supported: {_SUPPORTED_TEXT}")
    archs = config.get("architectures") or []
    bad = [a for a in archs if SUPPORTED.get(a) != model_type]
    if bad:
        raise HFConfigError(
            f"architectures {archs} is not supported with model_type {model_type!r}; supported: {_SUPPORTED_TEXT}"
        )
    return model_type


def _refuse_unsupported(config: dict[str, Any], model_type: str) -> None:
    """Fields whose value would build a model the fields below cannot describe."""
    if config.get("attention_bias"):
        # Llama's attention_bias puts a bias on o as well as q, k, v; the model has q, k, v only
        # (Qwen2's, which is implied by its model_type).
        raise HFConfigError(
            "attention_bias true is not supported: it biases o_proj too (qkv_bias is q, k, v only)"
        )
    if config.get("mlp_bias"):
        raise HFConfigError("mlp_bias true is not supported: the MLP has no biases")
    if model_type == "olmoe" and config.get("clip_qkv") is not None:
        raise HFConfigError(f"clip_qkv {config['clip_qkv']} is not supported: q, k and v are not clipped")
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if config.get("use_sliding_window"):
            window = config.get("sliding_window")
            raise HFConfigError(f"use_sliding_window true (sliding_window {window}) is not supported: "
                                "attention is over the whole sequence")  # fmt: skip
        if config.get("use_mrope"):
            raise HFConfigError("use_mrope true is not supported: multimodal rotary positions")
    elif config.get("sliding_window") is not None:
        # Mistral 7B v0.1 attends over the last 4096 tokens only (Jiang et al. 2023, section 2)
        raise HFConfigError(
            f"sliding_window {config['sliding_window']} is not supported: attention is over the whole sequence"
        )


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and Llama 3.1's scaling. transformers 5 writes both into rope_parameters; older
    files have rope_theta and rope_scaling (rope_type, or `type` before transformers 4.45)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = params.get("rope_theta", config.get("rope_theta", DEFAULTS["rope_theta"]))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return out
    if kind != "llama3":
        raise HFConfigError(
            f"rope_scaling rope_type {kind!r} is not supported; supported: 'llama3' (Llama 3.1) or none"
        )
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise HFConfigError(f"rope_scaling: 'llama3' scaling needs {key!r}; got {sorted(scaling)}")
    return out | {
        "rope_scaling_factor": float(scaling["factor"]),
        "rope_low_freq_factor": float(scaling["low_freq_factor"]),
        "rope_high_freq_factor": float(scaling["high_freq_factor"]),
        "rope_original_max_positions": int(scaling["original_max_position_embeddings"]),
    }


def _int(config: dict[str, Any], name: str) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = "missing" if name not in config else f"{value!r} is not a positive integer"
        raise HFConfigError(f"{name}: {what}")
    return value
