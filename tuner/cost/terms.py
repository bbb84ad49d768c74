"""What an estimate says: a step second by second (`StepTerms`, each axis's part filling its own
terms, which add up to the step time), their labels, and the `Estimate` with the memory.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass


@dataclass(frozen=True)
class StepTerms:
    """A predicted step, second by second: the terms sum to the step time. Communication is split
    into the part inside a node (`_intra_s`) and the part across nodes (`_inter_s`), each priced
    on the link its group spans."""

    compute_s: float  # GEMMs, attention, memory-bound work and recompute, every micro-batch, slowest stage
    launch_floor_s: float  # layers that compute faster than launching them takes (layer_floor_s)
    microbatch_overhead_s: float  # the framework's per-micro-batch bookkeeping
    tp_comm_intra_s: float  # tensor-parallel collectives not hidden behind compute
    tp_comm_inter_s: float
    # ranks sharing cores: a tensor-parallel group waits behind the compute for its slowest member
    collective_wait_s: float
    pp_bubble_s: float  # ranks idle while the pipeline fills and drains
    pp_p2p_intra_s: float  # pipeline sends on the critical path
    pp_p2p_inter_s: float
    dp_comm_intra_s: float  # data-parallel collectives not hidden behind backward
    dp_comm_inter_s: float
    optimizer_s: float  # the AdamW step
    shared_cores_s: float  # ranks sharing CPU cores wait for a core beyond all of the above
    # A mixture of experts' all-to-alls (dispatch and combine, tuner/cost/experts.py) on the critical path,
    # by the tier the ep group spans; 0 for a dense model.
    moe_a2a_intra_s: float = 0.0
    moe_a2a_inter_s: float = 0.0
    # Context parallelism's K/V gathers and their gradients' return (tuner/cost/context.py), by the tier the
    # cp group spans; 0 without it.
    cp_comm_intra_s: float = 0.0
    cp_comm_inter_s: float = 0.0
    # Activation offload's copies to host memory and back (compute.offload_s); 0 without it.
    offload_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(_TERM_VALUES(self))  # field order, as astuple summed them (bit for bit)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


_TERM_VALUES = operator.attrgetter(*(f.name for f in dataclasses.fields(StepTerms)))

# How `tuner plan --explain`, the API and the dashboard name each term.
TERM_LABELS = {
    "compute_s": "compute", "launch_floor_s": "launch floor", "microbatch_overhead_s": "per-micro-batch overhead",
    "tp_comm_intra_s": "tensor-parallel comm (in node)", "tp_comm_inter_s": "tensor-parallel comm (across nodes)",
    "collective_wait_s": "wait behind compute before collectives", "pp_bubble_s": "pipeline bubble",
    "pp_p2p_intra_s": "pipeline sends (in node)", "pp_p2p_inter_s": "pipeline sends (across nodes)",
    "dp_comm_intra_s": "data-parallel comm (in node)", "dp_comm_inter_s": "data-parallel comm (across nodes)",
    "optimizer_s": "optimizer step", "shared_cores_s": "ranks sharing cores",
    "moe_a2a_intra_s": "expert all-to-all (in node)", "moe_a2a_inter_s": "expert all-to-all (across nodes)",
    "cp_comm_intra_s": "context-parallel K/V (in node)", "cp_comm_inter_s": "context-parallel K/V (across nodes)",
    "offload_s": "activation offload (host link)",
}  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    memory_bytes: float
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    workspace_bytes: float
    step_time_s: float  # = terms.total_s
    terms: StepTerms
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    fits: bool
    vocab_size: int = 0  # the padded vocabulary priced (tuner.spec.padded_vocab for the layout's tp)
    # A mixture of experts: what its terms were priced from (experts.moe_info); None for a dense model.
    moe: dict | None = None
    # Communication hidden behind compute, by the term it would have added to (seconds a step,
    # not in the terms): data parallelism's (tuner/cost/data.py overlap_rule), 2D tensor
    # parallelism's (tensor.tensor_2d). Every other communication term blocks the compute stream.
    hidden: dict[str, float] = dataclasses.field(default_factory=dict)

    # The terms grouped as before the tier split (what the 2D comparison and older callers read).
    @property
    def compute_s(self) -> float:
        return self.terms.compute_s

    @property
    def tp_comm_s(self) -> float:
        return self.terms.tp_comm_intra_s + self.terms.tp_comm_inter_s

    @property
    def pp_bubble_s(self) -> float:
        return self.terms.pp_bubble_s

    @property
    def pp_p2p_s(self) -> float:
        return self.terms.pp_p2p_intra_s + self.terms.pp_p2p_inter_s

    @property
    def dp_comm_s(self) -> float:
        return self.terms.dp_comm_intra_s + self.terms.dp_comm_inter_s

    def to_dict(self) -> dict:
        """Every field; `moe` only for a mixture of experts (a dense estimate keeps its keys)."""
        data = dataclasses.asdict(self)
        if data["moe"] is None:
            del data["moe"]
        return data
