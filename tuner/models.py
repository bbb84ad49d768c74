"""A model's name where studies are listed and compared (the store's model_key, `tuner best`, the
dashboard), and the family the name belongs to (trainer.config.GPTConfig.family)."""

from __future__ import annotations

import dataclasses

from trainer.config import MODEL_PRESETS, GPTConfig


def model_key(model: GPTConfig, preset: str | None = None) -> str:
    """The preset's name; for a model of another family than GPT with a preset's fields (a
    Hugging Face config.json of a published model: tuner/hfconfig.py), that preset's name, its
    seq_len aside (a study trains at its own); else the shape: "L24-h2048-a16" for a GPT, as
    keys always were, and the family with the KV heads before it for another family
    ("llama-L32-h4096-a32-kv8"), so that a GPT and a Llama of one shape are not one model."""
    if preset:
        return preset
    shape = f"L{model.num_layers}-h{model.hidden_size}-a{model.num_heads}"
    if model.family == "gpt":
        return shape
    for name, known in MODEL_PRESETS.items():
        if dataclasses.replace(model, seq_len=known.seq_len) == known:
            return name
    return f"{model.family}-{shape}-kv{model.kv_heads}"


def model_family(key: str) -> str:
    """The family of a model_key: a preset's, or the prefix of a shape key (none: GPT)."""
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key].family
    family, sep, _ = key.partition("-L")
    return family if sep and family else "gpt"


def model_label(key: str) -> str:
    """The key with its family, as listings show it: "llama3.1-8b (llama)"."""
    return f"{key} ({model_family(key)})"
