"""The study's model for torchtitan 0.3.0: a flavor of the torchtitan model its family registers
(trainer/contract/families/: Family.torchtitan_dense, Family.torchtitan_moe; torchtitan_flavor):
- a dense model of a family whose torchtitan model is llama3 (Llama 3.x, Qwen2: RoPE, RMSNorm,
  SwiGLU, GQA): a flavor of torchtitan's own llama3 model (`Llama3Model`), registered by the
  exported module and written as torchtitan writes its 8B flavor. Tied heads are torchtitan's
  `enable_weight_tying` (its Llama 3.2 flavors use it); Qwen2's q/k/v bias is the bias of
  torchtitan's fused `wqkv` Linear, which its sharding (colwise: the bias sharded with the rows)
  and checkpoint hooks already handle.
- a mixture of experts: a flavor of its family's qwen3 or deepseek_v3 (moe.py).
- a family that registers no torchtitan model (gpt, custom), and a block its model is not (q/k
  norms or wide heads for llama3): the export carries the layout only and names the model in a
  comment, with the family's reason (Family.torchtitan_why).
tests/tuner/test_export.py builds torchtitan's model on the meta device and compares its
parameters with ModelConfig.num_params (docs/exports.md).
"""

from __future__ import annotations

from trainer.contract.families import family_of
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.exports.torchtitan.moe import (
    torchtitan_moe_flavor,
    torchtitan_moe_imports,
    torchtitan_moe_model,
    torchtitan_moe_unsupported,
)

TORCHTITAN_MODEL_FN = "study_model"
# The dense torchtitan model this module writes (torchtitan_model); Family.torchtitan_dense names it.
TORCHTITAN_DENSE = "llama3"


def torchtitan_flavor(m: ModelConfig) -> str | None:
    """The torchtitan model the export writes the study's model as a flavor of: a mixture of experts
    its family's MoE model (moe.py), a dense model its family's dense one (Family.torchtitan_dense)
    where that is llama3 and llama3 is this block: heads of hidden / heads, no q/k norms (Qwen3's
    are not); None: the layout only (Family.torchtitan_why)."""
    if m.moe:  # the experts: moe.py
        return torchtitan_moe_flavor(m)
    dense = family_of(m).torchtitan_dense
    return dense if dense == TORCHTITAN_DENSE and m.qk_norm == "none" and not m.attention_head_dim else None


def torchtitan_builds(m: ModelConfig) -> bool:
    """Whether the export writes the model as a flavor of a torchtitan model: its llama3, or for a
    mixture of experts its qwen3 or deepseek_v3 (moe.py); else the layout only."""
    return torchtitan_flavor(m) is not None


def torchtitan_imports(m: ModelConfig) -> list[str]:
    return TORCHTITAN_IMPORTS if torchtitan_flavor(m) == TORCHTITAN_DENSE else torchtitan_moe_imports(m)


def torchtitan_unsupported(m: ModelConfig, config: ParallelConfig) -> list[str]:
    """Why torchtitan cannot train this model in this layout (a model it builds; a mixture of
    experts it has no flavor for: moe.py)."""
    if m.moe:  # the experts' refusals (moe.py), whether or not the family has a torchtitan MoE model
        reasons = torchtitan_moe_unsupported(m, config)
        if m.tie_embeddings and config.pp > 1:
            reasons.append(f"a head tied to the token embedding with pp {config.pp}: torchtitan refuses "
                           "weight tying with pipeline parallelism")  # fmt: skip
        return reasons
    if not torchtitan_builds(m):
        return []
    reasons = []
    if m.dropout:
        reasons.append(f"dropout {m.dropout:g}: torchtitan's Llama 3 has no dropout")
    if m.tie_embeddings and config.pp > 1:
        # Decoder.Config.update_from_config (models/common/decoder.py) raises NotImplementedError.
        reasons.append(f"a head tied to the token embedding with pp {config.pp}: torchtitan refuses "
                       "weight tying with pipeline parallelism")  # fmt: skip
    return reasons


TORCHTITAN_IMPORTS = [
    "from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm",
    "from torchtitan.models.llama3 import Llama3Model, llama3_configs, model_registry",
]


def _embedding_init(m: ModelConfig) -> str:
    """torchtitan's init of the token embedding: skipped when tied (the head's init sets it)."""
    return "_EMBEDDING_SKIP_INIT" if m.tie_embeddings else "_EMBEDDING_INIT"


def _torchtitan_helpers(m: ModelConfig) -> list[str]:
    return [
        "# torchtitan's own helpers for its llama3 flavors (models/llama3/__init__.py): layers and inits",
        "from torchtitan.models.llama3 import (",
        f"    {_embedding_init(m)},",
        "    _NORM_INIT,",
        "    _build_llama3_layers,",
        "    _output_linear_init,",
        ")",
    ]


