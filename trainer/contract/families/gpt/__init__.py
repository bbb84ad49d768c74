"""GPT-2/3's block: learned positions, pre-LN blocks with LayerNorm, a GELU MLP of 4h, multi-head
attention (ModelConfig's defaults).

Presets: shapes from the papers they name. "gpt-tiny" and "gpt-small" are CPU test shapes;
"gpt-1.3b" is GPT-3 XL's shape (1.3B with tied embeddings, 1.42B with our untied head);
22B / 175B / 1T are the Frontier study's shapes (Dash et al. 2023, table 1)."""

from __future__ import annotations

from trainer.contract.families.family import Family
from trainer.contract.model import ModelConfig

PRESETS = {
    "gpt-tiny": ModelConfig(num_layers=4, hidden_size=64, num_heads=4, vocab_size=256, seq_len=32),
    "gpt-small": ModelConfig(num_layers=4, hidden_size=128, num_heads=4, vocab_size=1024, seq_len=128),
    "gpt-125m": ModelConfig(num_layers=12, hidden_size=768, num_heads=12, seq_len=1024),
    "gpt-350m": ModelConfig(num_layers=24, hidden_size=1024, num_heads=16, seq_len=1024),
    "gpt-1.3b": ModelConfig(num_layers=24, hidden_size=2048, num_heads=16, seq_len=2048),
    "gpt-2.7b": ModelConfig(num_layers=32, hidden_size=2560, num_heads=32, seq_len=2048),
    "gpt-22b": ModelConfig(num_layers=48, hidden_size=6144, num_heads=48, seq_len=2048),
    "gpt-175b": ModelConfig(num_layers=96, hidden_size=12288, num_heads=96, seq_len=2048),
    "gpt-1t": ModelConfig(num_layers=128, hidden_size=25600, num_heads=160, seq_len=2048),
}

FAMILY = Family(
    name="gpt",
    label="GPT",
    block={"norm": "layernorm", "mlp": "gelu", "positions": "learned", "attention": "mha"},
    bare_key=True,
    presets=PRESETS,
    replicated_units=10.0,  # with the dropout masks: the tables the constants were chosen on
    torchtitan_why="torchtitan has no GPT with learned positions; llama3 is the nearest family",
    megatron_defaults=True,
)
