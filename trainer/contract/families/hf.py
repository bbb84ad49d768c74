"""What every family's Hugging Face reader shares (tuner/hfconfig.py reads the file and hands it
to the family that registered its model_type): the error, transformers' defaults, the fields of
the RMSNorm / SwiGLU / RoPE block every supported architecture builds, the refusals every reader
makes, Llama 3.1's RoPE scaling."""

from __future__ import annotations

from typing import Any

DEFAULT_SEQ_LEN = 8192
# Fields that make a mixture of experts (Mixtral, Qwen2-MoE, DeepSeek): the block is not dense.
MOE_FIELDS = (
    "num_local_experts", "num_experts", "num_experts_per_tok", "n_routed_experts", "n_shared_experts",
    "moe_intermediate_size", "shared_expert_intermediate_size",
)  # fmt: skip
# transformers' defaults for fields a file may leave out (LlamaConfig, MistralConfig, Qwen2Config
# agree on these).
DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}


class HFConfigError(ValueError):
    """A config.json this reader cannot turn into the model it describes; names the field."""


def int_field(config: dict[str, Any], name: str) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = "missing" if name not in config else f"{value!r} is not a positive integer"
        raise HFConfigError(f"{name}: {what}")
    return value


def refuse_biases(config: dict[str, Any]) -> None:
    """Biases the block has not: on o (Llama's attention_bias biases o as well as q, k, v; the
    model has q, k, v only, Qwen2's, implied by its model_type) or in the MLP."""
    if config.get("attention_bias"):
        raise HFConfigError(
            "attention_bias true is not supported: it biases o_proj too (qkv_bias is q, k, v only)"
        )
    if config.get("mlp_bias"):
        raise HFConfigError("mlp_bias true is not supported: the MLP has no biases")


def refuse_sliding_window(config: dict[str, Any]) -> None:
    if config.get("sliding_window") is not None:
        # Mistral 7B v0.1 attends over the last 4096 tokens only (Jiang et al. 2023, section 2)
        raise HFConfigError(
            f"sliding_window {config['sliding_window']} is not supported: attention is over the whole sequence"
        )


def block_fields(config: dict[str, Any], *, qkv_bias: bool) -> dict[str, Any]:
    """The RMSNorm / SwiGLU / RoPE block's fields every supported architecture has."""
    get = lambda name: config.get(name, DEFAULTS.get(name))  # noqa: E731
    if get("hidden_act") != "silu":
        raise HFConfigError(f"hidden_act {get('hidden_act')!r} is not supported: the SwiGLU MLP uses 'silu'")
    layers, hidden, heads = (
        int_field(config, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads")
    )
    max_positions = config.get("max_position_embeddings") or DEFAULT_SEQ_LEN
    return {
        "num_layers": layers, "hidden_size": hidden, "num_heads": heads,
        "ffn_hidden_size": int_field(config, "intermediate_size"),
        "vocab_size": int_field(config, "vocab_size"), "seq_len": min(DEFAULT_SEQ_LEN, int(max_positions)),
        "norm": "rmsnorm", "norm_eps": float(get("rms_norm_eps")), "mlp": "swiglu", "positions": "rope",
        "tie_embeddings": bool(get("tie_word_embeddings")), "qkv_bias": qkv_bias,
    }  # fmt: skip


def rope_fields(config: dict[str, Any]) -> dict[str, Any]:
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
