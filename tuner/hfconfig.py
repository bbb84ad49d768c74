"""A model from a Hugging Face `config.json`: the file transformers saves next to a checkpoint,
read from disk (never fetched) into trainer.config.GPTConfig's fields.

Three architectures build the same dense decoder block (RMSNorm, SwiGLU, rotary positions,
grouped-query attention): LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM, Qwen2 adding
a bias to q, k and v (transformers' Qwen2Attention). Anything in the file that would build another
model than the one the fields describe is refused with the field and its value: a sliding
attention window, biases on o or the MLP, a head_dim that is not hidden/heads, mixture of experts,
a RoPE scaling other than Llama 3.1's. docs/models.md has the table.

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
SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
DEFAULT_SEQ_LEN = 8192
# Fields that make a mixture of experts (Mixtral, Qwen2-MoE, DeepSeek): the block is not dense.
MOE_FIELDS = (
    "num_local_experts", "num_experts", "num_experts_per_tok", "n_routed_experts", "n_shared_experts",
    "moe_intermediate_size", "shared_expert_intermediate_size",
)  # fmt: skip
# transformers' defaults for fields a file may leave out (LlamaConfig, MistralConfig, Qwen2Config
# agree on these).
DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
_SUPPORTED_TEXT = ", ".join(f"{a} (model_type {t!r})" for a, t in SUPPORTED.items())


class HFConfigError(ValueError):
    """A config.json this reader cannot turn into the model it describes; names the field."""


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """GPTConfig's fields from the config.json at `path`."""
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise HFConfigError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFConfigError(f"{path}: not a JSON file: {e}") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
    try:
        return hf_config_fields(config)
    except HFConfigError as e:
        raise HFConfigError(f"{path}: {e}") from None


def hf_config_fields(config: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig's fields from a parsed config.json (docs/models.md, "From a Hugging Face config")."""
    moe = {k: config[k] for k in MOE_FIELDS if config.get(k)}
    if moe:  # first: a Mixtral file is refused for being a mixture, not for its model_type
        raise HFConfigError(f"mixture of experts ({moe}) is not supported: only dense models are")
    model_type = _architecture(config)
    _refuse_unsupported(config, model_type)
    get = lambda name: config.get(name, DEFAULTS.get(name))  # noqa: E731
    if get("hidden_act") != "silu":
        raise HFConfigError(f"hidden_act {get('hidden_act')!r} is not supported: the SwiGLU MLP uses 'silu'")
    layers, hidden, heads = (
        _int(config, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads")
    )
    # LlamaConfig reads a missing num_key_value_heads as multi-head attention (Llama 1 files have
    # none); MistralConfig and Qwen2Config default to other numbers, so those files must say it.
    kv = (
        _int(config, "num_key_value_heads")
        if model_type != "llama" or "num_key_value_heads" in config
        else heads
    )
    head_dim = config.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != hidden:
        raise HFConfigError(
            f"head_dim {head_dim} is not hidden_size / num_attention_heads ({hidden} / {heads}); "
            "attention wider or narrower than the residual stream is not supported"
        )
    max_positions = config.get("max_position_embeddings") or DEFAULT_SEQ_LEN
    fields: dict[str, Any] = {
        "num_layers": layers, "hidden_size": hidden, "num_heads": heads,
        "num_kv_heads": kv if kv != heads else None, "ffn_hidden_size": _int(config, "intermediate_size"),
        "vocab_size": _int(config, "vocab_size"), "seq_len": min(DEFAULT_SEQ_LEN, int(max_positions)),
        "norm": "rmsnorm", "norm_eps": float(get("rms_norm_eps")), "mlp": "swiglu", "positions": "rope",
        "tie_embeddings": bool(get("tie_word_embeddings")), "qkv_bias": model_type == "qwen2",
    }  # fmt: skip
    return fields | _rope(config)


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
    if model_type == "qwen2":
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
