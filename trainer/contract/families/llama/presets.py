"""The Llama block's presets. The dense ones are their published Hugging Face config.json files
(meta-llama/Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B, -70B, -405B; Qwen/Qwen2.5-7B: docs/models.md),
trained at Llama 3's 8192-token context (Qwen2.5's pre-training context 4096); "llama-tiny" and
"llama-small" are CPU shapes with 2 KV heads for 4 query heads. The mixtures of experts are their
published config.json files too (mistralai/Mixtral-8x7B-v0.1, allenai/OLMoE-1B-7B-0924,
Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B: docs/models.md), at their pre-training context of 4096
tokens (Mixtral's is not published; 4096 as Megatron's Mixtral benchmarks run it). "moe-tiny",
"moe-tiny-ds" (DeepSeek's router on the Llama block: sigmoid scores, groups, a shared expert, a dense
first layer) and "moe-small" are CPU shapes."""

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


PRESETS: dict[str, ModelConfig] = {
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
                        moe_bias_update_rate=0.001, moe_router_fp32=True),
    "moe-small": _moe(4, 128, 4, 2, 384, 8, 2, 128, vocab_size=1024, seq_len=128, rope_theta=10000.0),
    "mixtral-8x7b": _moe(32, 4096, 32, 8, 14336, 8, 2, 14336, vocab_size=32000, seq_len=4096,
                         moe_aux_loss_coef=0.02, moe_aux_loss="batch"),
    "olmoe-1b-7b": _moe(16, 2048, 16, 16, 1024, 64, 8, 1024, vocab_size=50304, seq_len=4096,
                        rope_theta=10000.0, qk_norm="proj", moe_norm_topk=False, moe_aux_loss_coef=0.01,
                        moe_aux_loss="batch"),
    "qwen3-30b-a3b": _moe(48, 2048, 32, 4, 6144, 128, 8, 768, vocab_size=151936, seq_len=4096, norm_eps=1e-6,
                          attention_head_dim=128, qk_norm="head", moe_aux_loss_coef=0.001,
                          moe_aux_loss="batch"),
    "qwen3-235b-a22b": _moe(94, 4096, 64, 4, 12288, 128, 8, 1536, vocab_size=151936, seq_len=4096,
                            norm_eps=1e-6, attention_head_dim=128, qk_norm="head", moe_aux_loss_coef=0.001,
                            moe_aux_loss="batch"),
}  # fmt: skip
