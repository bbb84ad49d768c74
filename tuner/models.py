"""A model's name where studies are listed and compared (the store's model_key, `tuner best`, the
dashboard), and the family the name belongs to (trainer.contract.model.ModelConfig.family)."""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel, computed_field

from trainer.contract.families import FAMILIES, family_of
from trainer.contract.model import ModelConfig
from trainer.contract.presets import MODEL_PRESETS


def _same_model(model: ModelConfig, known: ModelConfig) -> bool:
    """Equal fields but seq_len (a study trains at its own) and the spelling of multi-head
    attention (num_kv_heads None or num_heads: Hugging Face's OLMoE file says 16 of 16)."""

    def normal(m: ModelConfig) -> ModelConfig:
        return dataclasses.replace(m, seq_len=known.seq_len, num_kv_heads=m.kv_heads)

    return normal(model) == normal(known)


def model_key(model: ModelConfig, preset: str | None = None) -> str:
    """The preset's name; for a model of a family without bare keys with a preset's fields (a
    Hugging Face config.json of a published model: tuner/hfconfig.py), that preset's name, its
    seq_len aside (a study trains at its own); else the shape: "L24-h2048-a16" for a dense model of
    the family with bare keys (GPT's, as keys always were: Family.bare_key), and the architecture
    with the KV heads before it otherwise ("llama-L32-h4096-a32-kv8"), so that a GPT and a Llama of
    one shape are not one model; a mixture of experts adds its experts and top-k
    ("llama-moe-L48-h2048-a32-kv4-e128k8")."""
    if preset:
        return preset
    shape = f"L{model.num_layers}-h{model.hidden_size}-a{model.num_heads}"
    if family_of(model).bare_key and not model.moe:  # a mixture of experts' key names its experts
        return shape
    for name, known in MODEL_PRESETS.items():
        if _same_model(model, known):
            return name
    experts = f"-e{model.num_experts}k{model.moe_top_k}" if model.moe else ""  # the experts' part of the key
    return f"{model.architecture}-{shape}-kv{model.kv_heads}{experts}"


_BARE = next(f.name for f in FAMILIES.values() if f.bare_key)  # the family whose keys are bare shapes


def model_family(key: str) -> str:
    """The family of a model_key: a preset's, or the prefix of a shape key (none: the family with
    bare keys)."""
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key].family
    family, sep, _ = key.partition("-L")
    return family.removesuffix("-moe") if sep and family else _BARE


def model_architecture(key: str) -> str:
    """The family with "-moe" for a mixture of experts (ModelConfig.architecture), from a key."""
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key].architecture
    family, sep, _ = key.partition("-L")
    return family if sep and family else _BARE


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def model_label(key: str) -> str:
    """The key with its architecture, as listings show it: "llama3.1-8b (llama)"; a mixture-of-experts
    preset with its total and active parameters: "qwen3-30b-a3b (llama-moe, 30.5B total, 3.35B active)"."""
    arch = model_architecture(key)
    if key in MODEL_PRESETS and MODEL_PRESETS[key].moe:  # a mixture of experts: its total and active
        m = MODEL_PRESETS[key]
        return f"{key} ({arch}, {_count(m.num_params)} total, {_count(m.num_active_params)} active)"
    return f"{key} ({arch})"


class WithFamily(BaseModel):
    """A listed row (study, best, prediction) whose `model` field is a model_key: `family` comes
    with it. The subclass declares `model` where its fields put it (the mixin adds none)."""

    @computed_field
    @property
    def family(self) -> str:
        """The model's family (gpt, llama, deepseek, custom: tuner/models.py), from its key."""
        return model_family(self.model)  # type: ignore[attr-defined]
