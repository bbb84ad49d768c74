"""Context parallelism's part (trainer/context_parallel.py): each sequence split over cp ranks.

A rank holds T = micro_batch_size x seq_len / cp tokens of each micro-batch (two of 2 x cp chunks,
head-tail), so every per-token cost of a layer (GEMMs, memory-bound work, tensor- and pipeline-
parallel traffic, a mixture of experts' routing) is priced at T; the cp ranks hold the same
weights, so data parallelism's gradients and FSDP's shards span dp x cp ranks (tp apart).

What context parallelism adds, per layer and micro-batch:
- Attention over the whole sequence's keys: the trainer gathers K and V (KV heads only) from the
  cp ranks and scores each local chunk c (of L = seq_len / 2cp tokens) against chunks 0..c under a
  causal mask, so a rank scores (2cp + 1) L^2 query-key pairs per sequence, every rank alike (the
  point of head-tail): `scored_pairs`. With an explicit mask no kernel skips the masked upper
  triangle of the diagonal blocks (one process's causal flash attention skips half of s^2).
- The K/V all-gather before attention (two calls, K and V: seq_len x kv_size / tp values a rank
  receives each, (cp - 1) / cp of it over the cp group's link) and, in backward, their gradients
  sent back to their owners (one all-to-all each, the same bytes; gloo has no reduce-scatter);
  full recompute gathers again. Nothing of it overlaps compute in the trainer: it blocks the
  layer like the experts' all-to-all (`kv_traffic`).
- Memory: the gathered K and V of the whole sequence (their KV heads: SDPA's enable_gqa) are
  what attention keeps for backward: (cp - 1) / cp of them beyond the rank's own
  (tuner/cost/memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.cost.collectives import Comm, Link, call_overhead_s

if TYPE_CHECKING:
    from tuner.cost.case import Case


@dataclass(frozen=True)
class ContextPart:
    """Context parallelism's K/V gathers and gradient returns per micro-batch on a stage."""

    kv_mb: Comm

    def terms(self, microbatches: int) -> dict[str, float]:
        return {
            "cp_comm_intra_s": microbatches * self.kv_mb.intra,
            "cp_comm_inter_s": microbatches * self.kv_mb.inter,
        }


def context_part(case: Case, layers: float) -> ContextPart:
    """`layers` layers' K/V traffic: it blocks each layer's attention."""
    return ContextPart(kv_traffic(case) * layers)


def local_tokens(m: ModelConfig, p: ParallelConfig) -> float:
    """Tokens of one micro-batch a rank holds (before sequence parallelism splits them over tp)."""
    return p.micro_batch_size * m.seq_len / p.cp


def keys_per_query(m: ModelConfig, p: ParallelConfig) -> float:
    """Keys each local query is scored against, on average: seq_len without context parallelism
    (the score matrix as PaLM counts it; flash attention's causal half is its own discount),
    scored_pairs / (seq_len / cp) with it."""
    if p.cp == 1:
        return float(m.seq_len)
    return scored_pairs(m, p) / (m.seq_len / p.cp)


def scored_pairs(m: ModelConfig, p: ParallelConfig) -> float:
    """Query-key pairs a rank scores per sequence: chunk c of L tokens against chunks 0..c, for its
    chunks r and 2cp-1-r: (r + 1 + 2cp - r) L^2 = (2cp + 1) L^2."""
    chunk = m.seq_len / (2 * p.cp)
    return (2 * p.cp + 1) * chunk * chunk


def attention_keys(m: ModelConfig, p: ParallelConfig) -> float:
    """Keys a local query's attention FLOPs are counted against, in PaLM's count of a causal
    layer: the whole score matrix, seq_len keys, of which a causal kernel (is_causal) computes
    half. Under context parallelism the trainer's explicit masks make the kernel compute every
    block it is given whole, 2 x keys_per_query in that count: (2cp + 1) / 2cp x seq_len, the
    diagonal blocks' masked halves the extra (cp 2: 1.25 x the keys of cp 1 per local query). The
    flash path halves both (tuner.cost.compute.flash_attention_s); the GEMM path (no attention
    efficiency: CPU clusters) prices both as counted here."""
    if p.cp == 1:
        return float(m.seq_len)
    return 2 * keys_per_query(m, p)


def kv_link(case: Case) -> Link:
    """The cp group: cp ranks tp x tp_col apart (trainer/contract/topology.py)."""
    return case.link(case.layout.cp, case.tp_block)


def kv_bytes(case: Case) -> float:
    """One gathered K (or V) of a micro-batch on a rank: the whole sequence's KV heads over tp."""
    m, p = case.model, case.layout
    return p.micro_batch_size * m.seq_len * m.kv_size / p.tp * case.value_bytes


def kv_calls(p: ParallelConfig) -> int:
    """Collectives per layer and micro-batch: K and V gathered (again under full recompute), their
    gradients returned."""
    return 2 * (1 + (1 if p.activation_checkpoint == "full" else 0)) + 2


def kv_traffic(case: Case) -> Comm:
    """One layer's K/V gathers and gradient returns for one micro-batch, on the cp group's tier:
    each call moves (cp - 1) / cp of kv_bytes over the link, in cp - 1 steps."""
    p, c = case.layout, case.constants
    if p.cp <= 1:
        return Comm()
    link = kv_link(case)
    wire = (p.cp - 1) / p.cp * kv_bytes(case) / (link.rate_gbps(c) * 1e9)
    per_call = wire + (p.cp - 1) * link.hop_latency_us(c) * 1e-6
    per_call += call_overhead_s(p.cp, c, case.ranks_per_core)
    return Comm.on(link.tier, kv_calls(p) * per_call)


def gathered_kv_bytes(m: ModelConfig, p: ParallelConfig, cb: int) -> float:
    """What attention keeps for backward beyond the rank's own K and V, per layer and micro-batch:
    the rest of the sequence's K and V, their KV heads (kv_size wide, over tp; SDPA's enable_gqa).
    Selective recompute keeps them too (the checkpointed core's inputs); full recompute keeps only
    the layer input (its recompute holds them again: tuner/cost/memory.py's `recompute`)."""
    if p.cp <= 1 or p.activation_checkpoint == "full":
        return 0.0
    return 2 * p.micro_batch_size * m.seq_len * (1 - 1 / p.cp) * m.kv_size / p.tp * cb


def mask_bytes(m: ModelConfig, p: ParallelConfig, cb: int) -> float:
    """The explicit causal masks of a rank's attention (trainer/context_parallel.py): chunk c of
    L = s / 2cp queries against (c + 1) L keys, for the rank's two chunks (2cp + 1) L^2 values,
    additive in the compute dtype. Made once per stage module and shared by its layers and
    micro-batches (broadcast over the batch and the heads, so not over tp either), held from the
    first forward on: virtual stages hold one set each."""
    if p.cp <= 1:
        return 0.0
    chunk = m.seq_len / (2 * p.cp)
    return (2 * p.cp + 1) * chunk * chunk * cb * p.virtual_stages
