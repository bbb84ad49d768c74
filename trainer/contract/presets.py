"""Named model shapes (presets): every family's, in the registry's order. Each family's module
(trainer/contract/families/<family>/) holds its presets and cites their sources; a preset is
just a named ModelConfig."""

from __future__ import annotations

from trainer.contract.families import FAMILIES
from trainer.contract.model import ModelConfig

MODEL_PRESETS: dict[str, ModelConfig] = {
    name: model for family in FAMILIES.values() for name, model in family.presets.items()
}
