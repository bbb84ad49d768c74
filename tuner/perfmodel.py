"""An analytic model of one training step: memory per device and step time, for any layout.

Sources, cited where used: Narayanan et al. 2021 "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (SC'21, "Megatron-3D"); Korthikanti et al. 2022 "Reducing
Activation Recomputation in Large Transformer Models" ("Korthikanti"); Rajbhandari et al. 2020
"ZeRO" (SC'20); Chowdhery et al. 2022 "PaLM" appendix B; Thakur et al. 2005 (ring collectives).
What is not modelled is listed in docs/perfmodel.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from trainer.config import GPTConfig, ParallelConfig
from trainer.topology import members_per_node
from tuner.memmodel import _layer_params, memory, model_state_bytes  # noqa: F401 (re-exported)
from tuner.spec import ClusterSpec, cluster_preset, padded_model


@dataclass(frozen=True)
class ModelConstants:
    """Efficiencies the formulas cannot know; `calibrate` fits those in FITTED to measurements.
    The class defaults are for GPUs; default_constants() gives CPU ranks their own."""

    # A layer's GEMMs reach compute_efficiency x size / (size + compute_half_size) of peak,
    # size = b*s*h/tp: small micro-batches or thin shards run slower. Between the GEMMs, the
    # memory-bound work (norms, GeLU, dropout, residuals, a softmax over the scores without flash
    # attention) costs elementwise_flops_per_byte peak FLOPs per byte it moves; relative to the
    # GEMMs it shrinks as 1/h, which is why per-GPU throughput rises with model size
    # (Korthikanti table 5: MFU 41.5 % at 22B, 56.3 % at 1T on the same A100s).
    compute_efficiency: float = 0.85
    compute_half_size: float = 2.0**17
    elementwise_flops_per_byte: float = 500.0
    comm_efficiency: float = 0.7  # fraction of link bandwidth a ring collective reaches
    dp_overlap: float = 0.5  # fraction of data-parallel traffic hidden behind backward compute
    # Costs the roofline misses. Kernel launches and the framework's Python run on the CPU ahead
    # of the GPU, so for one micro-batch a layer's forward + backward takes at least
    # layer_floor_s however little it computes (~100 kernels, plus Megatron/DeepSpeed hooks);
    # large layers hide it entirely. Each collective or send also pays a software and
    # synchronisation cost beyond the link latency, per peer it synchronises. Defaults: chosen
    # on the vTrain h1024 tables (bench/model_validation.py --only h1024) together with the
    # size trend of Korthikanti table 5 (elementwise_flops_per_byte), judged on the others
    # (docs/benchmarks.md).
    layer_floor_s: float = 3e-3
    microbatch_overhead_s: float = 1e-2  # per micro-batch per stage: data, loss, engine bookkeeping
    collective_overhead_s: float = 3e-5
    workspace_bytes: float = 2.0e9  # CUDA context, allocator fragmentation, library workspaces
    memory_margin: float = 0.05  # `fits` keeps this fraction of device memory free
    # Measured peaks exceed the tensors' bytes by what the framework keeps besides them (the
    # caching allocator's reserve, communication buckets, fp32 gradient copies): fitted per
    # cluster from the trials' measured peaks by fit_memory_scale().
    memory_scale: float = 1.0
    flash_attention: bool = True  # SDPA/flash: the s x s attention scores are never stored

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# What calibrate() fits: the constants step times pin down. compute_half_size and
# collective_overhead_s move GPU step times little (5 % noise leaves them uncertain by +-30 %), and
# the prior's pull keeps them near their defaults there; on CPU ranks (tiny GEMMs, gloo over
# loopback) they are the dominant costs and the measurements move them far.
FITTED = (
    "compute_efficiency",
    "comm_efficiency",
    "dp_overlap",
    "layer_floor_s",
    "microbatch_overhead_s",
    "compute_half_size",
    "collective_overhead_s",
)


# CPU ranks (gloo over loopback, ranks sharing a few cores): nothing like a GPU. For now the GPU
# defaults; bench/priors.py --fit-cpu-defaults fits them on our own CPU tables.
CPU_CONSTANTS = ModelConstants()


def device_kind(cluster: ClusterSpec | str) -> str:
    """'cpu' or 'gpu'. By name: a cluster preset's kind, else 'cpu' for names starting 'cpu-' (our
    own CPU clusters: cpu-local, cpu-4node-*), else 'gpu'."""
    if isinstance(cluster, ClusterSpec):
        return cluster.device_kind
    try:
        return ClusterSpec(**cluster_preset(cluster)).device_kind
    except ValueError:
        return "cpu" if cluster.startswith("cpu-") else "gpu"


def default_constants(cluster: ClusterSpec | str) -> ModelConstants:
    """The constants a study starts from on a cluster nothing was measured on yet."""
    return CPU_CONSTANTS if device_kind(cluster) == "cpu" else ModelConstants()


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
    return 2 * (4 * m.hidden_size**2 + 2 * m.hidden_size * m.ffn_size) + 4 * m.seq_len * m.hidden_size


def _compute_efficiency(m: GPTConfig, p: ParallelConfig, c: ModelConstants) -> float:
    """Fraction of peak a layer's GEMMs reach: small micro-batches or thin shards run slower."""
    size = p.micro_batch_size * m.seq_len * m.hidden_size / p.tp
    return c.compute_efficiency * size / (size + c.compute_half_size)


