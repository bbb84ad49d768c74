"""THE table of a decoder block's parts: each kind of norm, MLP, positions and attention a
ModelConfig names (its `norm`, `mlp`, `positions`, `attention` fields), with the facts the rest
of the house reads about it: how many weights and kept tensors it has, what it moves, how the
exports spell it. Code that prices or writes a model asks the part (`m.mlp_kind.kept`), never
compares its name (`m.mlp == "swiglu"`): a new kind is one row here, and the code that builds it
in the trainer (trainer/model.py).

The families (trainer/contract/families/) are named combinations of these parts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NormPart:
    """A norm over the hidden size.

    params: weights per normalised value (LayerNorm's weight and bias, RMSNorm's weight).
    stats: fp32 statistics per normalised row (LayerNorm's mean and rstd, RMSNorm's rstd); a
        column-split (2D) norm all-reduces as many sums (sum x and sum x^2, or sum x^2).
    centred: keeps an fp32 centred copy of its input when written in torch ops (trainer/tp2d.py).
    cpu_composite: on CPU (and under autocast) runs torch's composite, which keeps an fp32 copy of
        the input and the fp32 normalised input, not the input itself (RMSNorm; LayerNorm has
        a fused kernel on both).
    label: how an export's comment names the block's norm; megatron: its --normalization."""

    name: str
    params: int
    stats: int
    centred: bool
    cpu_composite: bool
    label: str
    megatron: str


@dataclass(frozen=True)
class MLPPart:
    """A dense MLP (and each expert's, which is one of these at the expert's width).

    matrices: weight matrices (GELU's fc and proj; SwiGLU's gate, up and down).
    inputs: linear layers reading the MLP's input (GELU's fc; SwiGLU's gate and up).
    kept: ffn-wide tensors kept for backward (GELU's input and output; SwiGLU's gate output,
        SiLU's output, up's output and their product). In 16-bit bytes per ffn value the MLP's
        memory-bound traffic is 2 x kept (perfmodel's units).
    gated: the output is a product of two projections (its backward's flowing gradients are
        ffn-wide, not h-wide: tuner/cost/layer.py flow_bytes).
    ffn_scale, ffn_round: the default hidden width, ffn_scale x h rounded up to ffn_round
        (GELU's 4h; Llama's 8h/3 up to a multiple of 256).
    label: an export's comment; hf_act: the Hugging Face hidden_act it reads; megatron: its
        Megatron-LM flag (None: Megatron's default MLP, GELU; megatron/training/arguments.py)."""

    name: str
    matrices: int
    inputs: int
    kept: int
    gated: bool
    ffn_scale: tuple[int, int]
    ffn_round: int
    label: str
    hf_act: str | None
    megatron: str | None

    def ffn_size(self, hidden_size: int) -> int:
        num, den = self.ffn_scale
        return -(-(num * hidden_size // den) // self.ffn_round) * self.ffn_round


@dataclass(frozen=True)
class PositionsPart:
    """learned: a table of seq_len position embeddings beside the token embedding (GPT); rotary:
    q and k rotated in attention, a cos/sin buffer per local token and the bytes the rotation
    moves (Llama)."""

    name: str
    learned: bool
    rotary: bool
    label: str


@dataclass(frozen=True)
class AttentionPart:
    """mha: multi-head or grouped-query attention (q, k, v of head_dim per head); latent:
    DeepSeek's multi-head latent attention (q through a low-rank bottleneck, k and v up-projected
    from one latent with a shared rotary key: ModelConfig's MLA widths). inputs: linear layers
    reading the attention's input (q, k and v; latent: q's (or its down-projection) and kv's
    down-projection), each of which saves its own cast of it under autocast."""

    name: str
    latent: bool
    label: str
    inputs: int


NORM_KINDS: dict[str, NormPart] = {
    "layernorm": NormPart("layernorm", params=2, stats=2, centred=True, cpu_composite=False,
                          label="pre-LN", megatron="LayerNorm"),
    "rmsnorm": NormPart("rmsnorm", params=1, stats=1, centred=False, cpu_composite=True,
                        label="pre-RMSNorm", megatron="RMSNorm"),
}  # fmt: skip
MLP_KINDS_TABLE: dict[str, MLPPart] = {
    "gelu": MLPPart("gelu", matrices=2, inputs=1, kept=2, gated=False, ffn_scale=(4, 1), ffn_round=1,
                    label="GELU MLP", hf_act=None, megatron=None),
    "swiglu": MLPPart("swiglu", matrices=3, inputs=2, kept=4, gated=True, ffn_scale=(8, 3), ffn_round=256,
                      label="SwiGLU MLP", hf_act="silu", megatron="--swiglu"),
}  # fmt: skip
POSITIONS_KINDS: dict[str, PositionsPart] = {
    "learned": PositionsPart("learned", learned=True, rotary=False, label="learned positions"),
    "rope": PositionsPart("rope", learned=False, rotary=True, label="RoPE"),
}
ATTENTION_KINDS: dict[str, AttentionPart] = {
    "mha": AttentionPart("mha", latent=False, label="multi-head attention", inputs=3),
    "mla": AttentionPart("mla", latent=True, label="multi-head latent attention", inputs=2),
}


# The loss over whole (not vocab-sharded) logits: trainer/model.py ChunkedCrossEntropy converts
# this many fp32 values of the logits at a time (a chunk of rows), forward and backward.
CE_CHUNK_VALUES = 1 << 24  # 64 MiB


def ce_chunk_rows(vocab: int) -> int:
    """Rows of the logits ChunkedCrossEntropy converts to fp32 at a time."""
    return max(1, CE_CHUNK_VALUES // vocab)
