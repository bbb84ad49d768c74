"""The contract between the tuner and the trainer: what to run and what came out.

Torch-free on purpose: the tuner imports this on login nodes and in the API image, where torch is
not installed. Everything here is a frozen dataclass with a JSON round-trip.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

ActivationCheckpoint = Literal["none", "selective", "full"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Status = Literal["ok", "pruned", "oom", "invalid", "error", "timeout"]

ACTIVATION_CHECKPOINTS = ("none", "selective", "full")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# zero_stage -> FSDP2 mode (docs/parallelism.md): 0 no sharding, 2 fully_shard without resharding
# after forward (params, grads, optimizer state sharded between steps; params whole during
# forward+backward), 3 fully_shard resharding after forward. Stage 1 is not offered: FSDP2 cannot
# shard optimizer state alone, and stage 2 moves the same bytes (reduce-scatter + all-gather =
# all-reduce) while holding less.
ZERO_STAGES = (0, 2, 3)


def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build a flat dataclass from a dict, naming unknown or missing fields in the error."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; valid fields: {sorted(names)}")
    try:
        return cls(**data)
    except TypeError as e:  # missing required field
        raise ValueError(f"{cls.__name__}: {e}") from None


Norm = Literal["layernorm", "rmsnorm"]
MLPKind = Literal["gelu", "swiglu"]
Positions = Literal["learned", "rope"]
NORMS = ("layernorm", "rmsnorm")
MLP_KINDS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")
AttentionKind = Literal["mha", "mla"]
ATTENTIONS = ("mha", "mla")  # mha: multi-head or grouped-query; mla: DeepSeek's latent attention
QKNorm = Literal["none", "head", "proj"]
QK_NORMS = ("none", "head", "proj")  # head: per head over head_dim (Qwen3); proj: over all heads (OLMoE)
RouterScore = Literal["softmax", "sigmoid"]
ROUTER_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class GPTConfig:
    """A decoder-only transformer. The defaults are GPT-2/3's block: learned positions, pre-LN
    blocks with LayerNorm, a GELU MLP of 4h, multi-head attention, an untied head, no biases in the
    linear layers (PaLM; it also keeps row-parallel layers free of a replicated bias). The fields
    after `dropout` tell the other families apart (`family`): Llama's block is RMSNorm, a SwiGLU
    MLP (three matrices), rotary positions and grouped-query attention (num_kv_heads < num_heads);
    Mistral's is Llama's; Qwen2's adds a bias to q, k and v. Small models tie the head to the
    token embedding."""

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 128 (nanoGPT)
    seq_len: int = 2048
    ffn_hidden_size: int | None = None  # None -> 4h (gelu), Llama's 8h/3 rounded up to 256 (swiglu)
    dropout: float = 0.0
    num_kv_heads: int | None = None  # None -> num_heads (multi-head attention); fewer: GQA
    norm: Norm = "layernorm"
    norm_eps: float = 1e-5
    mlp: MLPKind = "gelu"
    positions: Positions = "learned"
    rope_theta: float = 10000.0  # the rotary base (positions "rope" only)
    # Llama 3.1's rope_scaling (rope_type "llama3"): factor, low/high frequency factors and the
    # original context; None: plain RoPE.
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    tie_embeddings: bool = False  # the head is the token embedding's weight
    qkv_bias: bool = False  # a bias on q, k and v (Qwen2)
    # Attention wider than the residual stream: heads x head_dim != hidden_size (Qwen3's 32 heads
    # of 128 on a 2048-wide stream). None: hidden_size / num_heads.
    attention_head_dim: int | None = None
    qk_norm: QKNorm = "none"  # RMSNorm on q and k before RoPE
    # Multi-head latent attention (DeepSeek-V2/V3): q through a rank-q_lora_rank bottleneck (0: none),
    # k and v from one kv_lora_rank latent plus a shared rotary key of qk_rope_head_dim.
    attention: AttentionKind = "mha"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Mixture of experts (docs/models.md): num_experts routed experts of moe_ffn_hidden_size (None:
    # ffn_size) in every layer after the first moe_dense_layers (those keep the dense MLP of
    # ffn_hidden_size), each token sent to moe_top_k of them, plus a shared expert of
    # moe_shared_ffn_hidden_size (0: none; DeepSeek's n_shared_experts x its width) that every token
    # passes. 0 experts: a dense model.
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int | None = None
    moe_shared_ffn_hidden_size: int = 0
    moe_dense_layers: int = 0
    # The router: softmax (Mixtral, Qwen3, OLMoE) or sigmoid (DeepSeek-V3) scores; the top-k weights
    # renormalised to sum 1 (moe_norm_topk) and scaled by moe_route_scale; group-limited routing
    # (experts in moe_groups groups, tokens limited to the best moe_topk_groups of them).
    moe_router_score: RouterScore = "softmax"
    moe_norm_topk: bool = True
    moe_route_scale: float = 1.0
    moe_groups: int = 1
    moe_topk_groups: int = 1
    # Load balancing: the sequence-wise auxiliary loss's coefficient (0: none) and the rate of the
    # auxiliary-loss-free expert bias (DeepSeek-V3's gamma; 0: no bias).
    moe_aux_loss_coef: float = 0.0
    moe_bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        self._check_attention()
        self._check_moe()
        if self.attention_head_dim is None and self.attention == "mha" and self.hidden_size % self.num_heads:
            raise ValueError(
                f"GPTConfig: hidden_size ({self.hidden_size}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ValueError(f"GPTConfig.ffn_hidden_size must be >= 1, got {self.ffn_hidden_size}")
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            raise ValueError(
                f"GPTConfig.num_kv_heads ({self.num_kv_heads}) must be >= 1 and divide num_heads "
                f"({self.num_heads}): each KV head serves a whole group of query heads"
            )
        for name, valid in (("norm", NORMS), ("mlp", MLP_KINDS), ("positions", POSITIONS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"GPTConfig.{name} {getattr(self, name)!r} is not one of {list(valid)}")
        if self.positions == "rope" and self.attention == "mha" and self.head_dim % 2:
            raise ValueError(f"GPTConfig: rotary positions need an even head_dim, got {self.head_dim}")
        for name in ("norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.rope_scaling_factor is not None:
            if self.positions != "rope":
                raise ValueError("GPTConfig.rope_scaling_factor needs positions 'rope'")
            if self.rope_scaling_factor < 1 or self.rope_high_freq_factor <= self.rope_low_freq_factor:
                raise ValueError(
                    f"GPTConfig: rope scaling needs rope_scaling_factor >= 1 (got {self.rope_scaling_factor}) "
                    f"and rope_high_freq_factor ({self.rope_high_freq_factor}) > rope_low_freq_factor "
                    f"({self.rope_low_freq_factor})"
                )

    def _check_attention(self) -> None:
        for name, valid in (("attention", ATTENTIONS), ("qk_norm", QK_NORMS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"GPTConfig.{name} {getattr(self, name)!r} is not one of {list(valid)}")
        if self.attention_head_dim is not None and self.attention_head_dim < 1:
            raise ValueError(f"GPTConfig.attention_head_dim must be >= 1, got {self.attention_head_dim}")
        mla = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.attention == "mla":
            for name in mla[1:]:
                if getattr(self, name) < 1:
                    raise ValueError(
                        f"GPTConfig.{name} must be >= 1 with attention 'mla', got {getattr(self, name)}"
                    )
            if self.q_lora_rank < 0 or self.qk_rope_head_dim % 2:
                raise ValueError(
                    "GPTConfig: attention 'mla' needs q_lora_rank >= 0 and an even qk_rope_head_dim"
                )
            if self.positions != "rope" or self.qkv_bias or self.qk_norm != "none" or self.attention_head_dim:
                raise ValueError(
                    "GPTConfig: attention 'mla' needs positions 'rope', no qkv_bias, no qk_norm, "
                    "no attention_head_dim (its widths are qk_nope/qk_rope/v_head_dim)"
                )
        elif any(getattr(self, name) for name in mla):
            raise ValueError(
                f"GPTConfig: {[n for n in mla if getattr(self, n)]} are for attention 'mla' only"
            )

    def _check_moe(self) -> None:
        if self.num_experts == 0:
            moe = {
                n: getattr(self, n)
                for n in (
                    "moe_top_k",
                    "moe_ffn_hidden_size",
                    "moe_shared_ffn_hidden_size",
                    "moe_dense_layers",
                    "moe_aux_loss_coef",
                    "moe_bias_update_rate",
                )
            }
            set_ = [n for n, v in moe.items() if v]
            if set_:
                raise ValueError(f"GPTConfig: {set_} need num_experts > 0 (a mixture of experts)")
            return
        if self.num_experts < 2 or not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(
                f"GPTConfig: a mixture of experts needs num_experts >= 2 (got {self.num_experts}) "
                f"and 1 <= moe_top_k <= num_experts (got {self.moe_top_k})"
            )
        if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size < 1:
            raise ValueError(f"GPTConfig.moe_ffn_hidden_size must be >= 1, got {self.moe_ffn_hidden_size}")
        if self.moe_shared_ffn_hidden_size < 0:
            raise ValueError(
                f"GPTConfig.moe_shared_ffn_hidden_size must be >= 0, got {self.moe_shared_ffn_hidden_size}"
            )
        if not 0 <= self.moe_dense_layers < self.num_layers:
            raise ValueError(
                f"GPTConfig.moe_dense_layers ({self.moe_dense_layers}) must be in [0, num_layers "
                f"({self.num_layers})): at least one layer has experts"
            )
        if self.moe_router_score not in ROUTER_SCORES:
            raise ValueError(
                f"GPTConfig.moe_router_score {self.moe_router_score!r} is not one of {list(ROUTER_SCORES)}"
            )
        g, tg = self.moe_groups, self.moe_topk_groups
        if g < 1 or self.num_experts % g or not 1 <= tg <= g or self.moe_top_k > tg * (self.num_experts // g):
            raise ValueError(
                f"GPTConfig: group-limited routing needs moe_groups ({g}) to divide num_experts "
                f"({self.num_experts}), 1 <= moe_topk_groups ({tg}) <= moe_groups, and moe_top_k "
                f"({self.moe_top_k}) <= the experts in moe_topk_groups groups"
            )
        for name in ("moe_route_scale",):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("moe_aux_loss_coef", "moe_bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"GPTConfig.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def family(self) -> str:
        """'gpt' (LayerNorm, GELU, learned positions), 'llama' (RMSNorm, SwiGLU, RoPE: Llama,
        Mistral, Qwen2, and the mixtures of experts built on that block: Mixtral, Qwen3-MoE, OLMoE),
        'deepseek' (latent attention) or 'custom' for another mix. `moe` says whether the MLPs
        are experts; `architecture` says both."""
        if self.attention == "mla":
            return "deepseek"
        block = (self.norm, self.mlp, self.positions)
        return {("layernorm", "gelu", "learned"): "gpt", ("rmsnorm", "swiglu", "rope"): "llama"}.get(
            block, "custom"
        )

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.mlp == "swiglu":  # Llama: 2/3 of 4h, rounded up to a multiple of 256
            return -(-(8 * self.hidden_size // 3) // 256) * 256
        return 4 * self.hidden_size

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def architecture(self) -> str:
        """The family, with "-moe" for a mixture of experts: 'llama-moe' (Mixtral), 'deepseek-moe'."""
        return self.family + ("-moe" if self.moe else "")

    @property
    def head_dim(self) -> int:
        """The width of one head of q, k and v (multi-head / grouped-query attention)."""
        return self.attention_head_dim or self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        """The width of q and of the attention's output: num_heads x head_dim (h unless
        attention_head_dim says otherwise; latent attention: its value heads)."""
        if self.attention == "mla":
            return self.num_heads * self.v_head_dim
        return self.num_heads * self.head_dim

    @property
    def expert_ffn_size(self) -> int:
        """One routed expert's hidden width."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.moe_dense_layers if self.moe else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def mlp_matrices(self) -> int:
        """Matrices per MLP (or expert): SwiGLU's three, GELU's two."""
        return 3 if self.mlp == "swiglu" else 2

    @property
    def attention_matmul_params(self) -> int:
        """One layer's attention weights. Multi-head / grouped-query: q h x q_size, k and v
        h x kv_size, out q_size x h. Latent (DeepSeek-V2 section 2.1): q's down and up
        projections (or one h x heads*(nope+rope)), kv's down projection to the latent plus the
        shared rotary key, kv's up projection to every head's nope key and value, out."""
        h = self.hidden_size
        if self.attention == "mla":
            qk = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
            q = self.q_lora_rank * (h + qk) if self.q_lora_rank else h * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv += self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + self.q_size * h
        return 2 * h * self.q_size + 2 * h * self.kv_size

    @property
    def attention_norm_params(self) -> int:
        """Norms inside attention: q/k norms (Qwen3's per head, OLMoE's over all heads), latent
        attention's norms of its q and kv latents."""
        if self.attention == "mla":
            return self.q_lora_rank + self.kv_lora_rank
        return {"none": 0, "head": 2 * self.head_dim, "proj": self.q_size + self.kv_size}[self.qk_norm]

    @property
    def qkv_bias_params(self) -> int:
        return self.q_size + 2 * self.kv_size if self.qkv_bias else 0

    @property
    def expert_params(self) -> int:
        """One routed expert's weights."""
        return self.mlp_matrices * self.hidden_size * self.expert_ffn_size

    @property
    def moe_layer_matmul_params(self) -> int:
        """A mixture-of-experts layer's matmul weights: attention, the router (h x experts), every
        routed expert and the shared expert."""
        h = self.hidden_size
        shared = self.mlp_matrices * h * self.moe_shared_ffn_hidden_size
        return (
            self.attention_matmul_params
            + h * self.num_experts
            + self.num_experts * self.expert_params
            + shared
        )

    @property
    def moe_layer_active_matmul_params(self) -> int:
        """The weights one token multiplies in a mixture-of-experts layer: top-k experts, not all."""
        h = self.hidden_size
        shared = self.mlp_matrices * h * self.moe_shared_ffn_hidden_size
        return (
            self.attention_matmul_params + h * self.num_experts + self.moe_top_k * self.expert_params + shared
        )

    @property
    def moe_layer_params(self) -> int:
        """A mixture-of-experts layer's parameters (the expert bias is a buffer, not counted)."""
        extra = self.qkv_bias_params + self.attention_norm_params + 2 * self.norm_params
        return self.moe_layer_matmul_params + extra

    @property
    def num_layers_params(self) -> int:
        """Every layer's parameters: dense layers and mixture-of-experts layers."""
        return self.num_dense_layers * self.num_layer_params + self.num_moe_layers * self.moe_layer_params

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses (a mixture of experts: top-k experts per layer), embeddings
        and a tied head counted once, as the MoE papers count "activated" parameters."""
        inactive = (self.num_experts - self.moe_top_k) * self.expert_params * self.num_moe_layers
        return self.num_params - inactive

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def kv_size(self) -> int:
        """Width of the k (or v) projection: kv_heads x head_dim (h with multi-head attention)."""
        return self.kv_heads * self.head_dim

    @property
    def num_layer_matmul_params(self) -> int:
        """One dense layer's matmul weights: attention's (q and out h x h, k and v h x kv_size
        with GQA's fewer KV heads), the MLP's two (GELU) or three (SwiGLU) h x ffn."""
        return self.attention_matmul_params + self.mlp_matrices * self.hidden_size * self.ffn_size

    @property
    def num_layer_params(self) -> int:
        """One dense layer's parameters: its matmul weights, q/k/v's bias (Qwen2), q/k norms and
        its two norms."""
        extra = self.qkv_bias_params + self.attention_norm_params
        return self.num_layer_matmul_params + extra + 2 * self.norm_params

    @property
    def norm_params(self) -> int:
        """One norm's parameters: LayerNorm's weight and bias, RMSNorm's weight."""
        return 2 * self.hidden_size if self.norm == "layernorm" else self.hidden_size

    @property
    def num_embedding_params(self) -> int:
        return (self.vocab_size + (self.seq_len if self.positions == "learned" else 0)) * self.hidden_size

    @property
    def num_head_params(self) -> int:
        """The head's own parameters: none when tied to the token embedding."""
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_nonembed_params(self) -> int:
        """Layers, final norm and the head's matmul: the head is a real matmul per token whether
        or not it is tied, so it counts (torchtitan counts an untied head; we count a tied one too,
        so that MFU does not depend on where the weight is stored)."""
        return self.num_layers_params + self.norm_params + self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Parameters stored (a tied head once)."""
        layers = self.num_layers_params + self.norm_params
        return layers + self.num_head_params + self.num_embedding_params

    @property
    def attention_score_width(self) -> int:
        """Per head, the widths QK^T and AV multiply over, summed over heads: 2h for multi-head
        attention (every query head scores even with GQA), heads x (qk_nope + qk_rope + v) for
        latent attention."""
        if self.attention == "mla":
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return 2 * self.q_size

    @property
    def flops_per_token(self) -> int:
        """Model FLOPs per trained token (PaLM, appendix B): 6*N_nonembed + 12*L*h*s (the
        attention scores, h = heads x head_dim: GQA shares K and V but every query head scores).
        A mixture of experts counts the weights a token uses (top-k experts of each layer).

        Recompute from activation checkpointing is not counted: this is model FLOPs, not hardware.
        """
        inactive = (self.num_experts - self.moe_top_k) * self.expert_params * self.num_moe_layers
        scores = 6 * self.num_layers * self.attention_score_width * self.seq_len
        return 6 * (self.num_nonembed_params - inactive) + scores

    def to_dict(self) -> dict[str, Any]:
        """The fields that came after the dense families (attention widths, latent attention,
        experts) appear only when set, so a dense model keeps the keys it had before they existed
        (stored model keys, golden scripts, old results)."""
        data = dataclasses.asdict(self)
        for name in _LATER_FIELDS:
            if data[name] == _DEFAULTS[name]:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        return _from_dict(cls, data)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
_LATER_FIELDS = [name for name in _DEFAULTS if name == "attention_head_dim" or name.startswith(
    ("qk_", "attention", "q_lora", "kv_lora", "v_head", "num_experts", "moe_"))]  # fmt: skip


def _llama(num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, ffn_hidden_size: int,
           *, vocab_size: int = 128256, seq_len: int = 8192, tie_embeddings: bool = False,
           rope_scaling_factor: float | None = 8.0, **fields: Any) -> GPTConfig:  # fmt: skip
    """A Llama-family shape: RMSNorm, SwiGLU, RoPE, GQA (Llama 3's base 500000 and rope scaling
    unless `fields` say otherwise)."""
    return GPTConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        ffn_hidden_size=ffn_hidden_size, vocab_size=vocab_size, seq_len=seq_len, norm="rmsnorm", mlp="swiglu",
        positions="rope", rope_theta=fields.pop("rope_theta", 500000.0), rope_scaling_factor=rope_scaling_factor,
        tie_embeddings=tie_embeddings, **fields,
    )  # fmt: skip


def _moe(num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, ffn_hidden_size: int,
         num_experts: int, moe_top_k: int, moe_ffn_hidden_size: int, **fields: Any) -> GPTConfig:  # fmt: skip
    """A mixture of experts on the Llama block (Mixtral, Qwen3-MoE, OLMoE): no rope scaling,
    base 1e6 unless `fields` say otherwise."""
    fields.setdefault("rope_theta", 1000000.0)
    return _llama(
        num_layers, hidden_size, num_heads, num_kv_heads, ffn_hidden_size, rope_scaling_factor=None,
        num_experts=num_experts, moe_top_k=moe_top_k, moe_ffn_hidden_size=moe_ffn_hidden_size, **fields,
    )  # fmt: skip


# Shapes from the papers they name. "gpt-tiny" is the CPU test model; "gpt-1.3b" is GPT-3 XL's shape
# (1.3B with tied embeddings, 1.42B with our untied head).
# 22B / 175B / 1T are the Frontier study's shapes (Dash et al. 2023, table 1).
# The Llama and Qwen presets are their published Hugging Face config.json files (meta-llama/Llama-3.2-1B,
# Llama-3.2-3B, Llama-3.1-8B, -70B, -405B; Qwen/Qwen2.5-7B: docs/models.md), trained at Llama 3's
# 8192-token context (Qwen2.5's pre-training context 4096); "llama-tiny" and "llama-small" are CPU
# shapes of the family with 2 KV heads for 4 query heads.
# The mixtures of experts are their published config.json files too (mistralai/Mixtral-8x7B-v0.1,
# allenai/OLMoE-1B-7B-0924, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, deepseek-ai/DeepSeek-V3:
# docs/models.md), at their pre-training context of 4096 tokens (Mixtral's is not published; 4096 as
# Megatron's Mixtral benchmarks run it). DeepSeek-V3's multi-token-prediction module and its YaRN
# scaling (for the 128k extension after pre-training) are not part of the preset. "moe-tiny",
# "moe-tiny-ds" (DeepSeek's router: sigmoid scores, groups, a shared expert, a dense first layer)
# and "moe-small" are CPU shapes.
MODEL_PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(num_layers=4, hidden_size=64, num_heads=4, vocab_size=256, seq_len=32),
    "gpt-small": GPTConfig(num_layers=4, hidden_size=128, num_heads=4, vocab_size=1024, seq_len=128),
    "gpt-125m": GPTConfig(num_layers=12, hidden_size=768, num_heads=12, seq_len=1024),
    "gpt-350m": GPTConfig(num_layers=24, hidden_size=1024, num_heads=16, seq_len=1024),
    "gpt-1.3b": GPTConfig(num_layers=24, hidden_size=2048, num_heads=16, seq_len=2048),
    "gpt-2.7b": GPTConfig(num_layers=32, hidden_size=2560, num_heads=32, seq_len=2048),
    "gpt-22b": GPTConfig(num_layers=48, hidden_size=6144, num_heads=48, seq_len=2048),
    "gpt-175b": GPTConfig(num_layers=96, hidden_size=12288, num_heads=96, seq_len=2048),
    "gpt-1t": GPTConfig(num_layers=128, hidden_size=25600, num_heads=160, seq_len=2048),
    "llama-tiny": _llama(4, 64, 4, 2, 192, vocab_size=256, seq_len=32, rope_scaling_factor=None, rope_theta=10000.0),
    "llama-small": _llama(4, 128, 4, 2, 384, vocab_size=1024, seq_len=128, rope_scaling_factor=None,
                          rope_theta=10000.0),
    "llama3.2-1b": _llama(16, 2048, 32, 8, 8192, tie_embeddings=True, rope_scaling_factor=32.0),
    "llama3.2-3b": _llama(28, 3072, 24, 8, 8192, tie_embeddings=True, rope_scaling_factor=32.0),
    "llama3.1-8b": _llama(32, 4096, 32, 8, 14336),
    "llama3.1-70b": _llama(80, 8192, 64, 8, 28672),
    "llama3.1-405b": _llama(126, 16384, 128, 8, 53248),
    "qwen2.5-7b": _llama(28, 3584, 28, 4, 18944, vocab_size=152064, seq_len=4096, rope_scaling_factor=None,
                         rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True),
    "moe-tiny": _moe(4, 64, 4, 2, 192, 8, 2, 64, vocab_size=256, seq_len=32, rope_theta=10000.0),
    "moe-tiny-ds": _moe(4, 64, 4, 2, 192, 8, 2, 64, vocab_size=256, seq_len=32, rope_theta=10000.0,
                        moe_shared_ffn_hidden_size=64, moe_dense_layers=1, moe_router_score="sigmoid",
                        moe_groups=4, moe_topk_groups=2, moe_route_scale=2.5, moe_aux_loss_coef=0.01,
                        moe_bias_update_rate=0.001),
    "moe-small": _moe(4, 128, 4, 2, 384, 8, 2, 128, vocab_size=1024, seq_len=128, rope_theta=10000.0),
    "mixtral-8x7b": _moe(32, 4096, 32, 8, 14336, 8, 2, 14336, vocab_size=32000, seq_len=4096,
                         moe_aux_loss_coef=0.02),
    "olmoe-1b-7b": _moe(16, 2048, 16, 16, 1024, 64, 8, 1024, vocab_size=50304, seq_len=4096,
                        rope_theta=10000.0, qk_norm="proj", moe_norm_topk=False, moe_aux_loss_coef=0.01),
    "qwen3-30b-a3b": _moe(48, 2048, 32, 4, 6144, 128, 8, 768, vocab_size=151936, seq_len=4096, norm_eps=1e-6,
                          attention_head_dim=128, qk_norm="head", moe_aux_loss_coef=0.001),
    "qwen3-235b-a22b": _moe(94, 4096, 64, 4, 12288, 128, 8, 1536, vocab_size=151936, seq_len=4096,
                            norm_eps=1e-6, attention_head_dim=128, qk_norm="head", moe_aux_loss_coef=0.001),
    "deepseek-v3": GPTConfig(
        num_layers=61, hidden_size=7168, num_heads=128, ffn_hidden_size=18432, vocab_size=129280, seq_len=4096,
        norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", positions="rope", rope_theta=10000.0, attention="mla",
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=256, moe_top_k=8, moe_ffn_hidden_size=2048, moe_shared_ffn_hidden_size=2048,
        moe_dense_layers=3, moe_router_score="sigmoid", moe_groups=8, moe_topk_groups=4, moe_route_scale=2.5,
        moe_aux_loss_coef=0.0001, moe_bias_update_rate=0.001,
    ),
}  # fmt: skip


_LATER_AXES = ("tp_col", "ep", "cp")  # ParallelConfig.to_dict writes them only when > 1


@dataclass(frozen=True)
class ParallelConfig:
    """One layout. world_size = tp * tp_col * pp * dp_replicate * dp_shard * cp;
    global_batch = micro_batch_size * num_microbatches * dp_replicate * dp_shard (cp ranks share
    their sequences: context parallelism does not change the batch).

    tp is the (row) tensor-parallel degree of Megatron-LM; tp_col a second, column degree
    (AxoNN's G_c, trainer/tp2d.py): each weight is split over tp x tp_col ranks.

    ep, expert parallelism, is folded into the ranks of data and tensor parallelism rather than
    multiplying the world (torchtitan's sparse mesh, Megatron's "parallel folding"): a mixture of
    experts' routed experts are split over ep neighbouring ranks of each pipeline stage's
    dp x tp block, and each expert's replicas (expert data parallelism, edp = dp x tp / ep) are
    sharded (zero_stage > 0) or replicated like the dense weights (trainer/topology.py: expert_groups;
    docs/parallelism.md).

    cp, context parallelism, splits every sequence over cp ranks (head-tail: 2 x cp chunks, rank r
    holds chunks r and 2cp-1-r; trainer/context_parallel.py). Its mesh axis sits between dp_shard
    and tp (torchtitan's [pp, dp_replicate, dp_shard, cp, tp]); the cp ranks hold the same weights,
    so FSDP2 shards over dp_shard x cp (over cp alone with dp_shard 1 and zero_stage > 0, as
    torchtitan does) and gradients are averaged over dp x cp; ep folds into
    dp x cp x tp (torchtitan: ep divides dp_shard x cp x tp)."""

    tp: int = 1
    tp_col: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    micro_batch_size: int = 1
    num_microbatches: int = 1  # gradient accumulation steps; with pp > 1, micro-batches per flush
    zero_stage: int = 0
    activation_checkpoint: ActivationCheckpoint = "none"
    sequence_parallel: bool = False
    pp_schedule: PipelineSchedule = "1f1b"
    virtual_stages: int = 1  # pipeline stages per pp rank (interleaved 1F1B)
    ep: int = 1  # expert parallelism, folded into dp x cp x tp (a mixture of experts only)
    cp: int = 1  # context parallelism: each sequence split over cp ranks

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.tp * self.tp_col * self.pp * self.dp * self.cp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def edp(self) -> int:
        """Expert data parallelism: the ranks of one pipeline stage holding the same experts."""
        return self.dp * self.cp * self.tp * self.tp_col // self.ep

    def problems(self, model: GPTConfig) -> list[str]:
        """Every reason this layout cannot run `model`; empty when it can."""
        return [message for _, message in self.violations(model)]

    def violations(self, model: GPTConfig) -> list[tuple[str, str]]:
        """(rule, message) for every rule this layout breaks. The rule is a stable short text
        (for counting rejections); the message carries the numbers."""
        out: list[tuple[str, str]] = []
        for name in (
            "tp",
            "tp_col",
            "pp",
            "dp_replicate",
            "dp_shard",
            "micro_batch_size",
            "num_microbatches",
            "virtual_stages",
            "ep",
            "cp",
        ):
            if getattr(self, name) < 1:
                out.append((f"{name} must be >= 1", f"{name} must be >= 1, got {getattr(self, name)}"))
        if out:
            return out
        out += self._tp_violations(model) + self._pp_violations(model) + self._dp_violations()
        out += self._moe_violations(model) + self._cp_violations(model)
        if self.activation_checkpoint not in ACTIVATION_CHECKPOINTS:
            out.append((
                "unknown activation_checkpoint",
                f"activation_checkpoint {self.activation_checkpoint!r} is not one of {list(ACTIVATION_CHECKPOINTS)}",
            ))  # fmt: skip
        return out

    def _tp_violations(self, model: GPTConfig) -> list[tuple[str, str]]:
        out = []
        if model.num_heads % self.tp:
            out.append(
                ("tp must divide num_heads", f"tp ({self.tp}) must divide num_heads ({model.num_heads})")
            )
        if model.kv_heads % self.tp:
            out.append((
                "tp must divide num_kv_heads",
                f"tp ({self.tp}) must divide num_kv_heads ({model.kv_heads}): each rank holds whole KV heads "
                "(Megatron's num_query_groups % tp, torchtitan's n_kv_heads % tp)",
            ))  # fmt: skip
        if model.ffn_size % self.tp:
            out.append((
                "tp must divide ffn_hidden_size", f"tp ({self.tp}) must divide ffn_hidden_size ({model.ffn_size})"
            ))  # fmt: skip
        if model.vocab_size % self.tp:
            out.append((
                "tp must divide vocab_size",
                f"tp ({self.tp}) must divide vocab_size ({model.vocab_size}): the embedding and head are "
                "vocab-parallel; pad the vocabulary",
            ))  # fmt: skip
        if model.hidden_size % self.tp_col:
            out.append((
                "tp_col must divide hidden_size",
                f"tp_col ({self.tp_col}) must divide hidden_size ({model.hidden_size}): the residual "
                "stream is split over the column group",
            ))  # fmt: skip
        if self.sequence_parallel and self.tp_col > 1:
            out.append((
                "sequence_parallel needs tp_col 1",
                "sequence_parallel with tp_col > 1 is not implemented (2D tensor parallelism keeps "
                "every token on every rank)",
            ))  # fmt: skip
        if self.sequence_parallel and self.tp == 1:
            out.append(("sequence_parallel needs tp > 1", "sequence_parallel needs tp > 1"))
        if self.sequence_parallel and self.cp == 1 and model.seq_len % self.tp:
            out.append((
                "sequence_parallel needs tp to divide seq_len",
                f"sequence_parallel: tp ({self.tp}) must divide seq_len ({model.seq_len})",
            ))  # fmt: skip
        return out

    def _pp_violations(self, model: GPTConfig) -> list[tuple[str, str]]:
        out = []
        if self.pp_schedule not in PIPELINE_SCHEDULES:
            msg = f"pp_schedule {self.pp_schedule!r} is not one of {list(PIPELINE_SCHEDULES)}"
            return [("unknown pp_schedule", msg)]
        if model.num_layers < self.num_stages:
            out.append((
                "every pipeline stage needs a layer",
                f"num_layers ({model.num_layers}) < pp ({self.pp}) * virtual_stages ({self.virtual_stages}): "
                "every pipeline stage needs a layer",
            ))  # fmt: skip
        interleaved = self.pp_schedule == "interleaved_1f1b"
        if self.virtual_stages > 1 and not (interleaved and self.pp > 1):
            out.append((
                "virtual_stages > 1 needs interleaved_1f1b with pp > 1",
                "virtual_stages > 1 needs pp > 1 and pp_schedule 'interleaved_1f1b'",
            ))  # fmt: skip
        if self.pp == 1:
            return out
        if interleaved and self.virtual_stages < 2:
            out.append((
                "interleaved_1f1b needs virtual_stages >= 2",
                "pp_schedule 'interleaved_1f1b' needs virtual_stages >= 2",
            ))  # fmt: skip
        if self.pp_schedule == "1f1b" and self.num_microbatches < self.pp:
            out.append((
                "1F1B needs num_microbatches >= pp",
                f"1F1B needs num_microbatches ({self.num_microbatches}) >= pp ({self.pp})",
            ))  # fmt: skip
        if interleaved:
            rounds = max(1, self.num_microbatches // self.pp)
            if self.num_microbatches % rounds:
                out.append((
                    "interleaved 1F1B needs num_microbatches to be a multiple of num_microbatches // pp",
                    f"interleaved 1F1B needs num_microbatches ({self.num_microbatches}) to be a multiple of "
                    f"num_microbatches // pp ({rounds})",
                ))  # fmt: skip
        return out

    def _moe_violations(self, model: GPTConfig) -> list[tuple[str, str]]:
        """Mixture-of-experts rules: experts split whole over ep, ep folded into dp x tp, and each
        tensor-parallel rank routing its own tokens (sequence parallelism: experts are not split
        over tp, torchtitan's choice since it removed expert-TP; Megatron requires SP whenever
        EP > 1 and TP > 1)."""
        out = []
        if not model.moe:
            if self.ep > 1:
                out.append(
                    ("ep > 1 needs a mixture of experts", f"ep ({self.ep}) > 1 needs a model with experts")
                )
            return out
        if model.num_experts % self.ep:
            out.append((
                "ep must divide num_experts",
                f"ep ({self.ep}) must divide num_experts ({model.num_experts}): each rank holds whole experts",
            ))  # fmt: skip
        if self.cp == 1 and (self.dp * self.tp) % self.ep:
            out.append((
                "ep must divide dp x tp",
                f"ep ({self.ep}) must divide dp_replicate x dp_shard x tp ({self.dp * self.tp}): expert "
                "parallelism borrows the ranks of data and tensor parallelism (torchtitan's and Megatron's folding)",
            ))  # fmt: skip
        if self.cp > 1 and (self.dp * self.cp * self.tp) % self.ep:
            out.append((
                "ep must divide dp x cp x tp",
                f"ep ({self.ep}) must divide dp_replicate x dp_shard x cp x tp ({self.dp * self.cp * self.tp}): "
                "expert parallelism borrows the ranks of data, context and tensor parallelism (torchtitan's folding)",
            ))  # fmt: skip
        if self.tp_col > 1:
            out.append((
                "a mixture of experts needs tp_col 1",
                "a mixture of experts with tp_col > 1 is not implemented (2D tensor parallelism keeps every "
                "token on every rank of the column group)",
            ))  # fmt: skip
        if self.tp > 1 and not self.sequence_parallel:
            out.append((
                "a mixture of experts with tp > 1 needs sequence_parallel",
                f"a mixture of experts with tp ({self.tp}) > 1 needs sequence_parallel: each tensor-parallel "
                "rank routes its own tokens (experts are not split over tp; Megatron requires sequence "
                "parallelism when EP > 1 and TP > 1)",
            ))  # fmt: skip
        return out

    def _cp_violations(self, model: GPTConfig) -> list[tuple[str, str]]:
        """Context-parallel rules: 2 x cp equal chunks of every sequence (head-tail load
        balancing), sequence parallelism splitting each rank's seq_len / cp tokens over tp, and no
        2D tensor parallelism (not built with cp)."""
        if self.cp == 1:
            return []
        out = []
        if model.seq_len % (2 * self.cp):
            out.append((
                "cp needs seq_len divisible by 2 x cp",
                f"cp ({self.cp}) needs seq_len ({model.seq_len}) divisible by 2 x cp ({2 * self.cp}): head-tail "
                "load balancing gives each rank two of 2 x cp equal chunks of every sequence",
            ))  # fmt: skip
        elif self.sequence_parallel and (model.seq_len // self.cp) % self.tp:
            out.append((
                "sequence_parallel needs tp to divide seq_len / cp",
                f"sequence_parallel with cp ({self.cp}): tp ({self.tp}) must divide seq_len / cp "
                f"({model.seq_len} / {self.cp} = {model.seq_len // self.cp}), the tokens each cp rank holds",
            ))  # fmt: skip
        if self.tp_col > 1:
            out.append((
                "cp needs tp_col 1",
                f"cp ({self.cp}) > 1 with tp_col ({self.tp_col}) > 1 is not implemented: use cp with 1D tensor "
                "parallelism (tp_col 1)",
            ))  # fmt: skip
        return out

    def _dp_violations(self) -> list[tuple[str, str]]:
        if self.zero_stage not in ZERO_STAGES:
            return [(
                "zero_stage not offered by the trainer",
                f"zero_stage {self.zero_stage} is not one of {list(ZERO_STAGES)} (1 is not offered: FSDP2 "
                "cannot shard optimizer state alone; 2 moves the same bytes)",
            )]  # fmt: skip
        if self.dp_shard > 1 and self.zero_stage == 0:
            return [
                (
                    "dp_shard > 1 needs zero_stage 2 or 3",
                    f"dp_shard ({self.dp_shard}) > 1 needs zero_stage 2 or 3",
                )
            ]
        if self.dp_shard == 1 and self.zero_stage != 0 and self.cp == 1:
            return [(
                "zero_stage > 0 needs dp > 1",
                f"zero_stage {self.zero_stage} needs dp_shard > 1 or cp > 1 (FSDP2 shards over dp_shard x cp; "
                "got dp_shard 1, cp 1)",
            )]  # fmt: skip
        if self.dp_shard == 1 and self.zero_stage != 0 and self.dp_replicate > 1:
            return [(
                "zero_stage over cp alone needs dp_replicate 1",
                f"zero_stage {self.zero_stage} with dp_shard 1 shards over cp ({self.cp}) alone; with dp_replicate "
                f"{self.dp_replicate} that would be HSDP over dp_replicate x cp, not built: set dp_shard "
                f"{self.dp_replicate} and dp_replicate 1, or zero_stage 0",
            )]  # fmt: skip
        return []

    def describe(self) -> str:
        """A short human label, e.g. 'tp2 pp2(1f1b) dp2(z3) mbs2 x4 ac=full sp' ('tp2x2': row 2,
        column 2)."""
        parts = [f"tp{self.tp}" + (f"x{self.tp_col}" if self.tp_col > 1 else "")]
        if self.pp > 1:
            sched = self.pp_schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else "")
            parts.append(f"pp{self.pp}({sched})")
        else:
            parts.append("pp1")
        if self.dp_replicate > 1:
            parts.append(f"dpr{self.dp_replicate}")
        if self.dp_shard > 1:
            parts.append(f"dps{self.dp_shard}(z{self.zero_stage})")
        parts.append(f"mbs{self.micro_batch_size}x{self.num_microbatches}")
        if self.activation_checkpoint != "none":
            parts.append(f"ac={self.activation_checkpoint}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.cp > 1:  # with dp_shard 1 and ZeRO, FSDP2 shards over the cp ranks alone: say so
            parts.append(
                f"cp{self.cp}" + (f"(z{self.zero_stage})" if self.dp_shard == 1 and self.zero_stage else "")
            )
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """tp_col, ep and cp appear only when > 1, so a layout without those axes keeps the keys it
        had before they existed (stored layout keys, golden scripts, old results)."""
        data = dataclasses.asdict(self)
        for name in _LATER_AXES:
            if data[name] == 1:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelConfig:
        return _from_dict(cls, data)


@dataclass(frozen=True)
class BenchmarkConfig:
    """One trial: a model, a layout, and how to measure it."""

    model: GPTConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    warmup_steps: int = 2
    measure_steps: int = 5  # the most measured steps; fewer when stable or pruned (trainer/stopping.py)
    # Adaptive measurement: after min_measure_steps, stop once the ~95 % confidence interval of the
    # mean step time is within stable_rel_ci of it (None: always measure_steps), or as "pruned" when
    # slower than abandon_below_tokens_per_s (None: never).
    min_measure_steps: int = 3
    stable_rel_ci: float | None = None
    abandon_below_tokens_per_s: float | None = None
    seed: int = 0
    lr: float = 3e-4
    grad_clip: float = 1.0  # 0 disables clipping; the norm is computed (and reported) anyway
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 mixed precision on GPU, fp32 on CPU
    # "exact" builds the full model on CPU from the seed then shards it, so every layout starts
    # from the same weights (loss parity); "fast" inits each shard on the device (large models).
    init: Literal["auto", "exact", "fast"] = "auto"
    compile: bool = False
    # A mixture of experts' routing: "learned" (the router's top-k, dropless) or "balanced" (every
    # expert gets the same number of tokens, whatever the scores: Megatron's
    # --moe-router-force-load-balancing, for benchmarks). The result records which one ran.
    moe_routing: Literal["learned", "balanced"] = "learned"
    max_memory_bytes: int | None = None  # peak over this -> status "oom" (emulates a smaller device)
    init_timeout_s: float = 600.0  # process-group timeout until step 1 finished
    step_timeout_s: float = 120.0  # process-group timeout afterwards: a wedged collective fails fast

    def __post_init__(self) -> None:
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {self.warmup_steps}")
        if self.measure_steps < 1:
            raise ValueError(f"measure_steps must be >= 1, got {self.measure_steps}")
        if self.min_measure_steps < 1:
            raise ValueError(f"min_measure_steps must be >= 1, got {self.min_measure_steps}")
        for name in ("stable_rel_ci", "abandon_below_tokens_per_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {getattr(self, name)}")
        choices = {"device": ("auto", "cpu", "cuda"), "dtype": ("auto", "fp32", "bf16"),
                   "init": ("auto", "exact", "fast"), "moe_routing": ("learned", "balanced")}  # fmt: skip
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {list(valid)}")

    @property
    def tokens_per_step(self) -> int:
        return self.parallel.global_batch_size * self.model.seq_len

    def to_dict(self) -> dict[str, Any]:
        """The model's and the layout's keys as their to_dict writes them (new axes only when
        used); moe_routing only for a mixture of experts."""
        data = dataclasses.asdict(self)
        data["model"] = self.model.to_dict()
        parallel = dataclasses.asdict(self.parallel)
        for name in ("ep", "cp"):
            if parallel[name] == 1:
                del parallel[name]
        data["parallel"] = parallel
        if not self.model.moe and self.moe_routing == "learned":
            del data["moe_routing"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchmarkConfig:
        data = dict(data)
        if "model" not in data:
            raise ValueError("BenchmarkConfig: missing field 'model'")
        model = data.pop("model")
        data["model"] = (
            MODEL_PRESETS[model] if isinstance(model, str) and model in MODEL_PRESETS
            else GPTConfig.from_dict(model)
        )  # fmt: skip
        data["parallel"] = ParallelConfig.from_dict(data.get("parallel", {}))
        return _from_dict(cls, data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> BenchmarkConfig:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class BenchmarkResult:
    """What one trial measured. Throughput fields are 0 unless status is 'ok' or 'pruned'.

    status: 'ok'; 'pruned' (stopped while running: slower than abandon_below_tokens_per_s after
    min_measure_steps; the fields hold what it measured until then); 'invalid' (the layout cannot
    run; reasons in error); 'oom' (out of device memory, or over max_memory_bytes); 'timeout' (the
    trial hung or was too slow: the launcher's time limit, Slurm's TIMEOUT, or a collective that
    timed out because some rank stopped making progress); 'error' (a crash: an exception, or a
    rank that died).
    """

    status: Status
    error: str = ""  # reason (invalid), exception tail (error, oom, timeout) or the log tail
    failed_rank: int | None = None
    step_times_s: list[float] = field(default_factory=list)  # measured steps, max over ranks
    stopped_because: str = ""  # why measuring ended (trainer/stopping.py): stable, pruned or all steps
    tokens_per_s: float = 0.0  # global
    tokens_per_s_per_device: float = 0.0
    model_tflops_per_device: float = 0.0
    mfu: float = 0.0  # model_tflops_per_device / peak_tflops_per_device
    peak_tflops_per_device: float = 0.0
    peak_memory_bytes: int = 0  # max over ranks
    peak_memory_bytes_per_rank: list[int] = field(default_factory=list)
    memory_source: str = ""  # how peak memory was measured
    losses: list[float] = field(default_factory=list)  # every step, warm-up included
    grad_norms: list[float] = field(default_factory=list)  # before clipping
    world_size: int = 0
    parallel: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    device: str = ""
    device_name: str = ""
    dtype: str = ""
    torch_version: str = ""
    num_params: int = 0
    flops_per_token: int = 0
    tokens_per_step: int = 0
    wall_time_s: float = 0.0
    # Where the ranks ran: hosts, and the nodes each parallel group spanned against the placement
    # rule (trainer/topology.py: placement).
    placement: dict[str, Any] = field(default_factory=dict)
    # A mixture of experts only: {"routing": "learned" | "balanced", "imbalance": {layer id: [max /
    # mean tokens per expert over the global batch, per step]}, "aux_loss": [the load-balancing
    # loss added (coefficient included, summed over layers), per step]}. Absent for dense models.
    moe: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def measured(self) -> bool:
        """The throughput fields hold a measurement (a full one, or a pruned trial's partial one)."""
        return self.status in ("ok", "pruned")

    def to_dict(self) -> dict[str, Any]:
        """`moe` only for a mixture of experts: a dense model's result keeps its keys."""
        data = dataclasses.asdict(self)
        if not data["moe"]:
            del data["moe"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchmarkResult:
        return _from_dict(cls, data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> BenchmarkResult:
        return cls.from_dict(json.loads(text))


def trainer_problems(cfg: BenchmarkConfig) -> list[str]:
    """What the contract allows but this trainer does not build (a trial of it is "invalid" with
    these reasons), beside the layout's own rules (ParallelConfig.problems)."""
    model, p, out = cfg.model, cfg.parallel, []
    if model.attention == "mla":
        out.append(
            "attention 'mla' (multi-head latent attention) is not built in the trainer: the planner prices it "
            "from its published dimensions, trials of it are refused"
        )
    if model.moe and cfg.compile:
        out.append(
            "compile with a mixture of experts is not supported: dropless routing gives every step other "
            "shapes (tokens per expert); set compile false"
        )
    if model.qk_norm == "proj" and p.tp * p.tp_col > 1:
        out.append(
            f"qk_norm 'proj' (one norm over all heads, OLMoE) with tp ({p.tp}) x tp_col ({p.tp_col}) > 1 is not "
            "built: each rank holds only its heads; use tp 1"
        )
    if p.tp_col > 1 and (model.qk_norm != "none" or model.attention_head_dim is not None):
        out.append("2D tensor parallelism (tp_col > 1) with qk_norm or attention_head_dim is not built")
    if p.cp > 1 and cfg.compile:
        out.append(
            f"compile with cp ({p.cp}) > 1 is not supported: the K/V all-gather is an autograd function "
            "around a process-group collective, which fullgraph compile of a block refuses; set compile false"
        )
    return out
