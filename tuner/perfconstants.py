"""The performance model's constants: what its formulas cannot know, their defaults per device
kind. A cluster's fitted constants live in the database only (tuner.store.save_calibration /
latest_constants; `tuner calibrate export|import` moves them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tuner.devicelevels import MEMORY_TRAFFIC, device_level
from tuner.spec import ClusterSpec


@dataclass(frozen=True)
class ModelConstants:
    """Efficiencies the formulas cannot know; `calibrate` fits those in FITTED to measurements.
    The class defaults are for a GPU the cluster does not name; default_constants() gives a named
    GPU its device's level (tuner/devicelevels.py) and CPU ranks their own."""

    # A layer's GEMMs reach compute_efficiency x size / (size + compute_half_size) of peak,
    # size = b*s*h/tp: small micro-batches or thin shards run slower. Between the GEMMs, the
    # memory-bound work (norms, GeLU, dropout, residuals, a softmax over the scores without flash
    # attention) costs elementwise_flops_per_byte low-precision peak FLOPs per byte of stored
    # activations (a named GPU's: its memory bandwidth, tuner/devicelevels.py); relative to the
    # GEMMs it shrinks as 1/h, which is why per-GPU throughput rises with model size
    # (Korthikanti table 5: MFU 41.5 % at 22B, 56.3 % at 1T on the same A100s).
    compute_efficiency: float = 0.85
    compute_half_size: float = 2.0**17
    elementwise_flops_per_byte: float = 500.0
    comm_efficiency: float = 0.7  # fraction of link bandwidth a ring collective reaches
    # Costs the roofline misses. Kernel launches and the framework's Python run on the CPU ahead
    # of the GPU, so for one micro-batch a layer's forward + backward takes at least
    # layer_floor_s however little it computes (~100 kernels, plus Megatron/DeepSpeed hooks);
    # large layers hide it entirely. Each collective also pays a software and synchronisation
    # cost beyond the link latency, per round of a log-depth synchronisation (log2 of its group;
    # a cost per peer over-priced tp 4 against tp 2 on our CPU tables); a point-to-point send
    # pays the link latency only. Defaults: chosen
    # on the vTrain h1024 tables (bench/model_validation.py --only h1024) together with the
    # size trend of Korthikanti table 5 (elementwise_flops_per_byte), judged on the others
    # (docs/benchmarks.md).
    layer_floor_s: float = 3e-3
    microbatch_overhead_s: float = 1e-2  # per micro-batch per stage: data, loss, engine bookkeeping
    collective_overhead_s: float = 3e-5
    # Collectives from their parts on CPU ranks (tuner/cost/collectives.py; docs/perfmodel.md,
    # "Collectives"): what one call costs beyond its bytes, measured by bench/gloo_groups.py in busy
    # seconds per rank, as (path, ranks per core, group size, seconds). Paths: "gloo" (a bare
    # all-reduce), "dtensor" (what the trainer's DTensor 1D tensor parallelism adds per Megatron
    # collective), "replicate" and "fsdp" (what FSDP2's replicate and its sharding add per
    # data-parallel collective). Empty on GPUs: NCCL's call costs collective_overhead_s per log2
    # round plus the link latency per hop.
    cpu_call_s: tuple[tuple[str, float, int, float], ...] = ()
    # The framework paths' measured costs (all but "gloo") times this: inside a training step they
    # cost less than in bench/gloo_groups.py's blocks alone; fitted with the CPU defaults.
    framework_call_scale: float = 1.0
    # The wait behind the compute before a blocking collective, as a fraction of that compute,
    # where ranks share cores (more than one per core): the group waits for its slowest member.
    # None on dedicated devices; fitted with the CPU defaults.
    collective_wait_fraction: float = 0.0
    workspace_bytes: float = 2.0e9  # CUDA context, allocator fragmentation, library workspaces
    memory_margin: float = 0.05  # `fits` keeps this fraction of device memory free
    # Measured peaks exceed the tensors' bytes by what the framework keeps besides them (the
    # caching allocator's reserve, communication buckets, fp32 gradient copies): fitted per
    # cluster from the trials' measured peaks by fit_memory_scale().
    memory_scale: float = 1.0
    flash_attention: bool = True  # SDPA/flash: the s x s attention scores are never stored
    # With flash attention, the fraction of peak its kernels reach, as flash-attn's benchmark
    # counts FLOPs (a causal forward 2sh per token, the backward 2.5 forwards: it recomputes the
    # scores). None: the attention core is priced like the GEMMs (CPU ranks, stored calibrations).
    attention_efficiency: float | None = None

    def __post_init__(self) -> None:
        # stored constants come back from JSON with lists where the table has tuples
        table = tuple((str(k), float(r), int(g), float(t)) for k, r, g, t in self.cpu_call_s)
        object.__setattr__(self, "cpu_call_s", table)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Constants older versions stored and fitted that this one no longer has: a stored or exported
