"""Family: what a model family registers in one place (trainer/contract/families/__init__.py
lists them). A family is a named combination of block parts (trainer/contract/blocks.py) with its
presets and their sources, its Hugging Face readers, its pricing constants and what each export
target builds of it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.contract.model import ModelConfig

HFReader = Callable[[dict[str, Any], str], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    """name: ModelConfig.family and the prefix of its models' shape keys (tuner/models.py).
    label: how exports and listings name it ("Llama"). block: the parts that make a model of
    this family, as ModelConfig field values (a model matches when all agree; `custom`, last,
    matches any). bare_key: its dense models' keys are the bare shape ("L24-h2048-a16"), as GPT's
    always were. presets: named shapes, each from the source its module cites.

    hf_architectures: a Hugging Face config.json's `architectures` entry -> its model_type,
    for each type the family reads; hf_read(config, model_type) gives ModelConfig's fields
    (HFConfigError naming the field otherwise); hf_notes(config): what the file holds that the
    model leaves out (`tuner plan --hf-config` prints them).

    replicated_units: a layer's memory-bound traffic replicated over tp, in Korthikanti's units
    (16-bit bytes x h per token, tuner/perfmodel.py): the two norms' inputs and outputs (8) and,
    for the GPT block the constants were chosen on, the dropout masks after attention and the
    MLP (2) that those tables trained with.

    torchtitan_dense / torchtitan_moe: the torchtitan 0.3.0 model a dense model / a mixture of
    experts of this family is written as a flavor of (None: the export writes the layout only,
    torchtitan_why says why). megatron_defaults: Megatron-LM's default block is this family's
    (its flags then say nothing of the block)."""

    name: str
    label: str
    block: Mapping[str, str]
    bare_key: bool = False
    presets: Mapping[str, ModelConfig] = field(default_factory=dict)
    hf_architectures: Mapping[str, str] = field(default_factory=dict)
    hf_read: HFReader | None = None
    hf_notes: Callable[[dict[str, Any]], list[str]] | None = None
    hf_moe_types: tuple[str, ...] = ()
    replicated_units: float = 10.0
    torchtitan_dense: str | None = None
    torchtitan_moe: str | None = None
    torchtitan_why: str = ""
    megatron_defaults: bool = False

    def matches(self, model: ModelConfig) -> bool:
        return all(getattr(model, name) == value for name, value in self.block.items())
