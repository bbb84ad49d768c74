"""Our mixture-of-experts layer (trainer/moe.py) is transformers' with the same weights, one process,
fp32: DeepSeek-V3's (sigmoid scores, group-limited routing, the expert bias in the choice, a shared
expert, route scale; norm_topk_prob either way) and Qwen3-MoE's (softmax top-k, norm_topk_prob
either way: false is OLMoE's router). transformers is a test dependency only. The expert bias is
part of the layer's state_dict (a checkpoint's e_score_correction_bias loads into it). The "batch"
auxiliary loss is transformers' load_balancing_loss_func."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, load_balancing_loss_func

from trainer.contract.presets import MODEL_PRESETS
from trainer.model import MLP
from trainer.moe import MoE

DS = MODEL_PRESETS["moe-tiny-ds"]  # 8 experts of 64, top 2, 4 groups (best 2), a shared expert of 64
QWEN = MODEL_PRESETS["moe-tiny"]  # 8 experts, top 2, softmax
TOL = 1e-5  # fp32
# ... and relative: our experts weigh their activation, transformers' their output (the same
# product, rounded in another order: 1.7e-5 at outputs of 20 in deepseek-no-norm)
RTOL = 1e-6
# The experts' loop as written: a config built outside from_pretrained leaves the choice None, which
# transformers 5.0 (our floor) looks up and fails on (KeyError: None); later releases default it.
EAGER = "eager"


def ours(cfg) -> MoE:
    shared = MLP(cfg, cfg.moe_shared_ffn_hidden_size) if cfg.moe_shared_ffn_hidden_size else None
    layer = MoE(cfg, layer_id=cfg.moe_dense_layers, shared=shared)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        if layer.router.expert_bias is not None:  # large enough to change choices
            layer.router.expert_bias.copy_(torch.randn(cfg.num_experts, generator=gen) * 0.3)
    return layer


def experts_state(layer: MoE) -> dict[str, torch.Tensor]:
    """Our (E, h, f) gate/up and (E, f, h) down as transformers' (E, 2f, h) and (E, h, f)."""
    w = layer.experts
    return {
        "experts.gate_up_proj": torch.cat([w.w1.transpose(1, 2), w.w3.transpose(1, 2)], dim=1),
        "experts.down_proj": w.w2.transpose(1, 2),
    }


def deepseek(layer: MoE) -> torch.nn.Module:
    cfg = layer.cfg
    hf = DeepseekV3MoE(DeepseekV3Config(
        hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.expert_ffn_size, n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k, n_group=cfg.moe_groups, topk_group=cfg.moe_topk_groups,
        routed_scaling_factor=cfg.moe_route_scale, norm_topk_prob=cfg.moe_norm_topk,
        n_shared_experts=cfg.moe_shared_ffn_hidden_size // cfg.expert_ffn_size, hidden_act="silu",
        experts_implementation=EAGER,
    ))  # fmt: skip
    s = layer.shared
    hf.load_state_dict({
        **experts_state(layer), "gate.weight": layer.router.gate.weight,
        "gate.e_score_correction_bias": layer.router.expert_bias,
        "shared_experts.gate_proj.weight": s.gate.weight, "shared_experts.up_proj.weight": s.fc.weight,
        "shared_experts.down_proj.weight": s.proj.weight,
    })  # fmt: skip
    return hf


def qwen3(layer: MoE) -> torch.nn.Module:
    cfg = layer.cfg
    hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(
        hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.expert_ffn_size, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k, norm_topk_prob=cfg.moe_norm_topk, hidden_act="silu",
        experts_implementation=EAGER,
    ))  # fmt: skip
    hf.load_state_dict({**experts_state(layer), "gate.weight": layer.router.gate.weight})
    return hf


CASES = {
    "deepseek-norm": (DS, deepseek, True),
    "deepseek-no-norm": (DS, deepseek, False),  # sigmoid weights as they are, then scaled
    "qwen3-norm": (QWEN, qwen3, True),
    "olmoe-no-norm": (QWEN, qwen3, False),
}


