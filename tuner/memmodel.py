"""The analytic memory model: bytes per device of a layout's fullest rank (weights, gradients,
optimizer state, activations), from Korthikanti et al. 2022 (activations, table 2 and sec. 4),
ZeRO (model states) and Megatron-3D (in-flight micro-batches). `tuner.perfmodel.estimate` uses it;
`fits` compares it with the device's memory. The memory oracle (tuner memcheck) checks it against
the trainer's own build on fake tensors."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from trainer.config import GPTConfig, ParallelConfig

if TYPE_CHECKING:
    from tuner.perfmodel import ModelConstants


def _activation_bytes_per_layer(m: GPTConfig, p: ParallelConfig, act_bytes: int, c: ModelConstants) -> float:
    """Stored activations of one layer for one micro-batch (Korthikanti, table 2; its 16-bit
    byte counts scaled by act_bytes / 2)."""
    s, b, h, a, t = m.seq_len, p.micro_batch_size, m.hidden_size, m.num_heads, p.tp
    scores = 0.0 if c.flash_attention else 5 * a * s / h  # softmax, its dropout mask, scores
    if p.activation_checkpoint == "full":
        per = 2 * s * b * h / (t if p.sequence_parallel else 1)  # only the layer input (sec. 4.1)
    elif p.sequence_parallel:
        attn = 0.0 if p.activation_checkpoint == "selective" else scores
        per = s * b * h / t * (34 + attn)  # eq. in sec. 4.2.2
    else:
        attn = 0.0 if p.activation_checkpoint == "selective" else scores / t
        per = s * b * h * (10 + 24 / t + attn)  # eq. in sec. 4.2.1
    return per * act_bytes / 2


def _layer_params(m: GPTConfig, tp: int) -> float:
    return (4 * m.hidden_size**2 + 2 * m.hidden_size * m.ffn_size) / tp + 4 * m.hidden_size


def model_state_bytes(
    num_params: float, precision: str, zero_stage: int, dp: int
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per device. ZeRO sec. 3.1: mixed precision
    keeps 2 + 2 + 12 bytes per parameter (fp16 weights, fp16 gradients, fp32 master + Adam m, v);
    fp32 keeps 4 + 4 + 8. ZeRO sec. 5: stage 1 divides the optimizer state by dp, stage 2 also
    the gradients, stage 3 also the weights."""
    w, g, o = (2, 2, 12) if precision != "fp32" else (4, 4, 8)
    return (
        num_params * w / (dp if zero_stage >= 3 else 1),
        num_params * g / (dp if zero_stage >= 2 else 1),
        num_params * o / (dp if zero_stage >= 1 else 1),
    )


def memory(m: GPTConfig, p: ParallelConfig, precision: str, c: ModelConstants) -> dict[str, float]:
    """Bytes on the fullest device: the first pipeline rank (embedding, most in-flight
    micro-batches) or the last (head, logits), whichever holds more."""
    act_bytes = 2 if precision != "fp32" else 4
    d, t, pp, v, mb = p.dp, p.tp, p.pp, p.virtual_stages, p.num_microbatches
    s, b, h, vocab = m.seq_len, p.micro_batch_size, m.hidden_size, m.vocab_size
    layers = math.ceil(m.num_layers / (pp * v)) * v  # layers on the fullest rank
    per_layer = _activation_bytes_per_layer(m, p, act_bytes, c)
    working = 0.0  # recomputing one layer brings back its full activations for a moment
    if p.activation_checkpoint == "full":
        working = _activation_bytes_per_layer(
            m, dataclasses.replace(p, activation_checkpoint="none"), act_bytes, c
        )
    # In-flight micro-batches (Megatron-3D sec. 2.2): GPipe keeps all of them; 1F1B at most pp on
    # the first stage and one on the last; gradient accumulation one at a time. Interleaving
    # multiplies the first stage's by 1 + (p-1)/(p*v) (Korthikanti sec. 4.2.3).
    gpipe = p.pp_schedule == "gpipe"
    interleave = 1 + (pp - 1) / (pp * v) if v > 1 else 1.0
    first_inflight = 1 if pp == 1 else mb if gpipe else min(pp, mb) * interleave
    last_inflight = 1 if pp == 1 or not gpipe else mb
    logits = 4 * s * b * vocab / t  # Korthikanti sec. 4.3: output layer + cross-entropy in fp32
    embed, head = vocab * h / t + s * h, vocab * h / t + 2 * h
    layer_params = layers * _layer_params(m, t)
    if pp == 1:
        ranks = [(layer_params + embed + head, per_layer * layers + working + logits)]
    else:
        ranks = [
            (layer_params + embed, per_layer * layers * first_inflight + working),
            (layer_params + head, per_layer * layers * last_inflight + working + logits),
        ]
    best: dict[str, float] = {}
    for params, activations in ranks:
        weights, grads, optimizer = model_state_bytes(params, precision, p.zero_stage, d)
        if p.zero_stage == 3:  # gathered working set: the layer computing and the one prefetched
            weights += 2 * _layer_params(m, t) * (2 if precision != "fp32" else 4)
        total = (weights + grads + optimizer + activations) * c.memory_scale + c.workspace_bytes
        if total > best.get("memory_bytes", -1.0):
            best = {"memory_bytes": total, "weights_bytes": weights, "grads_bytes": grads,
                    "optimizer_bytes": optimizer, "activations_bytes": activations,
                    "workspace_bytes": c.workspace_bytes}  # fmt: skip
    return best
