"""A model from a Hugging Face `config.json`: the file transformers saves next to a checkpoint,
read from disk (never fetched) into trainer.contract.model.ModelConfig's fields by the family that
registered its architecture (trainer/contract/families/<family>/hf.py: the Llama block's
LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and the mixtures of
experts on it, MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM; DeepseekV3ForCausalLM).
Anything in the file that would build another model than the one the fields describe is refused
with the field and its value: a sliding attention window, biases on o or the MLP, mixture-of-experts
fields on a dense architecture, a RoPE scaling other than Llama 3.1's. What a preset leaves out on
purpose (DeepSeek-V3's YaRN scaling and multi-token prediction) is left out and said by
hf_config_notes(). docs/models.md has the table.

seq_len is not the file's max_position_embeddings: that is the context the model supports
(131072 for Llama 3.1, reached by long-context training after pre-training at 8192, Llama 3 paper
section 3.4), not the sequence a run trains at. The model's seq_len is DEFAULT_SEQ_LEN (Llama 3's
pre-training context) capped at max_position_embeddings; a study sets its own with
training.seq_len, or `model: {hf_config: ..., seq_len: ...}`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.contract.families import FAMILIES, Family
from trainer.contract.families.hf import DEFAULT_SEQ_LEN, MOE_FIELDS, HFConfigError

__all__ = [
    "DEFAULT_SEQ_LEN", "SUPPORTED", "HFConfigError", "hf_config_fields", "hf_config_notes", "read_hf_config",
    "read_hf_config_notes",
]  # fmt: skip

# architectures entry -> model_type, as transformers pairs them; model_type -> the family reading it
SUPPORTED = {arch: kind for f in FAMILIES.values() for arch, kind in f.hf_architectures.items()}
_READERS: dict[str, Family] = {kind: f for f in FAMILIES.values() for kind in f.hf_architectures.values()}
MOE_TYPES = tuple(kind for f in FAMILIES.values() for kind in f.hf_moe_types)
_SUPPORTED_TEXT = ", ".join(f"{a} (model_type {t!r})" for a, t in SUPPORTED.items())


def _load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise HFConfigError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFConfigError(f"{path}: not a JSON file: {e}") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """ModelConfig's fields from the config.json at `path`."""
    config = _load(path)
    try:
        return hf_config_fields(config)
    except HFConfigError as e:
        raise HFConfigError(f"{path}: {e}") from None


def read_hf_config_notes(path: str | Path) -> list[str]:
    """hf_config_notes() of the config.json at `path` (none when it cannot be read: the fields'
    reader says why)."""
    try:
        return hf_config_notes(_load(path))
    except HFConfigError:
        return []


def hf_config_notes(config: dict[str, Any]) -> list[str]:
    """What the file holds that the model read from it leaves out or takes from elsewhere, one
    sentence each (`tuner plan --hf-config` prints them), as its family's reader says: DeepSeek-V3's
    YaRN RoPE scaling and multi-token-prediction module, the expert-bias rate its file does not
    carry, FP8 weights."""
    family = _READERS.get(config.get("model_type"))  # type: ignore[arg-type]
    return family.hf_notes(config) if family and family.hf_notes else []


def hf_config_fields(config: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields from a parsed config.json (docs/models.md, "From a Hugging Face config"),
    read by the family that registered its model_type."""
    model_type = config.get("model_type")
    moe = {k: config[k] for k in MOE_FIELDS if config.get(k)}
    if moe and model_type not in MOE_TYPES:  # first: named for its experts, not its model_type
        raise HFConfigError(
            f"mixture of experts ({moe}) is not supported with model_type {model_type!r}; mixtures of "
            f"experts are read for model_type {list(MOE_TYPES)}"
        )
    model_type = _architecture(config)
    read = _READERS[model_type].hf_read
    assert read is not None  # a family that registers architectures registers their reader
    return read(config, model_type)


def _architecture(config: dict[str, Any]) -> str:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED.values():
        raise HFConfigError(f"model_type {model_type!r} is not supported; supported: {_SUPPORTED_TEXT}")
    archs = config.get("architectures") or []
    bad = [a for a in archs if SUPPORTED.get(a) != model_type]
    if bad:
        raise HFConfigError(
            f"architectures {archs} is not supported with model_type {model_type!r}; supported: {_SUPPORTED_TEXT}"
        )
    return model_type
