"""Llama's block: RMSNorm, a SwiGLU MLP (three matrices), rotary positions, grouped-query
attention (num_kv_heads < num_heads). Mistral's is Llama's; Qwen2's adds a bias to q, k and v;
Qwen3's normalises q and k per head and may widen its heads; the mixtures of experts on it
(Mixtral, Qwen3-MoE, OLMoE) replace the MLP with routed experts (presets.py, hf.py)."""

from __future__ import annotations

from trainer.contract.families.family import Family
from trainer.contract.families.llama import hf
from trainer.contract.families.llama.presets import PRESETS

FAMILY = Family(
    name="llama",
    label="Llama",
    block={"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "attention": "mha"},
    presets=PRESETS,
    hf_architectures=hf.ARCHITECTURES,
    hf_read=hf.read,
    hf_moe_types=hf.MOE_TYPES,
    replicated_units=8.0,  # no dropout masks
    torchtitan_dense="llama3",
    torchtitan_moe="qwen3",
    torchtitan_why="torchtitan's llama3 has no q/k norms nor heads wider than hidden / heads",
)
