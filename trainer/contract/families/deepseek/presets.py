"""DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3: docs/models.md) at its
pre-training context of 4096 tokens. Its multi-token-prediction module and its YaRN scaling (for
the 128k extension after pre-training) are not part of the preset."""

from __future__ import annotations

from trainer.contract.model import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    "deepseek-v3": ModelConfig(
        num_layers=61, hidden_size=7168, num_heads=128, ffn_hidden_size=18432, vocab_size=129280, seq_len=4096,
        norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", positions="rope", rope_theta=10000.0, attention="mla",
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=256, moe_top_k=8, moe_ffn_hidden_size=2048, moe_shared_ffn_hidden_size=2048,
        moe_dense_layers=3, moe_router_score="sigmoid", moe_groups=8, moe_topk_groups=4, moe_route_scale=2.5,
        moe_aux_loss_coef=0.0001, moe_bias_update_rate=0.001, moe_router_fp32=True,
    ),
}  # fmt: skip
