"""An analytic model of one training step: memory per device and step time, for any layout.

Sources, cited where used: Narayanan et al. 2021 "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (SC'21, "Megatron-3D"); Korthikanti et al. 2022 "Reducing
Activation Recomputation in Large Transformer Models" ("Korthikanti"); Rajbhandari et al. 2020
"ZeRO" (SC'20); Chowdhery et al. 2022 "PaLM" appendix B; Thakur et al. 2005 (ring collectives).
What is not modelled is listed in docs/perfmodel.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainer.config import GPTConfig, ParallelConfig
from trainer.topology import members_per_node
from tuner.memmodel import _layer_params, memory, model_state_bytes  # noqa: F401 (re-exported)
from tuner.perfconstants import (  # noqa: F401 (re-exported: the model's public names)
    CPU_CONSTANTS,
    FITTED,
    ModelConstants,
    default_constants,
    device_kind,
)
from tuner.spec import ClusterSpec, padded_model

# The AdamW step moves 28 bytes per parameter (read w, g, m, v; write w, m, v, fp32). In the units
# elementwise_flops_per_byte prices (a layer's stored activation bytes, each read and written
# several times by the ops around it) that weighs ~8: chosen among 0/8/16/28 on the vTrain h1024
# tables (uncalibrated error 7.4 / 6.6 / 6.9 / 8.2 %).
OPTIMIZER_BYTES_PER_PARAM = 8.0
DDP_BUCKET_BYTES = 25e6  # torch DDP's bucket_cap_mb default: ZeRO-1's gradients go in 25 MB all-reduces


@dataclass(frozen=True)
class Estimate:
    memory_bytes: float
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    workspace_bytes: float
    step_time_s: float
    compute_s: float  # incl. recompute, all micro-batches, on the slowest stage
    tp_comm_s: float
    pp_bubble_s: float
    pp_p2p_s: float
    dp_comm_s: float  # exposed part
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    fits: bool
    vocab_size: int = 0  # the padded vocabulary priced (tuner.spec.padded_vocab for the layout's tp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _ring_allreduce_s(nbytes: float, n: int, gbps: float, latency_us: float, c: ModelConstants) -> float:
    """Ring all-reduce: 2(n-1)/n of the buffer over the slowest link, 2(n-1) hops (Thakur 2005)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (gbps * 1e9 * c.comm_efficiency) + 2 * (n - 1) * latency_us * 1e-6


def _group_link(cluster: ClusterSpec, size: int, stride: int) -> tuple[float, float]:
    """(GB/s per member, latency us) of a group of `size` ranks `stride` apart, placed as the
    trainer places them (trainer/topology.py: mesh order pp, dp, tp; ranks in blocks per node).
    Within a node: the intra-node link. Across nodes: the node's network shared by the groups
    that cross it at the same time, never above intra."""
    g = cluster.gpus_per_node
    per_node = members_per_node(size, stride, g)
    if size <= per_node:
        return cluster.intra_node_gbps, cluster.intra_node_latency_us
    share = cluster.inter_node_gbps * per_node / g
    return min(cluster.intra_node_gbps, share), cluster.inter_node_latency_us


def _layer_fwd_flops_per_token(m: GPTConfig) -> float:
    """2 FLOPs per weight per token plus attention's 4*s*h (PaLM appendix B: 6N + 12Lhs over
    forward and backward, a third of it forward)."""
    return _gemm_fwd_flops_per_token(m) + _attention_fwd_flops_per_token(m)


def _gemm_fwd_flops_per_token(m: GPTConfig) -> float:
    return 2 * (4 * m.hidden_size**2 + 2 * m.hidden_size * m.ffn_size)


def _attention_fwd_flops_per_token(m: GPTConfig) -> float:
    return 4 * m.seq_len * m.hidden_size


def _compute_efficiency(m: GPTConfig, p: ParallelConfig, c: ModelConstants) -> float:
    """Fraction of peak a layer's GEMMs reach: small micro-batches or thin shards run slower.
    size: a micro-batch's GEMM work per rank over h, b*s*h / (tp x tp_col)."""
    size = p.micro_batch_size * m.seq_len * m.hidden_size / (p.tp * p.tp_col)
    return c.compute_efficiency * size / (size + c.compute_half_size)


