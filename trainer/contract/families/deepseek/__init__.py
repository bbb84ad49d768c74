"""DeepSeek-V3's block: multi-head latent attention (ModelConfig's attention "mla") on Llama's
RMSNorm, SwiGLU and RoPE; its mixture of experts routes with sigmoid scores over groups, an
expert bias and shared experts (presets.py, hf.py)."""

from __future__ import annotations

from trainer.contract.families.deepseek import hf
from trainer.contract.families.deepseek.presets import PRESETS
from trainer.contract.families.family import Family

FAMILY = Family(
    name="deepseek",
    label="DeepSeek",
    # its whole block: latent attention on another block is `custom` (torchtitan's deepseek_v3 and the
    # header's "DeepSeek" would describe another model than the one measured)
    block={"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "attention": "mla"},
    presets=PRESETS,
    hf_architectures=hf.ARCHITECTURES,
    hf_read=hf.read,
    hf_notes=hf.notes,
    hf_moe_types=hf.MOE_TYPES,
    # As GPT's block is priced, dropout masks included: a named inaccuracy (DeepSeek-V3 trains
    # without dropout, 8 would be right) kept so that predictions stay bit-identical (issue 36).
    replicated_units=10.0,
    torchtitan_moe="deepseek_v3",
    torchtitan_why="torchtitan's deepseek_v3 is a mixture of experts; a dense latent-attention model has no flavor",
)
