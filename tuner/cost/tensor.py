"""Tensor parallelism's part of a step (1D: Megatron's; 2D: trainer/tp2d.py, AxoNN's schedule): its
collectives per micro-batch, the part 2D hides behind the weight gradients, and the wait behind
the compute where ranks share cores. Its memory (the activations and weights split over tp) is
the block's: tuner/cost/layer.py.

Sources: Narayanan et al. 2021 ("Megatron-3D") sec. 3.2 and fig. 5 (tensor-parallel all-reduces);
Korthikanti et al. 2022 sec. 4.2.2 (sequence parallelism); AxoNN (Singh et al. 2023) sec. 3 for 2D
tensor parallelism as trainer/tp2d.py runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.contract.parallel import ParallelConfig
from trainer.contract.rules import gathers_norms_again
from tuner.cost.collectives import Comm, Link, allreduce, call_overhead_s, wait_s
from tuner.cost.layer import recomputed_modules

if TYPE_CHECKING:
    from tuner.cost.case import Case


@dataclass(frozen=True)
class TensorPart:
    """Tensor parallelism's seconds per micro-batch on a stage."""

    comm_mb: Comm  # exposed collectives
    hidden_mb: Comm  # traffic overlapped with compute (2D only): it keeps a core busy all the same
    wait_mb: float  # the wait behind the compute before blocking collectives

    def terms(self, microbatches: int) -> dict[str, float]:
        return {
            "tp_comm_intra_s": microbatches * self.comm_mb.intra,
            "tp_comm_inter_s": microbatches * self.comm_mb.inter,
            "collective_wait_s": microbatches * self.wait_mb,
        }


def tensor_part(case: Case, layers: float, compute_mb: float, floor_mb: float, dw_mb: float) -> TensorPart:
    """One micro-batch's tensor-parallel seconds on a stage of `layers` layers whose compute (and
    launch floor) is `compute_mb` (`floor_mb`), of which `dw_mb` the weight gradients' GEMMs.
    With tensor parallelism each compute segment of a layer ends in a blocking collective of the
    group: where ranks share cores, the group waits for its slowest member. The CPU work before
    them is the compute and, with 1D's DTensor, the framework's Python around each call."""
    p, c = case.layout, case.constants
    if p.tp_col > 1:
        comm_mb, hidden_mb = tensor_2d(case, layers, dw_mb)
    else:
        comm_mb, hidden_mb = tensor_1d(case, layers), Comm()
    rpc = case.ranks_per_core
    wait_mb = 0.0
    if case.tp_block > 1:
        dtensor_mb = (
            layers * tp_1d_collectives(p) * call_overhead_s(p.tp, c, rpc, "dtensor") if p.tp_col == 1 else 0.0
        )
        wait_mb = wait_s(compute_mb + floor_mb + dtensor_mb, c, rpc)
    return TensorPart(comm_mb, hidden_mb, wait_mb)


def tensor_1d(case: Case, layers: float) -> Comm:
    """Megatron's tensor parallelism, one micro-batch on a stage: 2 all-reduces forward and 2
    backward per layer (Megatron-3D sec. 3.2, fig. 5); with sequence parallelism each becomes
    reduce-scatter + all-gather, same bytes (Korthikanti sec. 4.2.2); full recompute repeats the
    forward ones. None overlaps compute. On CPU ranks each also pays what the trainer's DTensor
    path adds to the call (its redistributions; bench/gloo_groups.py)."""
    m, p, c = case.model, case.layout, case.constants
    t = p.tp
    if t <= 1:
        return Comm()
    rpc = case.ranks_per_core
    link = case.link(t, 1)
    # a rank's share of the sequence (tuner/cost/context.py)
    per = allreduce(case.tokens_mb * m.hidden_size * case.value_bytes, t, link, c, rpc)
    per = per + Comm.on(link.tier, call_overhead_s(t, c, rpc, "dtensor"))
    return per * (layers * tp_1d_collectives(p))


def tp_1d_collectives(p: ParallelConfig) -> int:
    """1D tensor parallelism's blocking collectives per layer and micro-batch (Megatron-3D sec. 3.2);
    op-level checkpointing reruns attention's all-reduce (with sequence parallelism the two
    all-gathers; it keeps the reduce-scatters) and stops before the MLP's, which nothing in the
    backward needs (checkpoint's early stop)."""
    # Sequence parallelism gathers each norm's output again in the backward (two all-gathers, one
    # all-reduce's bytes): the norm's kept shard (gathers_norms_again) or, with Megatron's
    # layernorm recompute, the recomputed output; full and op-level recompute rerun the forward's
    again = (
        1 if p.sequence_parallel and ("layernorm" in recomputed_modules(p) or gathers_norms_again(p)) else 0
    )
    return 4 + {"full": 2, "op": 1}.get(p.activation_checkpoint, again)


def tensor_2d(case: Case, layers: float, dw_mb: float) -> tuple[Comm, Comm]:
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
    (`dw_mb`); the forward ones, q/k/v's shared one and the norms' block. Plain all-reduces on
    local tensors: no framework cost per call on CPU ranks, only gloo's. The Llama block (not in
    trainer/tp2d.py yet) is priced the same way: k and v's Y are kv_size/t wide (GQA), SwiGLU's
    gate reduces its ffn/t Y as MLP-up does, and its dX is summed with up's as q/k/v's are."""
    m, p, c = case.model, case.layout, case.constants
    t, k, h, f = p.tp, p.tp_col, m.hidden_size, m.ffn_size
    tokens = case.tokens_mb
    col, row = case.link(k, 1), case.link(t, k)
    rpc = case.ranks_per_core
    act_bytes = case.value_bytes

    def ar(values_per_token: float, n: int, link: Link, dtype_bytes: int = act_bytes) -> Comm:
        return allreduce(tokens * values_per_token * dtype_bytes, n, link, c, rpc)

    # a norm's one all-reduce each way of its fp32 sums: LayerNorm's stacked (sum x, sum x^2),
    # RMSNorm's sum x^2 (one a statistic: NormKind.stats)
    norm = ar(m.norm_kind.stats, k, col, 4)
    up = m.mlp_kind.inputs  # linear layers reading the MLP's input
    qkv = ar(h / t, k, col) + 2 * ar(m.kv_size / t, k, col)  # 3 ar(h/t) to the bit when kv = h
    fwd = qkv + ar(f / t, k, col) * up + 2 * ar(h / k, t, row) + 2 * norm
    bwd_blocking = ar(h / k, t, row) + 2 * norm  # q/k/v's summed dX
    bwd_overlapped = ar(h / k, t, row) + ar(h / t, k, col) + ar(f / t, k, col)
    repeats = 2 if p.activation_checkpoint == "full" else 1
    # the stage's last: the final norm, the head (its logits forward, its dX backward)
    forward = fwd * (layers * repeats) + norm + ar(m.vocab_size / t, k, col)
    blocking = bwd_blocking * layers + norm
    overlapped = bwd_overlapped * layers + ar(h / k, t, row)
    hidden = min(overlapped.total, dw_mb)
    exposed_share = 1 - hidden / overlapped.total if overlapped.total > 0 else 1.0
    return forward + blocking + overlapped * exposed_share, overlapped * (1 - exposed_share)
