"""A plain GPT: no process groups inside, parallelism is applied from outside (parallelize.py).

Layers live in a ModuleDict keyed by layer id and the embedding, final norm and head may be None,
so a pipeline stage is this same class with parts removed (torchtitan's layout).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import GPTConfig

INIT_STD = 0.02  # GPT-2


class Embeddings(nn.Module):
    """Token + learned position embeddings."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class CoreAttention(nn.Module):
    """softmax(QK^T/sqrt(d))V, causal. A module of its own so that selective activation
    checkpointing can recompute exactly this part (Korthikanti et al. 2022) and no collective."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = cfg.head_dim
        # Separate q/k/v so that column-parallel sharding splits whole heads.
        self.wq = nn.Linear(h, h, bias=False)
        self.wk = nn.Linear(h, h, bias=False)
        self.wv = nn.Linear(h, h, bias=False)
        self.core = CoreAttention(cfg.dropout)
        self.wo = nn.Linear(h, h, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Under tensor parallelism q is this rank's heads only: derive the head count from it.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = self.core(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return self.drop(self.wo(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=False)
        self.proj = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN transformer block (GPT-2)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if (
            cfg.family != "gpt"
            or cfg.num_kv_heads not in (None, cfg.num_heads)
            or cfg.tie_embeddings
            or cfg.qkv_bias
        ):
            raise NotImplementedError(
                f"the trainer builds the GPT block only, not this {cfg.family} model (issue 26)"
            )
        self.cfg = cfg
        self.embed: Embeddings | None = Embeddings(cfg)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.hidden_size)
        self.head: nn.Linear | None = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V); a pipeline stage maps whatever it holds."""
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Parameters are visited in a fixed order, so one seeded generator gives every layout
        the same full weights before they are sharded."""
        for name, p in self.named_parameters():
            init_param_(name, p, self.cfg, generator)


@torch.no_grad()
def init_param_(name: str, p: torch.Tensor, cfg: GPTConfig, generator: torch.Generator | None = None) -> None:
    """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2L), norms at (1, 0).
    `p` may be a whole parameter or one rank's shard of it."""
    if "norm" in name:
        p.fill_(1.0 if name.endswith("weight") else 0.0)
    else:
        std = (
            INIT_STD / math.sqrt(2 * cfg.num_layers)
            if name.endswith(("wo.weight", "proj.weight"))
            else INIT_STD
        )
        p.normal_(0.0, std, generator=generator)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss in fp32. Works on vocab-sharded DTensor logits inside loss_parallel()."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
