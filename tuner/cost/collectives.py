"""What communication costs: the link a group of ranks talks over (its tier: inside a node or
across nodes), and the price of a collective on it from its parts (docs/perfmodel.md,
"Collectives"). Each price is a `Comm`, seconds split by tier, so an estimate can say how much of
a step crosses the node boundary. A collective's parts:

- the backend's cost per call, by group size: NCCL on GPUs a software cost per round of a
  log-depth synchronisation (`collective_overhead_s` x log2 g) plus the link latency per ring hop;
  gloo on CPU ranks as bench/gloo_groups.py measured it (`cpu_call_s`, by ranks per core and group
  size), which holds the on-node hops;
- the bytes over the group's tier: a ring moves 2(g-1)/g of the buffer over the slowest link
  (Thakur et al. 2005); inside a node the node's link, across nodes the node's network shared by
  the groups that cross it. On CPU ranks gloo copies and sums every byte on the ranks' own cores,
  so no link is faster than what a core moves (`comm_efficiency` x the node's link) and a slower
  wire runs at its own rate;
- what the trainer's framework adds per call on CPU ranks, where its Python runs on the cores the
  compute needs, measured the same way: DTensor's 1D tensor parallelism per Megatron collective,
  FSDP2's data parallelism per collective (x `framework_call_scale`). On GPUs that work runs ahead
  of the kernels and is in `layer_floor_s`;
- the wait behind the compute before a blocking collective (`wait_s`): where ranks share cores,
  the members of a group reach it at different times and the early ones wait for the slowest.
  Priced per compute segment, not per call: back-to-back collectives have nothing to wait behind.

Sources: Thakur et al. 2005 (ring collectives); Narayanan et al. 2021 ("Megatron-3D") sec. 3.2
and fig. 5 (tensor-parallel all-reduces); Korthikanti et al. 2022 sec. 4.2.2 (sequence
parallelism); AxoNN (Singh et al. 2023) sec. 3 for 2D tensor parallelism as trainer/tp2d.py runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from trainer.contract.topology import members_per_node

if TYPE_CHECKING:
    from tuner.perfconstants import ModelConstants
    from tuner.spec import ClusterSpec

Tier = Literal["intra", "inter"]
CallPath = Literal["gloo", "dtensor", "replicate", "fsdp"]


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
    # CPU ranks only: the node's own link (what a core moves through gloo) and its latency (which
    # the measured call cost already holds); None on GPUs.
    core_gbps: float | None = None
    core_latency_us: float = 0.0

    def rate_gbps(self, c: ModelConstants) -> float:
        """The GB/s a collective's or a send's bytes reach: `comm_efficiency` of the link on GPUs;
        on CPU ranks the link or what a core moves, the slower (a shaped wire runs at its nominal
        rate: 24 of its 25 MB/s measured, loopback at the cores' rate)."""
        if self.core_gbps is None:
            return self.gbps * c.comm_efficiency
        return min(self.gbps, self.core_gbps * c.comm_efficiency)

    def hop_latency_us(self, c: ModelConstants) -> float:
        """The latency per ring hop not in the call cost: all of it on GPUs; on CPU ranks with a
        measured call cost (which holds the on-node hops), what a slower tier adds."""
        if self.core_gbps is None or not c.cpu_call_s:
            return self.latency_us
        return max(self.latency_us - self.core_latency_us, 0.0)


def group_link(cluster: ClusterSpec, size: int, stride: int) -> Link:
    """The link of a group of `size` ranks `stride` apart, placed as the trainer places them
    (trainer/contract/topology.py: mesh order pp, dp, tp; ranks in blocks per node). Within a
    scale-up domain (a node, or an NVL72 rack: ClusterSpec.domain_size): the intra-node link.
    Across domains: the node's network shared by the groups that cross it at the same time, never
    above intra."""
    g = cluster.gpus_per_node
    cpu = {} if cluster.cores_per_node is None else {
        "core_gbps": cluster.intra_node_gbps, "core_latency_us": cluster.intra_node_latency_us}  # fmt: skip
    if size <= members_per_node(size, stride, cluster.domain_size):
        return Link(mesh_gbps(cluster, size), cluster.intra_node_latency_us, "intra", **cpu)
    per_node = members_per_node(size, stride, g)
    share = cluster.inter_node_gbps * per_node / g
    return Link(min(cluster.intra_node_gbps, share), cluster.inter_node_latency_us, "inter", **cpu)


def mesh_gbps(cluster: ClusterSpec, members: int) -> float:
    """What `members` ranks of one scale-up domain reach each: the switch's intra_node_gbps, or on a
    full mesh of pairwise links (ClusterSpec.intra_node_peer_gbps) the k - 1 links to the group's
    other members (MI300X: tp 2 at 64 GB/s, tp 8 at 448), at most intra_node_gbps."""
    if cluster.intra_node_peer_gbps is None:
        return cluster.intra_node_gbps
    return min(cluster.intra_node_gbps, max(members - 1, 1) * cluster.intra_node_peer_gbps)


def ranks_per_core(cluster: ClusterSpec, world_size: int) -> float:
    """CPU ranks sharing a core on a node (0 on GPUs: nothing shared)."""
    if cluster.cores_per_node is None:
        return 0.0
    return min(world_size, cluster.gpus_per_node) / cluster.cores_per_node


def ring_allreduce_s(nbytes: float, n: int, link: Link, c: ModelConstants) -> float:
    """Ring all-reduce: 2(n-1)/n of the buffer over the slowest link, 2(n-1) hops (Thakur 2005)."""
    if n <= 1:
        return 0.0
    wire = 2 * (n - 1) / n * nbytes / (link.rate_gbps(c) * 1e9)
    return wire + 2 * (n - 1) * link.hop_latency_us(c) * 1e-6


def call_overhead_s(n: int, c: ModelConstants, rpc: float = 0.0, path: CallPath = "gloo") -> float:
    """What one collective call over `n` ranks costs beyond its bytes on `path`: the backend's
    ("gloo"), or what the trainer's framework adds to it ("dtensor", "replicate", "fsdp"), at `rpc`
    ranks per core. Measured on CPU ranks (`cpu_call_s`); on GPUs (no table) NCCL's software and
    synchronisation cost per round of a log-depth synchronisation (a cost per peer over-priced tp
    4 against tp 2 on our CPU tables) and no framework cost."""
    if n <= 1:
        return 0.0
    table = tuple((r, g, s) for k, r, g, s in c.cpu_call_s if k == path)
    if table:
        scale = 1.0 if path == "gloo" else c.framework_call_scale
        return scale * _measured_call_s(table, n, rpc)
    return c.collective_overhead_s * math.log2(n) if path == "gloo" else 0.0


def _measured_call_s(table: tuple[tuple[float, int, float], ...], n: int, rpc: float) -> float:
    """A measured call cost at `rpc` ranks per core and group size n: linear in the group size
    between the measured sizes (beyond them along the nearest two; one size measured: per peer),
    then linear in ranks per core between the two measured nearest it (beyond them: the nearest)."""
    rows = sorted({r for r, _, _ in table})
    lo = max([r for r in rows if r <= rpc], default=rows[0])
    hi = min([r for r in rows if r >= rpc], default=rows[-1])
    at_lo, at_hi = _along_group(table, lo, n), _along_group(table, hi, n)
    return at_lo if hi == lo else at_lo + (at_hi - at_lo) * (rpc - lo) / (hi - lo)


def _along_group(table: tuple[tuple[float, int, float], ...], rpc: float, n: int) -> float:
    points = sorted((g, s) for r, g, s in table if r == rpc)
    if len(points) == 1:
        ((g, s),) = points
        return s * (n - 1) / (g - 1)
    # the segment that holds n, or the nearest end segment; never below nothing
    i = next((i for i in range(len(points) - 1) if n <= points[i + 1][0]), len(points) - 2)
    (g0, s0), (g1, s1) = points[i], points[i + 1]
    return max(s0 + (s1 - s0) * (n - g0) / (g1 - g0), 0.0)


def allreduce(nbytes: float, n: int, link: Link, c: ModelConstants, rpc: float = 0.0) -> Comm:
    """One all-reduce of `nbytes` over `n` ranks on `link`: the ring plus the backend's call."""
    if n <= 1:
        return Comm()
    return Comm.on(link.tier, ring_allreduce_s(nbytes, n, link, c) + call_overhead_s(n, c, rpc))


def send_s(nbytes: float, link: Link, c: ModelConstants) -> Comm:
    """One point-to-point send: the link's latency and bytes (no collective's software cost)."""
    return Comm.on(link.tier, nbytes / (link.rate_gbps(c) * 1e9) + link.latency_us * 1e-6)


def wait_s(compute_s: float, c: ModelConstants, rpc: float) -> float:
    """The wait behind `compute_s` of compute that ends in a blocking collective: where ranks
    share cores (more than one per core), `collective_wait_fraction` of it; none otherwise."""
    return c.collective_wait_fraction * compute_s if rpc > 1.0 else 0.0