@pytest.mark.parametrize("case", CASES)
def test_the_moe_layer_equals_transformers(case: str) -> None:
    base, reference, norm = CASES[case]
    layer = ours(dataclasses.replace(base, moe_norm_topk=norm))
    hf = reference(layer).eval()
    x = torch.randn(2, 16, base.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = layer(x), hf(x)
    assert torch.allclose(got, want, atol=TOL, rtol=RTOL), (got - want).abs().max()


def test_the_sigmoid_router_follows_norm_topk() -> None:
    """norm_topk_prob false (a DeepSeek-style sigmoid router as configured) leaves the chosen
    scores unnormalised: they were renormalised whatever the setting."""
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]])
    for norm, total in ((True, 1.0), (False, 1.7)):
        cfg = dataclasses.replace(
            DS, moe_norm_topk=norm, moe_groups=1, moe_topk_groups=1, moe_route_scale=1.0
        )
        _, weights = ours(cfg).router.select(scores, balanced=False)
        assert weights.sum().item() == pytest.approx(total)


def test_the_expert_bias_is_saved_and_loaded() -> None:
    """The auxiliary-loss-free bias is state: a trained one is saved, a checkpoint's is loaded."""
    layer = ours(DS)
    state = layer.state_dict()
    assert torch.equal(state["router.expert_bias"], layer.router.expert_bias)
    other = ours(DS)
    with torch.no_grad():
        other.router.expert_bias.zero_()
    other.load_state_dict(state)
    assert torch.equal(other.router.expert_bias, layer.router.expert_bias)


@pytest.mark.parametrize("norm", [True, False], ids=["qwen3", "olmoe"])
def test_the_batch_aux_loss_is_transformers_load_balancing_loss(norm: bool) -> None:
    """moe_aux_loss "batch" (Mixtral, Qwen3-MoE, OLMoE): one MoE layer's auxiliary loss is
    transformers' load_balancing_loss_func of its router logits (the model's, for a model of one
    MoE layer; ours averages the layers' losses where transformers pools their tokens); learned
    routing, so the loss is not the balanced value k."""
    cfg = dataclasses.replace(
        QWEN, num_layers=1, moe_norm_topk=norm, moe_aux_loss="batch", moe_aux_loss_coef=1.0
    )
    layer = ours(cfg)
    x = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer(x)
        logits = layer.router.gate(x).reshape(-1, cfg.num_experts)
    want = load_balancing_loss_func((logits,), cfg.num_experts, cfg.moe_top_k)
    assert layer.aux_loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert abs(want.item() - cfg.moe_top_k) > 0.05  # not the balanced router's value


def test_the_batch_aux_loss_averages_the_layers() -> None:
    """With L MoE layers each layer's loss is divided by L: identical layers give one layer's value."""
    one, four = (
        dataclasses.replace(QWEN, num_layers=n, moe_aux_loss="batch", moe_aux_loss_coef=1.0) for n in (1, 4)
    )
    x = torch.randn(2, 16, QWEN.hidden_size, generator=torch.Generator().manual_seed(2))
    layers = [ours(one), ours(four)]
    with torch.no_grad():
        for layer in layers:
            layer(x)
    assert layers[1].aux_loss.item() * 4 == pytest.approx(layers[0].aux_loss.item(), rel=1e-6)


def test_the_deepseek_router_runs_in_fp32_in_a_bf16_layer() -> None:
    """moe_router_fp32 (DeepSeek-V3's presets and configs): in a bf16 layer the router's logits are
    transformers' DeepseekV3TopkRouter's, fp32 matmul of fp32 casts, bit for bit, and under
    autocast too; without it they are the bf16 matmul's."""
    layer = ours(DS).to(torch.bfloat16)
    hf = deepseek(ours(DS)).to(torch.bfloat16)
    hf.gate.weight.data.copy_(layer.router.gate.weight)
    x = torch.randn(32, DS.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        want = hf.gate(x)
        want = want[0] if isinstance(want, tuple) else want  # 5.0: the logits; later (logits, weights, ids)
        assert want.dtype == torch.float32
        assert torch.equal(layer.router.logits(x), want)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(layer.router.logits(x), want)
        plain = ours(dataclasses.replace(DS, moe_router_fp32=False)).to(torch.bfloat16)
        plain.router.gate.weight.copy_(layer.router.gate.weight)
        assert plain.router.logits(x).dtype == torch.bfloat16
