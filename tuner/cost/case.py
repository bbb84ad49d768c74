"""One case the cost model prices: a model, a layout, the hardware, the dtype and the constants,
bound once, with the quantities every part of the model reads (the dtype's bytes, a rank's tokens
of a micro-batch, the slowest stage's layers, ranks per core, the peaks). Each axis's part
(tensor.py, pipeline.py, data.py, context.py, experts.py) takes the case instead of re-deriving
them from (model, layout, cluster, precision, constants).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from trainer.contract.devices import DeviceKind
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.cost import dtypes
from tuner.cost.collectives import Link, group_link, ranks_per_core
from tuner.cost.context import local_tokens
from tuner.perfconstants import ModelConstants, default_constants
from tuner.spec import ClusterSpec, padded_model


@dataclass(frozen=True)
class Case:
    """What one estimate is priced from. `cluster` is None for memory alone (the memory model
    needs only the device kind: tuner.memmodel.memory's callers); the step needs it."""

    model: ModelConfig  # as priced: `priced` pads its vocabulary for the layout's tp
    layout: ParallelConfig
    precision: str  # the dtype trials compute in (StudySpec.trial_dtype); dtypes.py turns it into bytes
    constants: ModelConstants
    cluster: ClusterSpec | None = None
    device: DeviceKind = "gpu"  # the ranks' kind (ClusterSpec.device_kind): its kernels keep what they keep
    moe_imbalance: float = 1.0  # a mixture of experts' max/mean tokens per expert (StudySpec.moe_imbalance)
    peak_tflops: float = 0.0  # the GEMMs' peak in the compute dtype (TFLOP/s: what MFU divides by)
    peak_flops: float = 0.0  # ... in FLOP/s
    # The low-precision peak: memory-bound work is written in FLOPs of it (elementwise_flops_per_byte
    # is per byte at that peak: an fp32 step moves twice the bytes, not at the fp32 peak's rate).
    memory_peak_flops: float = 0.0
    # FSDP2's / replicate's reduce dtype for the gradients (BenchmarkConfig.grad_reduce_dtype): what a
    # pipeline's or no_sync's gradients accumulate in, whole ("fp32" or "bf16").
    grad_reduce_dtype: str = "fp32"
    # Derived once (in __post_init__, for the step's and the memory's hot paths): what every part
    # reads of the case.
    value_bytes: int = field(init=False, repr=False)  # a value of the compute dtype (dtypes.value_bytes)
    units_16bit: int = field(init=False, repr=False)  # ... in Korthikanti's 16-bit units (dtypes.units_16bit)
    # Tokens of one micro-batch a rank holds, before sequence parallelism splits them over tp: its
    # context-parallel share of the sequence (context.local_tokens).
    tokens_mb: float = field(init=False, repr=False)
    # Ranks holding the same weights: data parallelism's and context parallelism's (context.py).
    replicas: int = field(init=False, repr=False)
    tp_block: int = field(init=False, repr=False)  # ranks that share each weight: tp x tp_col
    # Layers on the slowest pipeline rank: ceil(L / (pp v)) per local stage, v of them.
    slowest_layers: int = field(init=False, repr=False)
    ranks_per_core: float = field(init=False, repr=False)  # CPU ranks sharing a core on a node (0 on GPUs)

    def __post_init__(self) -> None:
        m, p, put = self.model, self.layout, object.__setattr__  # frozen: set once, here
        put(self, "value_bytes", dtypes.value_bytes(self.precision))
        put(self, "units_16bit", self.value_bytes // 2)  # dtypes.units_16bit
        put(self, "tokens_mb", local_tokens(m, p))
        put(self, "replicas", p.dp * p.cp)
        put(self, "tp_block", p.tp * p.tp_col)
        put(self, "slowest_layers", math.ceil(m.num_layers / (p.pp * p.virtual_stages)) * p.virtual_stages)
        put(
            self,
            "ranks_per_core",
            0.0 if self.cluster is None else ranks_per_core(self.cluster, p.world_size),
        )

    @classmethod
    def priced(
        cls, model: ModelConfig, layout: ParallelConfig, cluster: ClusterSpec, precision: str = "bf16",
        constants: ModelConstants | None = None, moe_imbalance: float = 1.0, grad_reduce_dtype: str = "fp32",
    ) -> Case:  # fmt: skip
        """The case `tuner.perfmodel.estimate` prices: the vocabulary the layout builds (Megatron's
        padding, tuner.spec.padded_model), the cluster's default constants unless given."""
        peak_tflops = cluster.peak_tflops_for(dtypes.peak_dtype(precision))
        return cls(
            padded_model(model, layout.tp), layout, precision, constants or default_constants(cluster), cluster,
            cluster.device_kind, moe_imbalance, peak_tflops, peak_tflops * 1e12, cluster.peak_tflops * 1e12,
            grad_reduce_dtype,
        )  # fmt: skip

    def on_links_of(self, cluster: ClusterSpec) -> Case:
        """The same case with `cluster`'s links (the shared-cores bound prices the CPU part of the
        communication on on-node links): the peaks and the device stay."""
        return dataclasses.replace(self, cluster=cluster)

    def link(self, size: int, stride: int) -> Link:
        """The link of a group of `size` ranks `stride` apart on the case's cluster."""
        assert self.cluster is not None
        return group_link(self.cluster, size, stride)
