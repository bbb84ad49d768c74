"""Named model shapes (presets), each with its source: a preset is just a named ModelConfig."""

from __future__ import annotations

from typing import Any

from trainer.contract.model import ModelConfig


def _llama(num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, ffn_hidden_size: int,
           *, vocab_size: int = 128256, seq_len: int = 8192, tie_embeddings: bool = False,
           rope_scaling_factor: float | None = 8.0, **fields: Any) -> ModelConfig:  # fmt: skip
    """A Llama-family shape: RMSNorm, SwiGLU, RoPE, GQA (Llama 3's base 500000 and rope scaling
    unless `fields` say otherwise)."""
    return ModelConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        ffn_hidden_size=ffn_hidden_size, vocab_size=vocab_size, seq_len=seq_len, norm="rmsnorm", mlp="swiglu",
        positions="rope", rope_theta=fields.pop("rope_theta", 500000.0), rope_scaling_factor=rope_scaling_factor,
        tie_embeddings=tie_embeddings, **fields,
    )  # fmt: skip


def _moe(num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, ffn_hidden_size: int,
         num_experts: int, moe_top_k: int, moe_ffn_hidden_size: int, **fields: Any) -> ModelConfig:  # fmt: skip
    """A mixture of experts on the Llama block (Mixtral, Qwen3-MoE, OLMoE): no rope scaling,
    base 1e6 unless `fields` say otherwise."""
    fields.setdefault("rope_theta", 1000000.0)
    return _llama(
        num_layers, hidden_size, num_heads, num_kv_heads, ffn_hidden_size, rope_scaling_factor=None,
        num_experts=num_experts, moe_top_k=moe_top_k, moe_ffn_hidden_size=moe_ffn_hidden_size, **fields,
    )  # fmt: skip