# calibration naming them loads without them. dp_overlap (a fitted fraction of data-parallel
# traffic hidden behind compute) gave way to the rule derived from the trainer's order of
# operations (tuner/cost/data.py overlap_rule; issue 37).
RETIRED = ("dp_overlap",)


# What calibrate() fits: the constants step times pin down. compute_half_size and
# collective_overhead_s move GPU step times little (5 % noise leaves them uncertain by +-30 %), and
# the prior's pull keeps them near their defaults there; on CPU ranks (tiny GEMMs, gloo over
# loopback) they are the dominant costs and the measurements move them far.
FITTED = (
    "compute_efficiency",
    "comm_efficiency",
    "layer_floor_s",
    "microbatch_overhead_s",
    "compute_half_size",
    "collective_overhead_s",
)


# What one collective call costs on CPU ranks beyond its bytes, measured on this project's 2-core VM
# by `bench/gloo_groups.py --worlds 8 4 2 --repeats 4` (2026-12-03, docs/benchmarks.md "Collectives
# from their parts"): busy ms per rank (wall ms x cores / ranks), median of 4 runs, by path, ranks
# per core and group size. 8 ranks on 2 cores (4 per core) are the own tables' setting; 4 ranks
# (2 per core) the nearest to a core per rank that measured steadily (2 ranks on the 2 cores
# varied 3-20x between runs: kept out, so one rank per core is priced as two).
_MEASURED_CALL_MS = (
    ("gloo", 4, 2, 0.254), ("gloo", 4, 4, 1.87), ("gloo", 4, 8, 4.71), ("gloo", 2, 2, 0.223), ("gloo", 2, 4, 3.16),
    ("dtensor", 4, 2, 3.57), ("dtensor", 4, 4, 4.43), ("dtensor", 2, 2, 4.13), ("dtensor", 2, 4, 5.18),
    ("replicate", 4, 2, 4.48), ("replicate", 4, 4, 4.73), ("replicate", 4, 8, 5.30), ("replicate", 2, 2, 5.08),
    ("replicate", 2, 4, 6.11),
    ("fsdp", 4, 2, 2.73), ("fsdp", 4, 4, 2.44), ("fsdp", 4, 8, 1.17), ("fsdp", 2, 2, 2.70), ("fsdp", 2, 4, 2.97),
)  # fmt: skip
CPU_CALL_S = tuple((path, float(rpc), g, ms * 1e-3) for path, rpc, g, ms in _MEASURED_CALL_MS)


# CPU ranks (gloo over loopback, ranks sharing a few cores) are nothing like a GPU: milliseconds per
# layer and per collective, no CUDA context. Fitted by `bench/priors.py --fit-cpu-defaults`
# (calibrate() on every layout of bench/priors.py CPU_DEFAULT_TABLES: our gpt-tiny and gpt-small
# 8-rank tables and the two 4-node gpt-small tables of global batch 16); the gpt-deep table and
# the 2D table are held out from them. The digits are scipy 1.17's minimum; the objective has
# another of equal fit (scipy 1.11: docs/benchmarks.md, "The refit with the 4-node tables").
# Refitted when data parallelism's overlap became a rule (issue 37: dp_overlap retired, nothing
# hidden on CPU ranks, FSDP2's gathers as it runs them, an untied head's gradients reduced):
# docs/benchmarks.md, "Overlap priced from what runs".
CPU_CONSTANTS = ModelConstants(
    compute_efficiency=0.9592, compute_half_size=2608.0, elementwise_flops_per_byte=4.261,
    comm_efficiency=0.259, layer_floor_s=2.175e-3, microbatch_overhead_s=1.454e-3,
    cpu_call_s=CPU_CALL_S, framework_call_scale=0.5023, collective_wait_fraction=0.4748,
    workspace_bytes=0.0,  # the trainer's CPU peak is its live tensors: no context or allocator reserve
)  # fmt: skip


def default_constants(cluster: ClusterSpec) -> ModelConstants:
    """The constants a study starts from on a cluster nothing was measured on yet: by its device
    kind (ClusterSpec.device_kind, the one rule); a GPU's grounded in its device's published
    kernel and collective figures (tuner/devicelevels.py), the class defaults for a GPU the
    cluster does not name."""
    if cluster.device_kind == "cpu":
        return CPU_CONSTANTS
    level = device_level(cluster.device)
    if level is None:
        return ModelConstants()
    # Memory-bound work at the device's achievable bandwidth: seconds = bytes x MEMORY_TRAFFIC /
    # (bandwidth x level.memory), in the units the formulas use (FLOPs of cluster.peak_tflops).
    bytes_per_s = cluster.device_row.memory_gbps * 1e9 * level.memory
    return ModelConstants(
        compute_efficiency=level.gemm,
        elementwise_flops_per_byte=MEMORY_TRAFFIC * cluster.peak_tflops * 1e12 / bytes_per_s,
        comm_efficiency=level.comm,
        attention_efficiency=level.flash_attention,
    )
