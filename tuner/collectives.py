"""What communication costs: the link a group of ranks talks over (its tier: inside a node or
across nodes), and the price of a collective on it. Each price is a `Comm`, seconds split by tier,
so an estimate can say how much of a step crosses the node boundary.

Sources: Thakur et al. 2005 (ring collectives); Narayanan et al. 2021 ("Megatron-3D") sec. 3.2
and fig. 5 (tensor-parallel all-reduces); Korthikanti et al. 2022 sec. 4.2.2 (sequence
parallelism); AxoNN (Singh et al. 2023) sec. 3 for 2D tensor parallelism as trainer/tp2d.py runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from trainer.config import GPTConfig, ParallelConfig
from trainer.topology import members_per_node

if TYPE_CHECKING:
    from tuner.perfconstants import ModelConstants
    from tuner.spec import ClusterSpec

Tier = Literal["intra", "inter"]


@dataclass(frozen=True)
class Comm:
    """Seconds of communication on each tier: inside a node, across nodes."""

    intra: float = 0.0
    inter: float = 0.0

    @property
    def total(self) -> float:
        return self.intra + self.inter

    def __add__(self, other: Comm) -> Comm:
        return Comm(self.intra + other.intra, self.inter + other.inter)

    def __mul__(self, k: float) -> Comm:
        return Comm(self.intra * k, self.inter * k)

    __rmul__ = __mul__

    @classmethod
    def on(cls, tier: Tier, seconds: float) -> Comm:
        return cls(seconds, 0.0) if tier == "intra" else cls(0.0, seconds)


@dataclass(frozen=True)
class Link:
    gbps: float  # per member
    latency_us: float
    tier: Tier


def group_link(cluster: ClusterSpec, size: int, stride: int) -> Link:
    """The link of a group of `size` ranks `stride` apart, placed as the trainer places them
    (trainer/topology.py: mesh order pp, dp, tp; ranks in blocks per node). Within a node: the
    intra-node link. Across nodes: the node's network shared by the groups that cross it at the
    same time, never above intra."""
    g = cluster.gpus_per_node
    per_node = members_per_node(size, stride, g)
    if size <= per_node:
        return Link(cluster.intra_node_gbps, cluster.intra_node_latency_us, "intra")
    share = cluster.inter_node_gbps * per_node / g
    return Link(min(cluster.intra_node_gbps, share), cluster.inter_node_latency_us, "inter")


def ring_allreduce_s(nbytes: float, n: int, link: Link, c: ModelConstants) -> float:
    """Ring all-reduce: 2(n-1)/n of the buffer over the slowest link, 2(n-1) hops (Thakur 2005)."""
    if n <= 1:
        return 0.0
    wire = 2 * (n - 1) / n * nbytes / (link.gbps * 1e9 * c.comm_efficiency)
    return wire + 2 * (n - 1) * link.latency_us * 1e-6


def call_overhead_s(n: int, c: ModelConstants) -> float:
    """The software and synchronisation cost of one collective over `n` ranks, beyond the link's
    latency: per round of a log-depth synchronisation (a cost per peer over-priced tp 4 against
    tp 2 on our CPU tables)."""
    return c.collective_overhead_s * math.log2(n) if n > 1 else 0.0


def allreduce(nbytes: float, n: int, link: Link, c: ModelConstants) -> Comm:
    """One all-reduce of `nbytes` over `n` ranks on `link`: the ring plus the per-call cost."""
    if n <= 1:
        return Comm()
    return Comm.on(link.tier, ring_allreduce_s(nbytes, n, link, c) + call_overhead_s(n, c))


def send_s(nbytes: float, link: Link, c: ModelConstants) -> Comm:
    """One point-to-point send: the link's latency and bytes (no collective's software cost)."""
    return Comm.on(link.tier, nbytes / (link.gbps * 1e9 * c.comm_efficiency) + link.latency_us * 1e-6)


def tensor_1d(
    m: GPTConfig, p: ParallelConfig, cluster: ClusterSpec, act_bytes: int, c: ModelConstants, layers: float
) -> Comm:
    """Megatron's tensor parallelism, one micro-batch on a stage: 2 all-reduces forward and 2
    backward per layer (Megatron-3D sec. 3.2, fig. 5); with sequence parallelism each becomes
    reduce-scatter + all-gather, same bytes (Korthikanti sec. 4.2.2); full recompute repeats the
    forward ones. None overlaps compute."""
    t = p.tp
    if t <= 1:
        return Comm()
    n_collectives = 4 + (2 if p.activation_checkpoint == "full" else 0)
    tokens_mb = p.micro_batch_size * m.seq_len
    per = allreduce(tokens_mb * m.hidden_size * act_bytes, t, group_link(cluster, t, 1), c)
    return per * (layers * n_collectives)


def tensor_2d(
    m: GPTConfig, p: ParallelConfig, cluster: ClusterSpec, act_bytes: int, c: ModelConstants, layers: float,
    dw_mb: float,
) -> tuple[Comm, float]:  # fmt: skip
    """2D tensor parallelism (trainer/tp2d.py, AxoNN's schedule), one micro-batch on the last
    stage: (exposed communication, seconds hidden behind compute).

    Each linear layer all-reduces its output Y over one group in forward and its input gradient dX
    over the other in backward. Normal layers (q, k, v, MLP-up: Y of h/t or ffn/t per token) reduce
    Y over the column group (tp_col ranks, neighbours) and dX (h/tp_col) over the row group (tp
    ranks tp_col apart); transposed layers (attention-out, MLP-down) the other way round; q, k and
    v's dX are summed and reduced once. A layer per token: forward 3h/t + ffn/t over the column
    group and 2h/c over the row group; backward 2h/c over the row group and h/t + ffn/t over the
    column group; each layer norm reduces two fp32 sums per token over the column group, forward
    and backward; full recompute repeats the forward ones. The head reduces its vocab/t logits
    over the column group (forward) and h/c over the row group (backward). Each group is priced on
    the link of the tier it spans (the trainer's placement rule). Overlap: the backward all-reduces
    of attention-out, MLP-up, MLP-down and the head run while the layer computes its weight
    gradient (trainer/tp2d.py), so they hide behind up to the stage's weight-gradient time
    (`dw_mb`); the forward ones, q/k/v's shared one and the norms' block."""
    t, k, h, f = p.tp, p.tp_col, m.hidden_size, m.ffn_size
    tokens = p.micro_batch_size * m.seq_len
    col, row = group_link(cluster, k, 1), group_link(cluster, t, k)

    def ar(values_per_token: float, n: int, link: Link, dtype_bytes: int = act_bytes) -> Comm:
        return allreduce(tokens * values_per_token * dtype_bytes, n, link, c)

    norm = ar(2, k, col, 4)  # a layer norm's one stacked all-reduce of (sum x, sum x^2), each way
    fwd = 3 * ar(h / t, k, col) + ar(f / t, k, col) + 2 * ar(h / k, t, row) + 2 * norm
    bwd_blocking = ar(h / k, t, row) + 2 * norm  # q/k/v's summed dX
    bwd_overlapped = ar(h / k, t, row) + ar(h / t, k, col) + ar(f / t, k, col)
    repeats = 2 if p.activation_checkpoint == "full" else 1
    # the stage's last: the final norm, the head (its logits forward, its dX backward)
    forward = fwd * (layers * repeats) + norm + ar(m.vocab_size / t, k, col)
    blocking = bwd_blocking * layers + norm
    overlapped = bwd_overlapped * layers + ar(h / k, t, row)
    hidden = min(overlapped.total, dw_mb)
    exposed_share = 1 - hidden / overlapped.total if overlapped.total > 0 else 1.0
    return forward + blocking + overlapped * exposed_share, hidden