# Shapes from the papers they name. "gpt-tiny" is the CPU test model; "gpt-1.3b" is GPT-3 XL's shape
# (1.3B with tied embeddings, 1.42B with our untied head).
# 22B / 175B / 1T are the Frontier study's shapes (Dash et al. 2023, table 1).
# The Llama and Qwen presets are their published Hugging Face config.json files (meta-llama/Llama-3.2-1B,
# Llama-3.2-3B, Llama-3.1-8B, -70B, -405B; Qwen/Qwen2.5-7B: docs/models.md), trained at Llama 3's
# 8192-token context (Qwen2.5's pre-training context 4096); "llama-tiny" and "llama-small" are CPU
# shapes of the family with 2 KV heads for 4 query heads.
# The mixtures of experts are their published config.json files too (mistralai/Mixtral-8x7B-v0.1,
# allenai/OLMoE-1B-7B-0924, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, deepseek-ai/DeepSeek-V3:
# docs/models.md), at their pre-training context of 4096 tokens (Mixtral's is not published; 4096 as
# Megatron's Mixtral benchmarks run it). DeepSeek-V3's multi-token-prediction module and its YaRN
# scaling (for the 128k extension after pre-training) are not part of the preset. "moe-tiny",
# "moe-tiny-ds" (DeepSeek's router: sigmoid scores, groups, a shared expert, a dense first layer)
# and "moe-small" are CPU shapes.
MODEL_PRESETS: dict[str, ModelConfig] = {
    "gpt-tiny": ModelConfig(num_layers=4, hidden_size=64, num_heads=4, vocab_size=256, seq_len=32),
    "gpt-small": ModelConfig(num_layers=4, hidden_size=128, num_heads=4, vocab_size=1024, seq_len=128),
    "gpt-125m": ModelConfig(num_layers=12, hidden_size=768, num_heads=12, seq_len=1024),
    "gpt-350m": ModelConfig(num_layers=24, hidden_size=1024, num_heads=16, seq_len=1024),
    "gpt-1.3b": ModelConfig(num_layers=24, hidden_size=2048, num_heads=16, seq_len=2048),
    "gpt-2.7b": ModelConfig(num_layers=32, hidden_size=2560, num_heads=32, seq_len=2048),
    "gpt-22b": ModelConfig(num_layers=48, hidden_size=6144, num_heads=48, seq_len=2048),
    "gpt-175b": ModelConfig(num_layers=96, hidden_size=12288, num_heads=96, seq_len=2048),
    "gpt-1t": ModelConfig(num_layers=128, hidden_size=25600, num_heads=160, seq_len=2048),
    "llama-tiny": _llama(4, 64, 4, 2, 192, vocab_size=256, seq_len=32, rope_scaling_factor=None, rope_theta=10000.0),
    "llama-small": _llama(4, 128, 4, 2, 384, vocab_size=1024, seq_len=128, rope_scaling_factor=None,
                          rope_theta=10000.0),
    "llama3.2-1b": _llama(16, 2048, 32, 8, 8192, tie_embeddings=True, rope_scaling_factor=32.0),
    "llama3.2-3b": _llama(28, 3072, 24, 8, 8192, tie_embeddings=True, rope_scaling_factor=32.0),
    "llama3.1-8b": _llama(32, 4096, 32, 8, 14336),
    "llama3.1-70b": _llama(80, 8192, 64, 8, 28672),
    "llama3.1-405b": _llama(126, 16384, 128, 8, 53248),
    "qwen2.5-7b": _llama(28, 3584, 28, 4, 18944, vocab_size=152064, seq_len=4096, rope_scaling_factor=None,
                         rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True),
    "moe-tiny": _moe(4, 64, 4, 2, 192, 8, 2, 64, vocab_size=256, seq_len=32, rope_theta=10000.0),
    "moe-tiny-ds": _moe(4, 64, 4, 2, 192, 8, 2, 64, vocab_size=256, seq_len=32, rope_theta=10000.0,
                        moe_shared_ffn_hidden_size=64, moe_dense_layers=1, moe_router_score="sigmoid",
                        moe_groups=4, moe_topk_groups=2, moe_route_scale=2.5, moe_aux_loss_coef=0.01,
                        moe_bias_update_rate=0.001),
    "moe-small": _moe(4, 128, 4, 2, 384, 8, 2, 128, vocab_size=1024, seq_len=128, rope_theta=10000.0),
    "mixtral-8x7b": _moe(32, 4096, 32, 8, 14336, 8, 2, 14336, vocab_size=32000, seq_len=4096,
                         moe_aux_loss_coef=0.02),
    "olmoe-1b-7b": _moe(16, 2048, 16, 16, 1024, 64, 8, 1024, vocab_size=50304, seq_len=4096,
                        rope_theta=10000.0, qk_norm="proj", moe_norm_topk=False, moe_aux_loss_coef=0.01),
    "qwen3-30b-a3b": _moe(48, 2048, 32, 4, 6144, 128, 8, 768, vocab_size=151936, seq_len=4096, norm_eps=1e-6,
                          attention_head_dim=128, qk_norm="head", moe_aux_loss_coef=0.001),
    "qwen3-235b-a22b": _moe(94, 4096, 64, 4, 12288, 128, 8, 1536, vocab_size=151936, seq_len=4096,
                            norm_eps=1e-6, attention_head_dim=128, qk_norm="head", moe_aux_loss_coef=0.001),
    "deepseek-v3": ModelConfig(
        num_layers=61, hidden_size=7168, num_heads=128, ffn_hidden_size=18432, vocab_size=129280, seq_len=4096,
        norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", positions="rope", rope_theta=10000.0, attention="mla",
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=256, moe_top_k=8, moe_ffn_hidden_size=2048, moe_shared_ffn_hidden_size=2048,
        moe_dense_layers=3, moe_router_score="sigmoid", moe_groups=8, moe_topk_groups=4, moe_route_scale=2.5,
        moe_aux_loss_coef=0.0001, moe_bias_update_rate=0.001,
    ),
}  # fmt: skip
