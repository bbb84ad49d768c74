"""DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3: docs/models.md) at its
pre-training context of 4096 tokens. Its multi-token-prediction module and its YaRN scaling (for
the 128k extension after pre-training) are not part of the preset. "deepseek-tiny" is a CPU shape of
the same block: latent attention (q rank 32, kv rank 32, heads of 16 + 8 rotary, values of 16), a
dense first layer and 8 routed experts of 64 (top 2 of the best 2 of 4 groups) with a shared one."""

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
    "deepseek-tiny": ModelConfig(
        num_layers=4, hidden_size=64, num_heads=4, ffn_hidden_size=192, vocab_size=256, seq_len=32,
        norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", positions="rope", rope_theta=10000.0, attention="mla",
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_experts=8, moe_top_k=2, moe_ffn_hidden_size=64, moe_shared_ffn_hidden_size=64,
        moe_dense_layers=1, moe_router_score="sigmoid", moe_groups=4, moe_topk_groups=2, moe_route_scale=2.5,
        moe_aux_loss_coef=0.01, moe_bias_update_rate=0.001, moe_router_fp32=True,
    ),
}  # fmt: skip
