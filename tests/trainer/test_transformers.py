"""Our Llama block is Hugging Face's: with the same weights, the tiny Llama's logits equal those of
transformers' LlamaForCausalLM (and Qwen2ForCausalLM for a q/k/v bias), tied head and Llama 3.1's
rope scaling included. transformers is a test dependency only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from trainer.contract.model import ModelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.model import GPT

LLAMA = MODEL_PRESETS["llama-tiny"]
# Llama 3.1's scaling with an original context of 8 tokens, so that it moves frequencies the
# 32-token sequence really turns through (at 8192, as in Llama 3.1, it would change nothing here).
SCALED = {"rope_scaling_factor": 8.0, "rope_original_max_positions": 8, "rope_theta": 500000.0}
VARIANTS = {
    "llama": {},
    "tied": {"tie_embeddings": True},
    "qkv-bias": {"qkv_bias": True},  # Qwen2
    "rope-scaled": SCALED,
}
TOL = 1e-5  # fp32; measured 2.4e-7 for logits of magnitude ~1


def hf_model(cfg: ModelConfig) -> torch.nn.Module:
    """transformers' model of the same shape (eager attention: the reference maths)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_factor is not None:
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_positions,
        }
    fields = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
        rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.seq_len, tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu", attn_implementation="eager", rope_parameters=rope,
    )  # fmt: skip
    if cfg.qkv_bias:  # Qwen2's attention is Llama's with a bias on q, k and v
        return Qwen2ForCausalLM(Qwen2Config(**fields))
    return LlamaForCausalLM(LlamaConfig(**fields))


def hf_state_dict(ours: GPT) -> dict[str, torch.Tensor]:
    """Our weights under Hugging Face's names (q and k as they are: the same rotate_half layout)."""
    sd = {"model.embed_tokens.weight": ours.embed.tok.weight, "model.norm.weight": ours.norm.weight}
    if not ours.cfg.tie_embeddings:
        sd["lm_head.weight"] = ours.head.weight
    names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
             "attn.wo": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.fc": "mlp.up_proj",
             "mlp.proj": "mlp.down_proj"}  # fmt: skip
    for name, p in ours.layers.named_parameters():  # "0.attn.wq.weight" -> 0, attn.wq, weight
        i, rest = name.split(".", 1)
        module, kind = rest.rsplit(".", 1)
        sd[f"model.layers.{i}.{names[module]}.{kind}"] = p
    return {k: v.detach().clone() for k, v in sd.items()}


def both(variant: dict) -> tuple[GPT, torch.nn.Module, torch.Tensor]:
    cfg = dataclasses.replace(LLAMA, **variant)
    ours = GPT(cfg)
    ours.init_weights(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms and biases away from their init (1 and 0), so they are checked
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=gen) * (0.5 if name.endswith(".bias") else 0.1))
    hf = hf_model(cfg)
    missing, unexpected = hf.load_state_dict(hf_state_dict(ours), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_embeddings:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    idx = torch.randint(cfg.vocab_size, (2, cfg.seq_len), generator=gen)
    return ours, hf, idx


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_logits_equal_transformers(variant: dict) -> None:
    ours, hf, idx = both(variant)
    with torch.no_grad():
        got, want = ours(idx), hf(idx).logits
    assert want.abs().max() > 0.1  # not a degenerate comparison
    assert (got - want).abs().max().item() < TOL


def test_rope_scaling_changes_the_result() -> None:
    """The scaled case above tests the scaling, not plain RoPE again."""
    scaled, _, idx = both(SCALED)
    plain = GPT(dataclasses.replace(scaled.cfg, rope_scaling_factor=None))
    plain.load_state_dict(scaled.state_dict())
    with torch.no_grad():
        assert (scaled(idx) - plain(idx)).abs().max().item() > 100 * TOL