def torchtitan_model(m: ModelConfig, flavor: str) -> list[str]:
    """The lines after the imports (TORCHTITAN_IMPORTS): the base config (BASE), a function that returns the model's `Llama3Model.Config`, written as torchtitan 0.3.0 writes
    its 8B flavor (models/llama3/__init__.py: _8b), and the line that registers it as `flavor` of
    torchtitan's llama3 model. The FFN width is the final one: torchtitan's FeedForward takes it as
    is (its flavors compute theirs with compute_ffn_hidden_dim; 8B: 4096, multiple_of 1024,
    ffn_dim_multiplier 1.3 -> 14336). RoPE's max_seq_len is the study's sequence length. A mixture
    of experts: its family's MoE model (moe.py)."""
    if torchtitan_flavor(m) != TORCHTITAN_DENSE:
        return torchtitan_moe_model(m, flavor, TORCHTITAN_MODEL_FN, _embedding_init(m))
    if m.rope_scaling_factor is None:
        scaling = ['scaling="none",']
    else:
        scaling = ['scaling="llama",  # Llama 3.1 (Hugging Face rope_type "llama3")',
                   f"scaling_factor={m.rope_scaling_factor!r},",
                   f"low_freq_factor={m.rope_low_freq_factor!r},",
                   f"high_freq_factor={m.rope_high_freq_factor!r},",
                   f"original_max_position_embeddings={m.rope_original_max_positions},"]  # fmt: skip
    per_layer = [f"layer.attention_norm.eps = layer.ffn_norm.eps = {m.norm_eps!r}"]
    if m.qkv_bias:
        per_layer.append("layer.attention.qkv_linear.wqkv.bias = True  # Qwen2: a bias on q, k and v")
    return [
        "",
        *_torchtitan_helpers(m),
        "",
        "# Data, tokenizer and optimizer: llama3_debugmodel's, whose tokenizer and data are in torchtitan's",
        "# source tree only (see the top) and whose tokenizer is its debug model's (2048 tokens), not this",
        f"# model's ({m.vocab_size}): for a real run, your config function with the model's tokenizer.",
        "BASE = llama3_debugmodel",
        f'FLAVOR = "{flavor}"',
        "",
        "",
        f'def {TORCHTITAN_MODEL_FN}(attn_backend: str = "flex", tp_gemm_backend: str = "default") -> Llama3Model.Config:',
        '    """The study\'s model as a flavor of torchtitan\'s llama3 model."""',
        f"    dim, n_heads, vocab_size = {m.hidden_size}, {m.num_heads}, {m.vocab_size}",
        "    model = Llama3Model.Config(",
        "        dim=dim,",
        "        vocab_size=vocab_size,",
        f"        enable_weight_tying={m.tie_embeddings},",
        f"        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim, param_init={_embedding_init(m)}),",
        f"        norm=RMSNorm.Config(normalized_shape=dim, eps={m.norm_eps!r}, param_init=_NORM_INIT),",
        "        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_output_linear_init(dim)),",
        "        layers=_build_llama3_layers(",
        "            fuse_qkv=True,",
        f"            n_layers={m.num_layers},",
        "            dim=dim,",
        "            n_heads=n_heads,",
        f"            n_kv_heads={m.kv_heads},",
        f"            hidden_dim={m.ffn_size},  # the SwiGLU width, as is",
        "            rope=ComplexRoPE.Config(",
        "                dim=dim // n_heads,",
        f"                max_seq_len={m.seq_len},",
        f"                theta={m.rope_theta!r},",
        *[f"                {line}" for line in scaling],
        "            ),",
        "            attn_backend=attn_backend,",
        "            tp_gemm_backend=tp_gemm_backend,",
        "        ),",
        "    )",
        "    for layer in model.layers:  # torchtitan's layer helper leaves these at their defaults",
        *[f"        {line}" for line in per_layer],
        "    return model",
        "",
        "",
        f"llama3_configs[FLAVOR] = {TORCHTITAN_MODEL_FN}  # a flavor of torchtitan's llama3: model_registry(FLAVOR)",
    ]


def torchtitan_notes(m: ModelConfig, trained_vocab: int) -> list[str]:
    """What torchtitan's model does differently from the one measured (`trained_vocab`: the
    vocabulary our trainer built for the layout's tp)."""
    flavor = torchtitan_flavor(m)
    if flavor is None:
        return []
    notes = (
        [  # qwen3 rotates halves; deepseek_v3: moe.py's notes
            "RoPE: torchtitan rotates adjacent pairs of each head (Meta's Llama), our trainer the two halves "
            "(Hugging Face's): the same model up to a fixed order of q and k rows."
        ]
        if flavor == TORCHTITAN_DENSE
        else []
    )
    if trained_vocab != m.vocab_size:
        notes.append(f"vocabulary: torchtitan builds the tokenizer's {m.vocab_size}; our trainer padded it "
                     f"to {trained_vocab} for tensor parallelism (Megatron-LM's rule).")  # fmt: skip
    return notes
