"""The step: each axis's part, summed. A rank's step on dedicated devices is its compute
(compute.py), the tensor-parallel collectives and waits (tensor.py), a mixture of experts'
all-to-alls (experts.py), context parallelism's K/V traffic (context.py), the pipeline's bubble
and sends (pipeline.py) and data parallelism's gradients and optimizer step (data.py); where ranks
share CPU cores, the node's busy time bounds it from below (`shared_cores_bound`). Each part fills
its own `StepTerms`; they add up to the step time.

Sources are cited in each part: Narayanan et al. 2021 ("Megatron-3D"), Korthikanti et al. 2022,
Rajbhandari et al. 2020 ("ZeRO"), Chowdhery et al. 2022 ("PaLM") appendix B, Thakur et al. 2005
(ring collectives). What is not modelled is listed in docs/perfmodel.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuner.cost.case import Case
from tuner.cost.compute import Compute, ComputePart, compute, compute_part, forward_share
from tuner.cost.context import ContextPart, context_part
from tuner.cost.data import DataPart, LayerTime, data_part
from tuner.cost.experts import ExpertsPart, experts_part, moe_info
from tuner.cost.memory import memory
from tuner.cost.pipeline import PipelinePart, pipeline_part
from tuner.cost.tensor import TensorPart, tensor_part
from tuner.cost.terms import Estimate, StepTerms
from tuner.spec import ClusterSpec


@dataclass(frozen=True)
class RankStep:
    """A rank's step on dedicated devices, by axis."""

    compute: ComputePart
    tensor: TensorPart
    experts: ExpertsPart
    context: ContextPart
    pipeline: PipelinePart
    data: DataPart

    @property
    def stage_mb(self) -> float:
        """One micro-batch on the slowest stage, everything that blocks it."""
        return (
            self.compute.compute_mb
            + self.compute.floor_mb
            + self.compute.offload_mb
            + self.tensor.comm_mb.total
            + self.tensor.wait_mb
            + self.compute.overhead_mb
            + self.experts.a2a_mb.total
            + self.context.kv_mb.total
        )

    def step_s(self, microbatches: int) -> float:
        """The step on dedicated devices: the slowest stage's micro-batches, the bubble, the
        exposed sends and data-parallel traffic, the optimizer."""
        return (
            microbatches * self.stage_mb
            + self.pipeline.bubble_s
            + self.pipeline.p2p.total
            + self.data.exposed.total
            + self.data.optimizer_s
        )

    def busy_s(self, microbatches: int) -> float:
        """What keeps the rank's core busy in a step (every collective's CPU part, hidden or not)."""
        return (
            microbatches * (self.stage_mb + self.tensor.hidden_mb.total)
            + self.pipeline.p2p.total
            + self.data.comm.total
            + self.data.optimizer_s
        )

    def hidden(self, microbatches: int) -> dict[str, float]:
        """Communication overlapped with compute, by the term it would add to (Estimate.hidden)."""
        dp, tp = self.data.hidden, self.tensor.hidden_mb * microbatches
        out = {"dp_comm_intra_s": dp.intra, "dp_comm_inter_s": dp.inter,
               "tp_comm_intra_s": tp.intra, "tp_comm_inter_s": tp.inter}  # fmt: skip
        return {k: v for k, v in out.items() if v > 0}

    def terms(self, microbatches: int, shared_cores_s: float) -> StepTerms:
        """Each part's terms; `shared_cores_s`: what sharing cores adds beyond them."""
        return StepTerms(
            **self.compute.terms(microbatches),
            **self.tensor.terms(microbatches),
            **self.pipeline.terms(),
            **self.data.terms(),
            shared_cores_s=shared_cores_s,
            **self.experts.terms(microbatches),
            **self.context.terms(microbatches),
        )


def rank_step(
    case: Case, compute_mb: float, layers: float, dw_mb: float = 0.0, vocab_share: float = 1.0
) -> RankStep:
    """The step's parts on the case's links (compute_mb fixed: the links change only the others);
    dw_mb: the weight-gradient GEMMs' share of compute_mb (what 2D tensor parallelism overlaps);
    `layers` and `vocab_share` (of the V x h parameters) are the rank's: the slowest stage's
    (layers and all of it), or a pipeline's average rank's (L / pp layers, 1 / pp of it)."""
    own = compute_part(case, compute_mb, layers)
    tensor = tensor_part(case, layers, own.compute_mb, own.floor_mb, dw_mb)
    experts = experts_part(case, layers)
    context = context_part(case, layers)  # blocks each layer's attention
    # what blocks a micro-batch on the stage: the pipeline's bubble is made of it
    critical_mb = (
        own.compute_mb
        + own.floor_mb
        + own.offload_mb
        + tensor.comm_mb.total
        + tensor.wait_mb
        + experts.a2a_mb.total
        + context.kv_mb.total
    )
    pipeline = pipeline_part(case, critical_mb, dw_mb)
    # what data parallelism's collectives hide behind: a layer's share of it (data.overlap_rule)
    fwd = forward_share(case)
    per_layer = critical_mb / layers if layers else 0.0
    data = data_part(case, layers, vocab_share, LayerTime(fwd * per_layer, (1 - fwd) * per_layer))
    return RankStep(own, tensor, experts, context, pipeline, data)


