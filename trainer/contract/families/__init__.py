"""THE registry of model families, in torchtitan's spirit (its TrainSpec registry): each family
registers in its own folder its block (the parts of trainer/contract/blocks.py it is made of),
its presets with their sources, its Hugging Face readers and refusals, its pricing constants and
what each export target builds of it (family.py: Family). Adding a family is one folder and one
line below; code elsewhere asks the model's family (`family_of(m)`) or its parts
(`m.mlp_kind`), never compares a family's name.

    gpt/        GPT-2/3's block: LayerNorm, GELU, learned positions
    llama/      Llama's block: RMSNorm, SwiGLU, RoPE (Llama, Mistral, Qwen2/3, and the mixtures of
                experts built on it: Mixtral, Qwen3-MoE, OLMoE)
    deepseek/   DeepSeek-V3: multi-head latent attention (on Llama's block)
    custom      any other mix of parts (no presets, no readers): priced and trained, exported as
                a layout only
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from trainer.contract.families.deepseek import FAMILY as DEEPSEEK
from trainer.contract.families.family import Family
from trainer.contract.families.gpt import FAMILY as GPT
from trainer.contract.families.llama import FAMILY as LLAMA

if TYPE_CHECKING:
    from trainer.contract.model import ModelConfig

CUSTOM = Family(
    name="custom",
    label="custom",
    block={},
    torchtitan_why="torchtitan has no model with this block; its llama3 is RMSNorm, SwiGLU and RoPE",
)

# The registry: one line a family, `custom` last (it matches any model).
FAMILIES: dict[str, Family] = {f.name: f for f in (GPT, LLAMA, DEEPSEEK, CUSTOM)}

__all__ = ["FAMILIES", "Family", "family_named", "family_of"]


@lru_cache(maxsize=256)
def family_of(model: ModelConfig) -> Family:
    """The first registered family whose block the model's parts match."""
    return next(f for f in FAMILIES.values() if f.matches(model))


def family_named(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"no model family {name!r}; families: {list(FAMILIES)}")
    return FAMILIES[name]
