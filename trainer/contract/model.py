"""ModelConfig: a decoder-only transformer's shape, the fields of every family (dense GPT and
Llama blocks, grouped-query and latent attention, mixtures of experts), with validation that names
the field and the valid values. Torch-free: the tuner and the API import it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from trainer.contract.blocks import (
    ATTENTION_KINDS,
    MLP_KINDS_TABLE,
    NORM_KINDS,
    POSITIONS_KINDS,
    AttentionPart,
    MLPPart,
    NormPart,
    PositionsPart,
)
from trainer.contract.dicts import from_dict

Norm = Literal["layernorm", "rmsnorm"]
MLPKind = Literal["gelu", "swiglu"]
Positions = Literal["learned", "rope"]
NORMS = tuple(NORM_KINDS)  # the parts' tables (trainer/contract/blocks.py); the Literals above agree
MLP_KINDS = tuple(MLP_KINDS_TABLE)
POSITIONS = tuple(POSITIONS_KINDS)
AttentionKind = Literal["mha", "mla"]
ATTENTIONS = tuple(ATTENTION_KINDS)  # mha: multi-head or grouped-query; mla: DeepSeek's latent attention
QKNorm = Literal["none", "head", "proj"]
QK_NORMS = ("none", "head", "proj")  # head: per head over head_dim (Qwen3); proj: over all heads (OLMoE)
RouterScore = Literal["softmax", "sigmoid"]
ROUTER_SCORES = ("softmax", "sigmoid")
AuxLoss = Literal["sequence", "batch"]
AUX_LOSSES = ("sequence", "batch")


@dataclass(frozen=True)
class ModelConfig:
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
    # Load balancing: the auxiliary loss's coefficient (0: none) and form, and the rate of the
    # auxiliary-loss-free expert bias (DeepSeek-V3's gamma; 0: no bias). Forms (trainer/moe.py):
    # "sequence", DeepSeek-V3's sequence-wise loss, summed over the MoE layers (its aux_loss_alpha,
    # Megatron's seq_aux_loss); "batch", the Switch loss over each micro-batch's tokens as
    # transformers computes it for Mixtral, Qwen3-MoE and OLMoE (router_aux_loss_coef), averaged
    # over the MoE layers (Megatron's aux_loss x top-k / layers).
    moe_aux_loss_coef: float = 0.0
    moe_bias_update_rate: float = 0.0
    moe_aux_loss: AuxLoss = "sequence"
    # The router's matmul in fp32 whatever the compute dtype (DeepSeek-V3's router as transformers
    # runs it; Megatron's --moe-router-dtype fp32): its input and weight cast, the copy of the
    # input kept for the backward.
    moe_router_fp32: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        self._check_attention()
        self._check_moe()
        if self.attention_head_dim is None and self.attention == "mha" and self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelConfig: hidden_size ({self.hidden_size}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ValueError(f"ModelConfig.ffn_hidden_size must be >= 1, got {self.ffn_hidden_size}")
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            raise ValueError(
                f"ModelConfig.num_kv_heads ({self.num_kv_heads}) must be >= 1 and divide num_heads "
                f"({self.num_heads}): each KV head serves a whole group of query heads"
            )
        for name, valid in (("norm", NORMS), ("mlp", MLP_KINDS), ("positions", POSITIONS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"ModelConfig.{name} {getattr(self, name)!r} is not one of {list(valid)}")
        if self.positions == "rope" and self.attention == "mha" and self.head_dim % 2:
            raise ValueError(f"ModelConfig: rotary positions need an even head_dim, got {self.head_dim}")
        for name in ("norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.rope_scaling_factor is not None:
            if self.positions != "rope":
                raise ValueError("ModelConfig.rope_scaling_factor needs positions 'rope'")
            if self.rope_scaling_factor < 1 or self.rope_high_freq_factor <= self.rope_low_freq_factor:
                raise ValueError(
                    f"ModelConfig: rope scaling needs rope_scaling_factor >= 1 (got {self.rope_scaling_factor}) "
                    f"and rope_high_freq_factor ({self.rope_high_freq_factor}) > rope_low_freq_factor "
                    f"({self.rope_low_freq_factor})"
                )

    def _check_attention(self) -> None:
        for name, valid in (("attention", ATTENTIONS), ("qk_norm", QK_NORMS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"ModelConfig.{name} {getattr(self, name)!r} is not one of {list(valid)}")
        if self.attention_head_dim is not None and self.attention_head_dim < 1:
            raise ValueError(f"ModelConfig.attention_head_dim must be >= 1, got {self.attention_head_dim}")
        mla = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.attention == "mla":
            for name in mla[1:]:
                if getattr(self, name) < 1:
                    raise ValueError(
                        f"ModelConfig.{name} must be >= 1 with attention 'mla', got {getattr(self, name)}"
                    )
            if self.q_lora_rank < 0 or self.qk_rope_head_dim % 2:
                raise ValueError(
                    "ModelConfig: attention 'mla' needs q_lora_rank >= 0 and an even qk_rope_head_dim"
                )
            if self.positions != "rope" or self.qkv_bias or self.qk_norm != "none" or self.attention_head_dim:
                raise ValueError(
                    "ModelConfig: attention 'mla' needs positions 'rope', no qkv_bias, no qk_norm, "
                    "no attention_head_dim (its widths are qk_nope/qk_rope/v_head_dim)"
                )
        elif any(getattr(self, name) for name in mla):
            raise ValueError(
                f"ModelConfig: {[n for n in mla if getattr(self, n)]} are for attention 'mla' only"
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
                    "moe_router_fp32",
                )
            }
            set_ = [n for n, v in moe.items() if v]
            if self.moe_aux_loss != _DEFAULTS["moe_aux_loss"]:
                set_.append("moe_aux_loss")
            if set_:
                raise ValueError(f"ModelConfig: {set_} need num_experts > 0 (a mixture of experts)")
            return
        if self.num_experts < 2 or not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(
                f"ModelConfig: a mixture of experts needs num_experts >= 2 (got {self.num_experts}) "
                f"and 1 <= moe_top_k <= num_experts (got {self.moe_top_k})"
            )
        if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size < 1:
            raise ValueError(f"ModelConfig.moe_ffn_hidden_size must be >= 1, got {self.moe_ffn_hidden_size}")
        if self.moe_shared_ffn_hidden_size < 0:
            raise ValueError(
                f"ModelConfig.moe_shared_ffn_hidden_size must be >= 0, got {self.moe_shared_ffn_hidden_size}"
            )
        if not 0 <= self.moe_dense_layers < self.num_layers:
            raise ValueError(
                f"ModelConfig.moe_dense_layers ({self.moe_dense_layers}) must be in [0, num_layers "
                f"({self.num_layers})): at least one layer has experts"
            )
        if self.moe_router_score not in ROUTER_SCORES:
            raise ValueError(
                f"ModelConfig.moe_router_score {self.moe_router_score!r} is not one of {list(ROUTER_SCORES)}"
            )
        g, tg = self.moe_groups, self.moe_topk_groups
        if g < 1 or self.num_experts % g or not 1 <= tg <= g or self.moe_top_k > tg * (self.num_experts // g):
            raise ValueError(
                f"ModelConfig: group-limited routing needs moe_groups ({g}) to divide num_experts "
                f"({self.num_experts}), 1 <= moe_topk_groups ({tg}) <= moe_groups, and moe_top_k "
                f"({self.moe_top_k}) <= the experts in moe_topk_groups groups"
            )
        for name in ("moe_route_scale",):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("moe_aux_loss_coef", "moe_bias_update_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.moe_aux_loss not in AUX_LOSSES:
            raise ValueError(
                f"ModelConfig.moe_aux_loss {self.moe_aux_loss!r} is not one of {list(AUX_LOSSES)}"
            )

    @property
    def family(self) -> str:
        """The registered family whose block this model's parts make (trainer/contract/families/:
        'gpt', 'llama', 'deepseek', or 'custom' for another mix). `moe` says whether the MLPs
        are experts; `architecture` says both."""
        from trainer.contract.families import family_of  # the registry's presets import this module

        return family_of(self).name

    @property
    def norm_kind(self) -> NormPart:
        return NORM_KINDS[self.norm]

    @property
    def mlp_kind(self) -> MLPPart:
        return MLP_KINDS_TABLE[self.mlp]

    @property
    def positions_kind(self) -> PositionsPart:
        return POSITIONS_KINDS[self.positions]

    @property
    def attention_kind(self) -> AttentionPart:
        return ATTENTION_KINDS[self.attention]

    @property
    def ffn_size(self) -> int:
        """ffn_hidden_size, or the MLP's default width: GELU's 4h, Llama's 2/3 of 4h rounded up
        to a multiple of 256 (MLPPart.ffn_size)."""
        return self.ffn_hidden_size or self.mlp_kind.ffn_size(self.hidden_size)

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
    def rope_dim(self) -> int:
        """The rotated width of a head's q and k: head_dim, or latent attention's shared rotary
        key (qk_rope_head_dim)."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

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
        return self.mlp_kind.matrices

    @property
    def attention_matmul_params(self) -> int:
        """One layer's attention weights. Multi-head / grouped-query: q h x q_size, k and v
        h x kv_size, out q_size x h. Latent (DeepSeek-V2 section 2.1): q's down and up
        projections (or one h x heads*(nope+rope)), kv's down projection to the latent plus the
        shared rotary key, kv's up projection to every head's nope key and value, out."""
        h = self.hidden_size
        if self.attention == "mla":
            qk = self.latent_qk_size
            q = self.q_lora_rank * (h + qk) if self.q_lora_rank else h * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * self.latent_kv_size
            return q + kv + self.q_size * h
        return 2 * h * self.q_size + 2 * h * self.kv_size

    @property
    def latent_qk_size(self) -> int:
        """Latent attention's q and k width: heads x (qk_nope + qk_rope)."""
        return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)

    @property
    def latent_kv_size(self) -> int:
        """What latent attention's kv up-projection writes: heads x (qk_nope + v_head_dim)."""
        return self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)

    @property
    def attention_replicated_params(self) -> int:
        """Attention's matmul weights every tensor-parallel rank holds whole (and computes with in
        full): latent attention's down-projections, q's (h x q_lora_rank) and kv's (h x (kv_lora_rank
        + qk_rope_head_dim)); none for multi-head attention (trainer/model.py LatentAttention)."""
        if self.attention != "mla":
            return 0
        return self.hidden_size * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim)

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
        return self.norm_kind.params * self.hidden_size

    @property
    def num_embedding_params(self) -> int:
        return (self.vocab_size + (self.seq_len if self.positions_kind.learned else 0)) * self.hidden_size

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
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return from_dict(cls, data)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
_LATER_FIELDS = [name for name in _DEFAULTS if name == "attention_head_dim" or name.startswith(
    ("qk_", "attention", "q_lora", "kv_lora", "v_head", "num_experts", "moe_"))]  # fmt: skip


# The configuration's name before families other than GPT's shared it; kept for one release.
GPTConfig = ModelConfig