def vocab_matrices(case: Case) -> float:
    """The V x h matrices a pipeline's stages hold in all: the embedding and the head, one when
    tied on a single stage (a tied head on the last of several stages is a copy: two)."""
    return 1.0 if case.model.tie_embeddings and case.layout.pp == 1 else 2.0


def on_node_links(cluster: ClusterSpec) -> ClusterSpec:
    """The cluster with every link as fast as the node's own: what the communication costs the
    CPUs that drive it, without the time spent waiting on a slower wire."""
    return cluster.model_copy(update={"inter_node_gbps": cluster.intra_node_gbps,
                                      "inter_node_latency_us": cluster.intra_node_latency_us})  # fmt: skip


def shared_cores_bound(case: Case, cost: Compute, slowest: RankStep, layers: int) -> float:
    """Ranks sharing cores: a rank idle in the bubble lends its core to the others, and gloo's
    collectives are CPU work too, so the node's total busy time over its cores bounds the step.
    That total is the average rank's work x ranks: with a pipeline the slowest stage (the most
    layers, the LM head) is not what every rank does.
    Only the CPU part of a collective counts: over a link slower than the node's own, the rank
    waits on the wire and its core is free (priced as if every link were on-node). The overlapped
    part of 2D tensor parallelism's traffic keeps a core busy too. What the slower wire adds on
    top is a wait no core can fill: collectives are synchronous (every rank reaches DP's
    all-reduce, a pipeline's send or a TP exchange in the same phase of the step), so the whole
    world waits on the wire at once."""
    m, p, cluster = case.model, case.layout, case.cluster
    assert cluster is not None and cluster.cores_per_node
    mb = p.num_microbatches
    on_node = cluster if cluster.inter_node_gbps >= cluster.intra_node_gbps else on_node_links(cluster)
    cpu_case = case if on_node is cluster else case.on_links_of(on_node)
    compute_mb, dw_mb = cost.stage(layers)
    cpu = slowest if on_node is cluster else rank_step(cpu_case, compute_mb, layers, dw_mb, 1.0)
    wire = slowest.step_s(mb) - cpu.step_s(mb)
    avg = cpu  # one stage: every rank is the slowest
    if p.pp > 1:
        layers_avg = m.num_layers / p.pp
        compute_avg, dw_avg = cost.stage(layers_avg, 1 / p.pp)
        avg = rank_step(cpu_case, compute_avg, layers_avg, dw_avg, vocab_matrices(case) / p.pp)
    ranks = min(p.world_size, cluster.gpus_per_node)
    return avg.busy_s(mb) * ranks / cluster.cores_per_node + max(wire, 0.0)


def estimate_case(case: Case) -> Estimate:
    """Memory and step time of the case (built by Case.priced: the layout's padded vocabulary,
    the dtype trials run in, the study's constants and imbalance)."""
    m, p, c, cluster = case.model, case.layout, case.constants, case.cluster
    assert cluster is not None
    mem = memory(case)
    mb = p.num_microbatches
    layers = case.slowest_layers
    cost = compute(case)
    compute_mb, dw_mb = cost.stage(layers)
    k = rank_step(case, compute_mb, layers, dw_mb, vocab_matrices(case) if p.pp == 1 else 1.0)
    dedicated = k.step_s(mb)
    shared = 0.0
    if cluster.cores_per_node:
        bound = shared_cores_bound(case, cost, k, layers)
        shared = max(0.0, bound - dedicated)
    terms = k.terms(mb, shared)
    step = terms.total_s
    tokens_per_s = p.global_batch_size * m.seq_len / step
    tflops = m.flops_per_token * tokens_per_s / p.world_size / 1e12
    return Estimate(
        **mem,
        vocab_size=m.vocab_size,
        step_time_s=step,
        terms=terms,
        tokens_per_s=tokens_per_s,
        tflops_per_device=tflops,
        mfu=tflops / case.peak_tflops,
        fits=mem["memory_bytes"] <= cluster.device_memory_bytes * (1 - c.memory_margin),
        moe=moe_info(case, cost, layers, terms) if m.moe else None,  # the experts' line of a plan
        hidden=k.hidden(mb),
    )
