"""Our DeepSeek-V3 block is transformers' with the same weights: the tiny DeepSeek's logits (latent
attention, q through its low-rank bottleneck or not, a dense first layer, sigmoid-routed experts
with groups, the expert bias and a shared expert) equal those of transformers'
DeepseekV3ForCausalLM, one process, fp32. transformers is a test dependency only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from tests.trainer.test_moe_transformers import EAGER, experts_state
from trainer.contract.model import ModelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.model import GPT

DEEPSEEK = MODEL_PRESETS["deepseek-tiny"]
TOL = 1e-5  # fp32


def hf_model(cfg: ModelConfig) -> torch.nn.Module:
    """transformers' model of the same shape (eager attention, interleaved rotary dims: its default)."""
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
        moe_intermediate_size=cfg.expert_ffn_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        n_shared_experts=cfg.moe_shared_ffn_hidden_size // cfg.expert_ffn_size, n_routed_experts=cfg.num_experts,
        routed_scaling_factor=cfg.moe_route_scale, kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, n_group=cfg.moe_groups, topk_group=cfg.moe_topk_groups,
        num_experts_per_tok=cfg.moe_top_k, first_k_dense_replace=cfg.moe_dense_layers,
        norm_topk_prob=cfg.moe_norm_topk, rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, rope_interleave=True,
        tie_word_embeddings=False, hidden_act="silu", attn_implementation="eager",
        experts_implementation=EAGER,
    ))  # fmt: skip


NAMES = {
    "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "attn.wq": "self_attn.q_proj", "attn.wq_a": "self_attn.q_a_proj", "attn.q_norm": "self_attn.q_a_layernorm",
    "attn.wq_b": "self_attn.q_b_proj", "attn.wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attn.kv_norm": "self_attn.kv_a_layernorm", "attn.wkv_b": "self_attn.kv_b_proj", "attn.wo": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj", "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj",
    "moe.router.gate": "mlp.gate", "moe.shared.gate": "mlp.shared_experts.gate_proj",
    "moe.shared.fc": "mlp.shared_experts.up_proj", "moe.shared.proj": "mlp.shared_experts.down_proj",
}  # fmt: skip


def hf_state_dict(ours: GPT) -> dict[str, torch.Tensor]:
    """Our weights under transformers' names: q and k's rotary rows as they are (both models read
    them as interleaved pairs), the experts' stacked as transformers stacks them."""
    sd = {"model.embed_tokens.weight": ours.embed.tok.weight, "model.norm.weight": ours.norm.weight,
          "lm_head.weight": ours.head.weight}  # fmt: skip
    for i, block in ours.layers.items():
        for name, p in block.named_parameters():
            if name.startswith("moe.experts."):
                continue
            module, kind = name.rsplit(".", 1)
            sd[f"model.layers.{i}.{NAMES[module]}.{kind}"] = p
        if block.moe is not None:
            for name, p in experts_state(block.moe).items():
                sd[f"model.layers.{i}.mlp.{name}"] = p
            sd[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = block.moe.router.expert_bias
    return {k: v.detach().clone() for k, v in sd.items()}


def both(variant: dict) -> tuple[GPT, torch.nn.Module, torch.Tensor]:
    cfg = dataclasses.replace(DEEPSEEK, **variant)
    ours = GPT(cfg)
    ours.init_weights(torch.Generator().manual_seed(0))
    ours.init_buffers()
    gen = torch.Generator().manual_seed(1)
    with (
        torch.no_grad()
    ):  # norms away from 1, weights large enough to route unevenly, a bias that moves choices
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "moe" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for moe in (b.moe for b in ours.layers.values() if b.moe is not None):
            moe.router.expert_bias.copy_(torch.randn(cfg.num_experts, generator=gen) * 0.3)
    hf = hf_model(cfg).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(ours), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    idx = torch.randint(cfg.vocab_size, (2, cfg.seq_len), generator=gen)
    return ours.eval(), hf, idx


VARIANTS = {"q-lora": {}, "q-whole": {"q_lora_rank": 0}}


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_deepseek_logits_equal_transformers(variant: dict) -> None:
    ours, hf, idx = both(variant)
    with torch.no_grad():
        got, want = ours(idx), hf(idx).logits
    assert want.abs().max() > 0.1  # not a degenerate comparison
    assert (got - want).abs().max().item() < TOL


def test_the_rotary_pairs_are_interleaved() -> None:
    """DeepSeek's rotary dims are pairs (rope_interleave): read as halves, as Llama's are, the
    logits differ; the test above checks the pairing, not a rotation that happens to agree."""
    ours, hf, idx = both({})
    hf.config.rope_interleave = False
    for layer in hf.model.layers:
        layer.self_attn.config.rope_interleave = False
    with torch.no_grad():
        assert (ours(idx) - hf(idx).logits).abs().max().item() > 100 * TOL
