"""The family registry (trainer/contract/families/) and the table of block parts
(trainer/contract/blocks.py): each preset lives in the folder of the family its parts make, each
Hugging Face architecture is read by one family into a model of that family, the parts' tables are
the choices ModelConfig accepts, and a family added to the registry is what ModelConfig, the
presets and the model keys see."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from trainer.contract import blocks
from trainer.contract.families import CUSTOM, FAMILIES, Family, family_named, family_of
from trainer.contract.model import ModelConfig
from trainer.contract.presets import MODEL_PRESETS
from tuner.hfconfig import SUPPORTED, HFConfigError, hf_config_fields
from tuner.models import model_family, model_key

HF_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"


def test_every_preset_is_in_the_folder_of_the_family_its_parts_make() -> None:
    names = [name for f in FAMILIES.values() for name in f.presets]
    assert len(names) == len(set(names)) == len(MODEL_PRESETS)  # no preset in two families
    for family in FAMILIES.values():
        for name, model in family.presets.items():
            assert family_of(model) is family, (name, family.name, model.family)
            assert model_family(name) == family.name
    assert not CUSTOM.presets and not CUSTOM.hf_architectures


def test_the_parts_tables_are_the_choices_the_model_accepts() -> None:
    hints = typing.get_type_hints(ModelConfig)
    for field, table in (("norm", blocks.NORM_KINDS), ("mlp", blocks.MLP_KINDS_TABLE),
                         ("positions", blocks.POSITIONS_KINDS), ("attention", blocks.ATTENTION_KINDS)):  # fmt: skip
        assert typing.get_args(hints[field]) == tuple(table), field
        assert all(part.name == name for name, part in table.items())
    m = MODEL_PRESETS["llama3.1-8b"]
    assert (m.norm_kind.name, m.mlp_kind.name, m.positions_kind.name) == ("rmsnorm", "swiglu", "rope")
    # the MLP's default widths come from its part: GELU's 4h, SwiGLU's 8h/3 up to 256
    assert ModelConfig(num_layers=1, hidden_size=96, num_heads=4).ffn_size == 384
    assert ModelConfig(num_layers=1, hidden_size=4096, num_heads=32, mlp="swiglu").ffn_size == 11008


@pytest.mark.parametrize("path", sorted(HF_CONFIGS.glob("*.json")), ids=lambda p: p.stem)
def test_each_published_file_is_read_by_the_family_that_registered_its_architecture(path: Path) -> None:
    config = json.loads(path.read_text())
    (arch,) = config["architectures"]
    readers = [f for f in FAMILIES.values() if arch in f.hf_architectures]
    assert len(readers) == 1 and SUPPORTED[arch] == config["model_type"]
    if path.stem == "Mistral-7B-v0.1":  # its 4096-token sliding window is refused (test_hfconfig.py)
        with pytest.raises(HFConfigError, match="sliding_window 4096"):
            hf_config_fields(config)
        return
    assert ModelConfig(**hf_config_fields(config)).family == readers[0].name


def test_unknown_family_names_are_refused_with_the_known_ones() -> None:
    assert family_named("llama").label == "Llama"
    with pytest.raises(ValueError, match=r"no model family 'mamba'; families: \['gpt', 'llama', 'deepseek'"):
        family_named("mamba")


def test_a_mix_of_parts_no_family_registers_is_custom() -> None:
    model = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, norm="rmsnorm")  # RMSNorm, GELU, learned
    assert model.family == "custom" and family_of(model) is CUSTOM
    assert model_key(model) == "custom-L2-h64-a4-kv4"


def test_a_registered_family_is_what_the_model_and_its_keys_see(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding a family is a registry line: a family of RMSNorm + GELU + learned positions
    (registered before `custom`) names such models, their keys and the keys' family."""
    family = Family(name="rmsgpt", label="RMS-GPT",
                    block={"norm": "rmsnorm", "mlp": "gelu", "positions": "learned", "attention": "mha"})  # fmt: skip
    registry = {"rmsgpt": family, **FAMILIES}
    monkeypatch.setattr("trainer.contract.families.FAMILIES", registry)
    family_of.cache_clear()
    try:
        model = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, norm="rmsnorm")
        assert model.family == "rmsgpt" and model.architecture == "rmsgpt"
        key = model_key(model)
        assert key == "rmsgpt-L2-h64-a4-kv4" and model_family(key) == "rmsgpt"
        moe = dataclasses.replace(model, num_experts=4, moe_top_k=2)
        assert model_key(moe) == "rmsgpt-moe-L2-h64-a4-kv4-e4k2"
    finally:
        family_of.cache_clear()


def test_latent_attention_on_another_block_is_not_deepseek() -> None:
    """A family is its whole block: latent attention with LayerNorm is `custom`, so an export does
    not write it as torchtitan's deepseek_v3 (RMSNorm, SwiGLU)."""
    ds = MODEL_PRESETS["deepseek-v3"]
    assert ds.family == "deepseek"
    assert dataclasses.replace(ds, norm="layernorm").family == "custom"