def _elementwise_flops(m: GPTConfig, p: ParallelConfig, precision: str, c: ModelConstants) -> float:
    """Peak-FLOP equivalent of the memory-bound work of one layer for one micro-batch: layer norms,
    GeLU, dropout, residual adds and, without flash attention, the softmax over the s x s scores.
    Its traffic is of the order of the activations the layer stores (Korthikanti table 2,
    16-bit: sbh (10 + 24/t + 5as/(ht)), with sequence parallelism sbh/t (34 + 5as/h)), moved in
    forward, twice in backward, and again by recompute."""
    s, b, h, a, t = m.seq_len, p.micro_batch_size, m.hidden_size, m.num_heads, p.tp
    scores = 0.0 if c.flash_attention else 5 * a * s / h
    per_token = h / t * (34 + scores) if p.sequence_parallel else h * (10 + (24 + scores) / t)
    passes = {"none": 3.0, "selective": 3.0 + scores / (34 + scores), "full": 4.0}[p.activation_checkpoint]
    act_bytes = 1 if precision != "fp32" else 2  # table 2 counts 16-bit values as 2 bytes
    return s * b * per_token * act_bytes * passes * c.elementwise_flops_per_byte


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
    s, b, h, t, pp, v, mb, d = (m.seq_len, p.micro_batch_size, m.hidden_size, p.tp, p.pp, p.virtual_stages,
                                p.num_microbatches, p.dp)  # fmt: skip
    tokens_mb = b * s
    layers = math.ceil(m.num_layers / (pp * v)) * v

    # Compute of one micro-batch on the slowest (last) stage: forward, backward = 2x forward
    # (Megatron-3D sec. 5.1), plus recompute: a whole forward (full) or the attention core
    # (selective, Korthikanti sec. 5). The head's V x h matmul sits on the last stage.
    layer_fwd = _layer_fwd_flops_per_token(m) * tokens_mb / t
    recompute = {"none": 0.0, "selective": 4 * s * h * tokens_mb / t, "full": layer_fwd}[
        p.activation_checkpoint
    ]
    head_fwd = 2 * m.vocab_size * h * tokens_mb / t
    flops_mb = layers * (3 * layer_fwd + recompute) + 3 * head_fwd
    compute_mb = (
        flops_mb / _compute_efficiency(m, p, c) + layers * _elementwise_flops(m, p, precision, c)
    ) / (cluster.peak_tflops * 1e12)

    act_bytes = 2 if precision != "fp32" else 4
    # Tensor parallelism: 2 all-reduces forward and 2 backward per layer (Megatron-3D sec. 3.2,
    # fig. 5); with sequence parallelism each becomes reduce-scatter + all-gather, same bytes
    # (Korthikanti sec. 4.2.2); full recompute repeats the forward ones.
    tp_gbps, tp_lat = _group_link(cluster, t, 1)
    n_collectives = 4 + (2 if p.activation_checkpoint == "full" else 0)
    tp_mb = 0.0
    if t > 1:
        # the software cost of a collective grows with the peers it synchronises
        per = _ring_allreduce_s(
            tokens_mb * h * act_bytes, t, tp_gbps, tp_lat, c
        ) + c.collective_overhead_s * (t - 1)
        tp_mb = layers * n_collectives * per

    stage_mb = max(compute_mb, layers * c.layer_floor_s) + tp_mb + c.microbatch_overhead_s
    # Pipeline: the bubble is (p-1) stage-times, divided by v when interleaved (Megatron-3D sec. 2.2).
    # The framework's per-micro-batch bookkeeping runs on each rank's CPU and does not lengthen it.
    bubble = (pp - 1) / v * (stage_mb - c.microbatch_overhead_s)
    p2p = 0.0
    if pp > 1:
        pp_gbps, pp_lat = _group_link(cluster, pp, t * d)
        msg = tokens_mb * h * act_bytes / (t if p.sequence_parallel else 1)  # scatter/gather: sec. 4.1
        # forward activation + backward gradient per micro-batch per chunk, on the critical path
        per = msg / (pp_gbps * 1e9 * c.comm_efficiency) + pp_lat * 1e-6 + c.collective_overhead_s
        p2p = 2 * (mb * v + pp - 1) * per

    # Data parallelism: gradients all-reduced once per step; ZeRO/FSDP splits it into
    # reduce-scatter + all-gather (same bytes, ZeRO sec. 7); ZeRO-3 gathers parameters for
    # forward and again for backward of every micro-batch (1.5x, ZeRO sec. 7.2.2).
    dp_gbps, dp_lat = _group_link(cluster, d, t)
    params_rank = layers * _layer_params(m, t) + m.vocab_size * h / t
    full_ar = _ring_allreduce_s(params_rank * act_bytes, d, dp_gbps, dp_lat, c)
    if p.zero_stage == 3:
        dp_comm = full_ar / 2 * (2 * mb + (mb if pp == 1 else 1))
    elif p.zero_stage == 2 and pp == 1:  # reduce-scatter every micro-batch, one all-gather
        dp_comm = full_ar / 2 * (mb + 1)
    else:
        dp_comm = full_ar
    dp_exposed = dp_comm * (1 - c.dp_overlap)

    compute_total = mb * compute_mb
    step = mb * stage_mb + bubble + p2p + dp_exposed
    if cluster.cores_per_node:
        # Ranks sharing cores: a rank idle in the bubble lends its core to the others, and gloo's
        # collectives are CPU work too, so the node's total busy time over its cores bounds the step.
        ranks = min(p.world_size, cluster.gpus_per_node)
        busy = mb * stage_mb + p2p + dp_comm
        step = max(step, busy * ranks / cluster.cores_per_node)
    tokens_per_s = p.global_batch_size * s / step
    tflops = m.flops_per_token * tokens_per_s / p.world_size / 1e12
    return Estimate(
        **mem,
        vocab_size=m.vocab_size,
        step_time_s=step,
        compute_s=compute_total,
        tp_comm_s=mb * tp_mb,
        pp_bubble_s=bubble,
        pp_p2p_s=p2p,
        dp_comm_s=dp_exposed,
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


def _to_free(c: ModelConstants) -> list[float]:
    return [
        math.log(v / (1 - v)) if k in _FRACTIONS else math.log(v) for k in FITTED for v in [getattr(c, k)]
    ]


def _from_free(x, base: ModelConstants) -> ModelConstants:
    values = {}
    for k, z in zip(FITTED, x, strict=True):
        z = max(min(float(z), 40.0), -40.0)
        values[k] = 1 / (1 + math.exp(-z)) if k in _FRACTIONS else math.exp(z)
    return dataclasses.replace(base, **values)


def calibrate(
    measurements: list[Measurement], initial: ModelConstants | None = None, prior_weight: float = 0.2
) -> ModelConstants:
    """Least squares on log step time over the fitted constants (FITTED), with a pull towards
    `initial` worth `prior_weight` measurements in all: a handful of measurements cannot send the
    constants they do not observe anywhere, and many measurements outweigh it."""
    from scipy.optimize import least_squares

    if not measurements:
        return initial or ModelConstants()
    base = initial or default_constants(measurements[0].cluster)
    x0 = _to_free(base)

    def residuals(x):
        c = _from_free(x, base)
        res = [
            math.log(estimate(r.model, r.parallel, r.cluster, r.precision, c).step_time_s / r.step_time_s)
            for r in measurements
        ]
        pull = math.sqrt(prior_weight / len(measurements))
        return res + [pull * (xi - x0i) for xi, x0i in zip(x, x0, strict=True)]

    fit = least_squares(residuals, x0, method="lm" if len(measurements) >= 4 else "trf")
    return _from_free(fit.x, base)


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


# --- persistence: constants per cluster ---------------------------------------------------------


def constants_path() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "parallel-tuner"
    return Path(os.environ.get("TUNER_CACHE_DIR", default)) / "perfmodel_constants.json"


# The database keeps every calibration (tuner.store.save_calibration, the prior of the cluster's next
# study); this JSON file is for constants fitted outside a study (bench/, a notebook) and is read
# when the database has none for the cluster.


def load_constants(cluster: ClusterSpec | str, path: Path | None = None) -> ModelConstants:
    """The constants saved for the cluster (by name), else its kind's defaults (default_constants)."""
    path = path or constants_path()
    name = cluster.name if isinstance(cluster, ClusterSpec) else cluster
    try:
        stored = json.loads(path.read_text()).get(name)
    except (OSError, ValueError):
        stored = None
    base = default_constants(cluster)
    if not stored:
        return base
    known = {f.name for f in dataclasses.fields(ModelConstants)}
    return dataclasses.replace(base, **{k: v for k, v in stored.items() if k in known})


def save_constants(cluster_name: str, constants: ModelConstants, path: Path | None = None) -> Path:
    path = path or constants_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[cluster_name] = constants.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
    return path