def _elementwise_flops(m: GPTConfig, p: ParallelConfig, precision: str, c: ModelConstants) -> float:
    """Peak-FLOP equivalent of the memory-bound work of one layer for one micro-batch: layer norms,
    GeLU, dropout, residual adds and, without flash attention, the softmax over the s x s scores.
    Its traffic is of the order of the activations the layer stores (Korthikanti table 2,
    16-bit: sbh (10 + 24/t + 5as/(ht)), with sequence parallelism sbh/t (34 + 5as/h)), moved in
    forward, twice in backward, and again by recompute."""
    s, b, h, a, t = m.seq_len, p.micro_batch_size, m.hidden_size, m.num_heads, p.tp
    scores = 0.0 if c.flash_attention else 5 * a * s / h
    # 2D tensor parallelism: the residual stream (the 10) is split over the column group, the
    # heads and the MLP's ffn (the 24) over the row group only, repeated on every column rank.
    per_token = h / t * (34 + scores) if p.sequence_parallel else h * (10 / p.tp_col + (24 + scores) / t)
    passes = {"none": 3.0, "selective": 3.0 + scores / (34 + scores), "full": 4.0}[p.activation_checkpoint]
    act_bytes = 1 if precision != "fp32" else 2  # table 2 counts 16-bit values as 2 bytes
    return s * b * per_token * act_bytes * passes * c.elementwise_flops_per_byte


def _collective_s(nbytes: float, n: int, link: tuple[float, float], c: ModelConstants) -> float:
    """One all-reduce of `nbytes` over `n` ranks on `link` (GB/s, latency us), with the software
    cost of a collective, which grows with the rounds it synchronises (log2 n)."""
    if n <= 1:
        return 0.0
    return _ring_allreduce_s(nbytes, n, *link, c) + c.collective_overhead_s * math.log2(n)


def _tensor_1d_comm(
    m: GPTConfig, p: ParallelConfig, cluster: ClusterSpec, act_bytes: int, c: ModelConstants, layers: int
) -> float:
    """Megatron's tensor parallelism, one micro-batch on a stage: 2 all-reduces forward and 2
    backward per layer (Megatron-3D sec. 3.2, fig. 5); with sequence parallelism each becomes
    reduce-scatter + all-gather, same bytes (Korthikanti sec. 4.2.2); full recompute repeats the
    forward ones. None overlaps compute."""
    t = p.tp
    if t <= 1:
        return 0.0
    n_collectives = 4 + (2 if p.activation_checkpoint == "full" else 0)
    tokens_mb = p.micro_batch_size * m.seq_len
    per = _collective_s(tokens_mb * m.hidden_size * act_bytes, t, _group_link(cluster, t, 1), c)
    return layers * n_collectives * per


def _tensor_2d_comm(
    m: GPTConfig, p: ParallelConfig, cluster: ClusterSpec, act_bytes: int, c: ModelConstants, layers: int,
    dw_mb: float,
) -> tuple[float, float]:  # fmt: skip
    """2D tensor parallelism (trainer/tp2d.py, AxoNN's schedule), one micro-batch on the last
    stage: (exposed seconds, seconds hidden behind compute).

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
    col, row = _group_link(cluster, k, 1), _group_link(cluster, t, k)

    def ar(values_per_token: float, n: int, link: tuple[float, float], dtype_bytes: int = act_bytes) -> float:
        return _collective_s(tokens * values_per_token * dtype_bytes, n, link, c)

    norm = ar(2, k, col, 4)  # a layer norm's one stacked all-reduce of (sum x, sum x^2), each way
    fwd = 3 * ar(h / t, k, col) + ar(f / t, k, col) + 2 * ar(h / k, t, row) + 2 * norm
    bwd_blocking = ar(h / k, t, row) + 2 * norm  # q/k/v's summed dX
    bwd_overlapped = ar(h / k, t, row) + ar(h / t, k, col) + ar(f / t, k, col)
    repeats = 2 if p.activation_checkpoint == "full" else 1
    # the stage's last: the final norm, the head (its logits forward, its dX backward)
    forward = layers * fwd * repeats + norm + ar(m.vocab_size / t, k, col)
    blocking = layers * bwd_blocking + norm
    overlapped = layers * bwd_overlapped + ar(h / k, t, row)
    hidden = min(overlapped, dw_mb)
    return forward + blocking + overlapped - hidden, hidden


@dataclass(frozen=True)
class _StepTerms:
    stage_mb: float  # one micro-batch on the slowest stage: compute (or the floor) + tp + bookkeeping
    tp_mb: float  # exposed
    tp_hidden: float  # tensor-parallel traffic overlapped with compute (2D only)
    bubble: float
    p2p: float
    dp_comm: float
    dp_exposed: float
    optimizer_s: float

    def step_s(self, microbatches: int) -> float:
        """The step on dedicated devices: the slowest stage's micro-batches, the bubble, the
        exposed sends and data-parallel traffic, the optimizer."""
        return microbatches * self.stage_mb + self.bubble + self.p2p + self.dp_exposed + self.optimizer_s


def _step_terms(
    m: GPTConfig, p: ParallelConfig, cluster: ClusterSpec, precision: str, c: ModelConstants,
    compute_mb: float, layers: float, dw_mb: float = 0.0, vocab_share: float = 1.0,
) -> _StepTerms:  # fmt: skip
    """The step's terms on `cluster`'s links (compute_mb fixed: the links change only these);
    dw_mb: the weight-gradient GEMMs' share of compute_mb (what 2D tensor parallelism overlaps);
    `layers` and `vocab_share` (of the V x h parameters) are the rank's: the slowest stage's
    (layers and all of it), or a pipeline's average rank's (L / pp layers, 1 / pp of it)."""
    s, h, t, pp, v, mb, d = (m.seq_len, m.hidden_size, p.tp, p.pp, p.virtual_stages, p.num_microbatches, p.dp)
    tc = t * p.tp_col  # ranks that share each weight (the tensor-parallel block)
    tokens_mb = p.micro_batch_size * s
    act_bytes = 2 if precision != "fp32" else 4
    if p.tp_col > 1:
        tp_mb, tp_hidden = _tensor_2d_comm(m, p, cluster, act_bytes, c, layers, dw_mb)
    else:
        tp_mb, tp_hidden = _tensor_1d_comm(m, p, cluster, act_bytes, c, layers), 0.0

    stage_mb = max(compute_mb, layers * c.layer_floor_s) + tp_mb + c.microbatch_overhead_s
    # Pipeline: the bubble is (p-1) stage-times, divided by v when interleaved (Megatron-3D sec. 2.2).
    # The framework's per-micro-batch bookkeeping runs on each rank's CPU and does not lengthen it.
    bubble = (pp - 1) / v * (stage_mb - c.microbatch_overhead_s)
    p2p = 0.0
    if pp > 1:
        pp_gbps, pp_lat = _group_link(cluster, pp, tc * d)
        # scatter/gather: sec. 4.1; 2D: the residual stream is split over the column group
        msg = tokens_mb * h * act_bytes / (t if p.sequence_parallel else p.tp_col)
        # forward activation + backward gradient per micro-batch per chunk, on the critical path
        per = msg / (pp_gbps * 1e9 * c.comm_efficiency) + pp_lat * 1e-6
        p2p = 2 * (mb * v + pp - 1) * per

    # Data parallelism: gradients all-reduced once per step; ZeRO/FSDP splits it into
    # reduce-scatter + all-gather (same bytes, ZeRO sec. 7); ZeRO-3 gathers parameters for
    # forward and again for backward of every micro-batch (1.5x, ZeRO sec. 7.2.2).
    dp_gbps, dp_lat = _group_link(cluster, d, tc)
    params_rank = layers * _layer_params(m, t, p.tp_col) + vocab_share * m.vocab_size * h / tc
    full_ar = _ring_allreduce_s(params_rank * act_bytes, d, dp_gbps, dp_lat, c)
    if p.zero_stage == 3:
        halves = 2 * mb + (mb if pp == 1 else 1)
    elif p.zero_stage == 2 and pp == 1:  # reduce-scatter every micro-batch, one all-gather
        halves = mb + 1
    else:
        halves = 2
    # Collectives issued: sharded data parallelism (FSDP, ZeRO-2/3) one per layer and pass, so
    # halves x layers; replicated gradients the trainer's way (trainer/parallelize.py
    # apply_replicate: FSDP2's replicate per block and on the root, synced on the last micro-batch
    # only), one per layer plus the root's; ZeRO-1, which the trainer does not offer, one per
    # 25 MB bucket (DeepSpeed's and DDP's). Each pays the software cost as tp's do (on gloo over
    # loopback ~1 ms: most of what ZeRO-3 and small replicated models cost there).
    if p.zero_stage >= 2:
        n_dp_collectives = halves * layers
    elif p.zero_stage == 0:
        n_dp_collectives = math.ceil(layers) + 1
    else:
        n_dp_collectives = math.ceil(params_rank * act_bytes / DDP_BUCKET_BYTES)
    dp_comm = full_ar / 2 * halves + n_dp_collectives * c.collective_overhead_s * math.log2(d)
    dp_exposed = dp_comm * (1 - c.dp_overlap)

    # The optimizer step (AdamW) once per step over the rank's parameters, memory-bound like the
    # work between the GEMMs: it reads weights, gradients, m and v and writes weights, m and v.
    # ZeRO >= 1 shards it over dp; replicated, every data-parallel rank repeats it.
    opt_params = params_rank / (d if p.zero_stage >= 1 else 1)
    optimizer_s = (
        opt_params * OPTIMIZER_BYTES_PER_PARAM * c.elementwise_flops_per_byte / (cluster.peak_tflops * 1e12)
    )

    return _StepTerms(stage_mb, tp_mb, tp_hidden, bubble, p2p, dp_comm, dp_exposed, optimizer_s)


def _on_node_links(cluster: ClusterSpec) -> ClusterSpec:
    """The cluster with every link as fast as the node's own: what the communication costs the
    CPUs that drive it, without the time spent waiting on a slower wire."""
    return cluster.model_copy(update={"inter_node_gbps": cluster.intra_node_gbps,
                                      "inter_node_latency_us": cluster.intra_node_latency_us})  # fmt: skip


def estimate(
    m: GPTConfig,
    p: ParallelConfig,
    cluster: ClusterSpec,
    precision: str = "bf16",
    constants: ModelConstants | None = None,
) -> Estimate:
    c = constants or default_constants(cluster)
    m = padded_model(m, p.tp)  # the vocabulary the layout builds (Megatron's padding)
    mem = memory(m, p, precision, c)
    s, h, t, pp, v, mb = m.seq_len, m.hidden_size, p.tp, p.pp, p.virtual_stages, p.num_microbatches
    tc = t * p.tp_col
    tokens_mb = p.micro_batch_size * s
    layers = math.ceil(m.num_layers / (pp * v)) * v

    # Compute of one micro-batch on the slowest (last) stage: forward, backward = 2x forward
    # (Megatron-3D sec. 5.1), plus recompute: a whole forward (full) or the attention core
    # (selective, Korthikanti sec. 5). The head's V x h matmul sits on the last stage. With 2D
    # tensor parallelism the GEMMs split over tp x tp_col ranks, the attention core over the row
    # group's heads only: every column rank repeats it (trainer/tp2d.py).
    gemm_fwd = _gemm_fwd_flops_per_token(m) * tokens_mb / tc
    attn_fwd = _attention_fwd_flops_per_token(m) * tokens_mb / t
    layer_fwd = gemm_fwd + attn_fwd
    recompute = {"none": 0.0, "selective": attn_fwd, "full": layer_fwd}[p.activation_checkpoint]
    head_fwd = 2 * m.vocab_size * h * tokens_mb / tc
    efficiency, peak = _compute_efficiency(m, p, c), cluster.peak_tflops * 1e12
    elementwise = _elementwise_flops(m, p, precision, c)

    def stage(layers: float, head_share: float = 1.0) -> tuple[float, float]:
        """One micro-batch on a stage of `layers` layers and `head_share` of the head: its compute
        and the weight gradients' GEMMs' part of it."""
        head = head_share * head_fwd
        flops = layers * (3 * layer_fwd + recompute) + 3 * head
        compute = (flops / efficiency + layers * elementwise) / peak
        return compute, (layers * gemm_fwd + head) / efficiency / peak

    compute_mb, dw_mb = stage(layers)

    k = _step_terms(m, p, cluster, precision, c, compute_mb, layers, dw_mb)
    compute_total = mb * compute_mb
    step = k.step_s(mb)
    if cluster.cores_per_node:
        # Ranks sharing cores: a rank idle in the bubble lends its core to the others, and gloo's
        # collectives are CPU work too, so the node's total busy time over its cores bounds the step.
        # That total is the average rank's work x ranks: with a pipeline the slowest stage (the
        # most layers, the LM head) is not what every rank does.
        # Only the CPU part of a collective counts: over a link slower than the node's own, the
        # rank waits on the wire and its core is free (priced as if every link were on-node).
        # The overlapped part of 2D tensor parallelism's traffic keeps a core busy too.
        # What the slower wire adds on top is a wait no core can fill: collectives are synchronous
        # (every rank reaches DP's all-reduce, a pipeline's send or a TP exchange in the same
        # phase of the step), so the whole world waits on the wire at once.
        on_node = cluster if cluster.inter_node_gbps >= cluster.intra_node_gbps else _on_node_links(cluster)
        cpu = k if on_node is cluster else _step_terms(m, p, on_node, precision, c, compute_mb, layers, dw_mb)
        wire = step - cpu.step_s(mb)
        avg = cpu  # one stage: every rank is the slowest
        if pp > 1:
            layers_avg = m.num_layers / pp
            compute_avg, dw_avg = stage(layers_avg, 1 / pp)
            avg = _step_terms(
                m, p, on_node, precision, c, compute_avg, layers_avg, dw_avg, vocab_share=1 / pp
            )
        ranks = min(p.world_size, cluster.gpus_per_node)
        busy = mb * (avg.stage_mb + avg.tp_hidden) + avg.p2p + avg.dp_comm + avg.optimizer_s
        step = max(step, busy * ranks / cluster.cores_per_node + max(wire, 0.0))
    tokens_per_s = p.global_batch_size * s / step
    tflops = m.flops_per_token * tokens_per_s / p.world_size / 1e12
    return Estimate(
        **mem,
        vocab_size=m.vocab_size,
        step_time_s=step,
        compute_s=compute_total,
        tp_comm_s=mb * k.tp_mb,
        pp_bubble_s=k.bubble,
        pp_p2p_s=k.p2p,
        dp_comm_s=k.dp_exposed,
        tokens_per_s=tokens_per_s,
        tflops_per_device=tflops,
        mfu=tflops / cluster.peak_tflops,
        fits=mem["memory_bytes"] <= cluster.device_memory_bytes * (1 - c.memory_margin),
    )


# --- calibration -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """One measured step time of a layout, the input to calibrate()."""

    model: GPTConfig
    parallel: ParallelConfig
    cluster: ClusterSpec
    step_time_s: float
    precision: str = "bf16"


# Each fitted constant in an unbounded coordinate: log for scales, logit for fractions.
_FRACTIONS = {"compute_efficiency", "comm_efficiency", "dp_overlap"}


def _to_free(c: ModelConstants, names: tuple[str, ...]) -> list[float]:
    return [math.log(v / (1 - v)) if k in _FRACTIONS else math.log(v) for k in names for v in [getattr(c, k)]]


def _from_free(x, base: ModelConstants, names: tuple[str, ...]) -> ModelConstants:
    values = {}
    for k, z in zip(names, x, strict=True):
        z = max(min(float(z), 40.0), -40.0)
        values[k] = 1 / (1 + math.exp(-z)) if k in _FRACTIONS else math.exp(z)
    return dataclasses.replace(base, **values)


def calibrate(
    measurements: list[Measurement],
    initial: ModelConstants | None = None,
    prior_weight: float = 0.2,
    fitted: tuple[str, ...] = FITTED,
) -> ModelConstants:
    """Least squares on log step time over the `fitted` constants, with a pull towards `initial`
    (default: the cluster kind's defaults) worth `prior_weight` measurements in all: a handful of
    measurements cannot send the constants they do not observe anywhere, and many outweigh it."""
    from scipy.optimize import least_squares

    if not measurements:
        return initial or ModelConstants()
    base = initial or default_constants(measurements[0].cluster)
    x0 = _to_free(base, fitted)

    def residuals(x):
        c = _from_free(x, base, fitted)
        res = [
            math.log(estimate(r.model, r.parallel, r.cluster, r.precision, c).step_time_s / r.step_time_s)
            for r in measurements
        ]
        pull = math.sqrt(prior_weight / len(measurements))
        return res + [pull * (xi - x0i) for xi, x0i in zip(x, x0, strict=True)]

    fit = least_squares(residuals, x0, method="lm" if len(measurements) >= 4 else "trf")
    return _from_free(fit.x, base, fitted)


def fit_memory_scale(measured: list[tuple[Measurement, float]], constants: ModelConstants) -> ModelConstants:
    """`constants` with memory_scale = the median over (layout, measured peak bytes) of measured over
    predicted tensor bytes (the workspace left out of both); unchanged without measurements."""
    ratios = []
    for m, peak in measured:
        unscaled = dataclasses.replace(constants, memory_scale=1.0)
        tensors = (
            memory(m.model, m.parallel, m.precision, unscaled)["memory_bytes"] - constants.workspace_bytes
        )
        if peak > constants.workspace_bytes and tensors > 0:
            ratios.append((peak - constants.workspace_bytes) / tensors)
    if not ratios:
        return constants
    ratios.sort()
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return dataclasses.replace(constants, memory_scale=min(max(median, 0.5), 4.0))


def rms_log_error(measurements: list[Measurement], constants: ModelConstants) -> float:
    """Root mean square of log(predicted / measured) step time: 0.1 is ~10 % typical error."""
    if not measurements:
        return 0.0
    res = [
        math.log(estimate(r.model, r.parallel, r.cluster, r.precision, constants).step_time_s / r.step_time_s)
        for r in measurements
    ]
    return math.sqrt(sum(x * x for x in res) / len(res))
