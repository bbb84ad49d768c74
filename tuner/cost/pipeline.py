"""Pipeline parallelism's part: in a step, the bubble and the sends between stages (and the tied
embedding's gradients between the first and the last); in memory, the layers each rank holds, the
micro-batches in flight of each schedule (Narayanan et al. 2021 sec. 2.2; Korthikanti et al. 2022
sec. 4.2.3) and torch's interleaved order of a rank's forwards and backwards.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.contract.parallel import ParallelConfig, stage_layer_count
from trainer.contract.rules import V_SCHEDULES
from tuner.cost.collectives import Comm, allreduce, send_s

if TYPE_CHECKING:
    from tuner.cost.case import Case
    from tuner.cost.memory import RankBytes


@dataclass(frozen=True)
class PipelinePart:
    """The pipeline's seconds in a step: the bubble, the sends on the critical path."""

    bubble_s: float
    p2p: Comm

    def terms(self) -> dict[str, float]:
        return {
            "pp_bubble_s": self.bubble_s,
            "pp_p2p_intra_s": self.p2p.intra,
            "pp_p2p_inter_s": self.p2p.inter,
        }


def pipeline_part(case: Case, critical_mb: float, dw_mb: float = 0.0) -> PipelinePart:
    """The bubble is (p-1) stage-times, divided by v when interleaved (Megatron-3D sec. 2.2), a
    stage-time being `critical_mb`: what blocks a micro-batch on the slowest stage (the framework's
    per-micro-batch bookkeeping runs on each rank's CPU and does not lengthen it). A V schedule's
    (ZBV, DualPipeV): its ranks' orders (torch's) run on a clock (`v_idle`), each backward split
    into its input half and its weight half (`dw_mb`: the weight gradients' GEMMs)."""
    m, p, c = case.model, case.layout, case.constants
    h, t, pp, v, mb = m.hidden_size, p.tp, p.pp, p.virtual_stages, p.num_microbatches
    tc, d = case.tp_block, case.replicas
    if p.pp_schedule in V_SCHEDULES and pp > 1:
        bubble = v_idle(p.pp_schedule, pp, mb, dw_mb / critical_mb if critical_mb else 0.0) * critical_mb
    else:
        bubble = (pp - 1) / v * critical_mb
    p2p = Comm()
    if pp > 1:
        # scatter/gather: sec. 4.1; 2D: the residual stream is split over the column group
        msg = case.tokens_mb * h * case.value_bytes / (t if p.sequence_parallel else p.tp_col)
        # forward activation + backward gradient per micro-batch per chunk, on the critical path
        p2p = send_s(msg, case.link(pp, tc * d), c) * (2 * (mb * v + pp - 1))
        if m.tie_embeddings:  # the two copies' fp32 gradients summed between the first and the last
            # stage once a step, this rank's shard (trainer/pipeline.py TiedEmbeddings; Megatron's
            # embedding group), blocking before clipping
            shard = tc * (p.dp_shard * p.cp if p.zero_stage else 1)
            ends = case.link(2, (pp - 1) * tc * d)
            p2p = p2p + allreduce(m.vocab_size * h / shard * 4, 2, ends, c, case.ranks_per_core)
    return PipelinePart(bubble, p2p)


def interleaved_moments(
    p: ParallelConfig, r: RankBytes, stage: int, accumulated: float, working: float, fresh: float
) -> tuple[float, float, float]:
    """tuner.cost.memory.forward_backward's peak for an interleaved rank, walked through the rank's own order of
    forwards and backwards (`interleaved_order`): its local stages differ (the head and its loss
    on the last rank's last one, the embedding on the first rank's first), a local stage's
    gradients exist once its first backward is done, and a rank's first backward comes after all of
    its first local stage's forwards but only some of its later ones."""
    last_rank = stage == p.pp - 1
    root_params = r.root / r.cb  # the embedding (first rank, local stage 0) or the head (last rank, last)
    root_grads = r.accumulated_bytes * root_params  # fp32, or bf16 (grad_reduce_dtype)
    layer_grads = accumulated - root_grads - r.vocab_grad
    home = len(r.chunks) - 1 if last_rank else 0
    acts = [r.layers * f + (r.head if last_rank and j == home else 0.0) for j, f in enumerate(r.chunks)]
    grads_of = [
        layer_grads * f + ((root_grads + r.vocab_grad) if j == home else 0.0) for j, f in enumerate(r.chunks)
    ]
    # Sends (trainer/pipeline.py Interleaved1F1B): a local stage's output, kept for its backward
    # anyway, is let go once its backward starts; its input's gradient is held until the
    # previous rank has provably received it (_released: how many go at each forward).
    to_next = [stage + j * p.pp < p.num_stages - 1 for j in range(len(r.chunks))]
    to_previous = [stage + j * p.pp > 0 for j in range(len(r.chunks))]
    held, grads, started = 0.0, 0.0, set()
    # The peak moment by its sum, the first of equal ones: max(moments, key=sum), kept as it goes
    # (a + b + c is sum's order). The walk is a plan's hottest loop: the moments are inlined, and
    # the steady state's middle periods are not walked (_walk: every period repeats the one
    # before, its held gradients' net change added at once).
    best, best_sum = None, -math.inf
    zero3, layers, flow, boundary = p.zero_stage == 3, r.layers, r.flow, r.boundary
    head, skipped_net, tail = _walk(p.pp, p.virtual_stages, p.num_microbatches, stage)
    for kind, j, released in itertools.chain(head, (("skip", 0, 0),), tail):
        if kind == "skip":
            held += skipped_net * boundary
            continue
        if kind == "F":
            held += acts[j] + (boundary if to_next[j] else 0.0) - released * boundary
            if last_rank and j == home:  # the loss, computed at the end of the last stage's forward
                a, b, c = r.root if zero3 else r.whole, grads, held + r.loss
                if a + b + c > best_sum:
                    best, best_sum = (a, b, c), a + b + c
            continue
        others = held - acts[j]
        # ... with its received gradient (trainer/pipeline.py OnDemandStage) while it runs
        grad_in = boundary if to_next[j] else 0.0
        # (and the logits, which torch's schedule holds to the next forward)
        logits = r.output_held if last_rank and j == home else 0.0
        b, c = grads + fresh, others + layers * r.chunks[j] + flow + grad_in + logits
        if working + b + c > best_sum:
            best, best_sum = (working, b, c), working + b + c
        if zero3:  # a backward that does not sync leaves its layers gathered (see above)
            c = others + r.layer + flow + grad_in + logits
            if r.whole + b + c > best_sum:
                best, best_sum = (r.whole, b, c), r.whole + b + c
        # its output's send let go, its input gradient's held
        held = others - grad_in + (boundary if to_previous[j] else 0.0)
        if j not in started:  # its gradients, whole and in fp32 until the step's last backward
            started.add(j)
            grads += grads_of[j]
    return best


def interleaved_order(pp: int, v: int, n: int, rank: int) -> list[tuple[str, int]]:
    """The forwards and backwards of pipeline rank `rank`, in torch's interleaved order (_order)."""
    return list(_order(pp, v, n, rank))


@functools.lru_cache(maxsize=4096)
def _walk(
    pp: int, v: int, n: int, rank: int
) -> tuple[tuple[tuple[str, int, int], ...], int, tuple[tuple[str, int, int], ...]]:
    """`_order` with, for each op, the input gradients it lets go (_released), and the steady
    state's middle periods left out: (the ops up to the end of its second period, the gradients
    the left-out periods hold in all (sent less let go), the ops from its last period on). A
    period is round x v steady ops (a forward and a backward each): the forwards' and the
    backwards' local stages both repeat with it and every local stage has had its first backward
    by the end of the first, so from the second period on each period's moments are the previous
    one's plus its net held gradients (0 once the sends are let go as they arrive)."""
    order = _order(pp, v, n, rank)
    released = _released(pp, v, n, rank)
    ops = tuple((kind, j, let_go) for (kind, j), let_go in zip(order, released, strict=True))
    per_round = n // max(1, n // pp)
    total = v * n
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)
    period = per_round * v
    periods = (total - warmup) // period
    if periods < 4:
        return ops, 0, ()
    # ops before the warm-up's end give one entry (a forward), steady ops two
    head_end = warmup + 2 * 2 * period
    tail_start = warmup + 2 * (periods - 1) * period
    sends = sum(1 for kind, j, _ in ops[head_end:tail_start] if kind == "B" and rank + j * pp > 0)
    let_go = sum(r for _, _, r in ops[head_end:tail_start])
    return ops[:head_end], sends - let_go, ops[tail_start:]


@functools.lru_cache(maxsize=4096)
def _released(pp: int, v: int, n: int, rank: int) -> tuple[int, ...]:
    """For each op of `_order(pp, v, n, rank)`: how many of the rank's input-gradient sends it lets
    go (trainer/pipeline.py Sends): a forward whose input the previous rank sent after its
    backward of the stage before a held gradient's (positions in `_order` of the previous rank)."""
    previous = (rank - 1) % pp

    def before(j: int) -> int | None:  # the previous rank's local stage of stage rank + j pp - 1
        return j if rank > 0 else (j - 1 if j > 0 else None)

    # (A count of micro-batches the trainer refuses, not a multiple of the rounds, gives local
    # stages unequal counts: an op the previous rank lacks lets go nothing, or is never let go.)
    position = {op: i for i, op in enumerate(_ops_with_microbatches(pp, v, n, previous))}
    held: list[float] = []  # the previous rank's positions of the backwards the held gradients wait for
    out = []
    for kind, j, mb in _ops_with_microbatches(pp, v, n, rank):
        k = before(j)
        if kind == "F":
            reached = position.get(("F", k, mb), -1) if k is not None else -1
            kept = [after for after in held if after >= reached]
            out.append(len(held) - len(kept))
            held = kept
        else:
            out.append(0)
            if k is not None:
                held.append(position.get(("B", k, mb), math.inf))
    return tuple(out)


def _ops_with_microbatches(pp: int, v: int, n: int, rank: int) -> list[tuple[str, int, int]]:
    """`_order` with each op's micro-batch: torch counts each local stage's forwards and
    backwards on their own (the k-th forward of a local stage is micro-batch k)."""
    counts: dict[tuple[str, int], int] = {}
    out = []
    for kind, j in _order(pp, v, n, rank):
        mb = counts.get((kind, j), 0)
        counts[(kind, j)] = mb + 1
        out.append((kind, j, mb))
    return out


@functools.lru_cache(maxsize=4096)  # a plan asks the same few (pp, v, n, rank) for every layout
def _order(pp: int, v: int, n: int, rank: int) -> tuple[tuple[str, int], ...]:
    """The forwards ("F") and backwards ("B") of pipeline rank `rank` in the order torch's
    ScheduleInterleaved1F1B runs them, each with its local stage (0 .. v-1: stage rank + j pp):
    a warm-up of (v - 1) x round + 2 (pp - 1 - rank) forwards, rounds of n // max(1, n // pp)
    micro-batches per local stage (pp when pp divides n; torch.distributed.pipelining.schedules
    _get_warmup_ops), then one forward and one backward in turn, then the remaining backwards, the
    latest local stage first."""
    rounds = max(1, n // pp)
    per_round = n // rounds
    total = v * n
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)
    order: list[tuple[str, int]] = []
    for op in range(total + warmup):
        if op < total:
            order.append(("F", (op // per_round) % v))
        if op >= warmup:
            order.append(("B", v - 1 - ((op - warmup) // per_round) % v))
    return tuple(order)


def chunk_shares(num_layers: int, p: ParallelConfig, stage: int) -> tuple[float, ...]:
    """Each local stage's share of the layers of the rank at pipeline coordinate `stage`."""
    sizes = local_stage_layers(num_layers, p, stage)
    total = sum(sizes)
    return tuple(x / total for x in sizes) if total else tuple(1.0 / len(sizes) for _ in sizes)


def local_stage_layers(num_layers: int, p: ParallelConfig, stage: int) -> list[int]:
    """Layers of each local stage of the rank at pipeline coordinate `stage` (trainer/pipeline.py:
    contiguous ranges, earlier stages take the remainder; interleaved ranks hold stages r, r + pp,
    ..., a V schedule's r and 2 pp - 1 - r: ParallelConfig.stages_of)."""
    return [stage_layer_count(num_layers, p.num_stages, s) for s in p.stages_of(stage)]


def stage_layers(num_layers: int, p: ParallelConfig, stage: int) -> int:
    """Layers on the rank at pipeline coordinate `stage`, all its local stages."""
    return sum(local_stage_layers(num_layers, p, stage))


def in_flight(p: ParallelConfig, stage: int) -> float:
    """Micro-batches whose activations a rank holds at once (Narayanan et al. 2021 sec. 2.2):
    all of them with GPipe; with 1F1B min(pp - stage, m); interleaved, the first rank's warm-up of
    2(pp - 1) + (v - 1) pp + 1 chunks of L/(pp v) layers, i.e. x (1 + (pp - 1)/(pp v))
    (Korthikanti sec. 4.2.3); gradient accumulation one at a time."""
    n, pp, v = p.num_microbatches, p.pp, p.virtual_stages
    if pp == 1:
        return 1.0
    if p.pp_schedule == "gpipe":
        return float(n)
    if p.pp_schedule in V_SCHEDULES:  # ... whose weight half is still to come, torch's V order
        held = peak = 0
        for kind, _, _ in v_order(p.pp_schedule, pp, n, stage):
            held += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
            peak = max(peak, held)
        return peak / v
    if v > 1:  # the most local stages' forwards whose backward is still to come, torch's order
        held = peak = 0
        for kind, _ in _order(pp, v, n, stage):
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        return peak / v
    return float(min(pp - stage, n))


# What torch's split backward (a V schedule's input half, then its weight half) costs beyond one
# whole backward, per layer and micro-batch, in host seconds: its walks of the autograd graph for the
# weights' groups and the graph kept between the halves. Measured by `bench/split_backward.py`
# (2026-12-06, this project's 2-core VM, one thread, torch 2.13): a dense gpt-small layer 1.9 ms, a
# moe-small layer 3.1 / 3.6 / 5.9 ms with 2 / 4 / 8 experts in the CPU's loop over them (2.4 ms +
# 0.43 ms an expert, fitted by hand to those three). On GPUs the same host work, priced with the
# layer's launch floor (it delays the weight half's kernels only where they would wait for the host
# anyway); a GPU's grouped GEMM has no node per expert: 2.4 ms a MoE layer. Not fitted to any table.
SPLIT_BACKWARD_DENSE_S = 1.9e-3
SPLIT_BACKWARD_MOE_S = 2.4e-3
SPLIT_BACKWARD_EXPERT_S = 0.43e-3


def split_backward_s(case: Case) -> float:
    """A V schedule's host seconds of split backwards per layer and micro-batch on its busiest rank
    (the last: no first stage, whose weight half runs a plain backward): the layer's split cost x
    the share of the rank's local-stage backwards torch splits (all of ZBV's, a few of DualPipeV's:
    its paired steps run whole backwards). 0 for every other schedule."""
    m, p = case.model, case.layout
    if p.pp_schedule not in V_SCHEDULES or p.pp == 1:
        return 0.0
    order = v_order(p.pp_schedule, p.pp, p.num_microbatches, p.pp - 1)
    share = sum(kind == "I" for kind, _, _ in order) / (2 * p.num_microbatches)
    per_layer = SPLIT_BACKWARD_DENSE_S
    if m.moe and m.num_moe_layers:
        moe = SPLIT_BACKWARD_MOE_S + (
            SPLIT_BACKWARD_EXPERT_S * m.num_experts / p.ep if case.device == "cpu" else 0.0
        )
        per_layer += (moe - SPLIT_BACKWARD_DENSE_S) * m.num_moe_layers / m.num_layers
    return share * per_layer


@functools.lru_cache(maxsize=1024)
def v_order(schedule: str, pp: int, n: int, rank: int) -> tuple[tuple[str, int, int], ...]:
    """Pipeline rank `rank`'s forwards ("F"), whole backwards ("B"), input ("I") and weight ("W")
    halves of a split backward, in the order torch's ScheduleZBVZeroBubble or ScheduleDualPipeV
    computes them (the model cannot import torch: tests/tuner/test_memmodel.py checks these
    against torch's), each with its local stage (0: stage rank, 1: stage 2 pp - 1 - rank) and
    micro-batch; DualPipeV's paired forward-and-backward steps flattened (the trainer runs them
    one after the other)."""
    return tuple(_zbv_order(pp, n, rank) if schedule == "zbv" else _dualpipev_order(pp, n, rank))


def _zbv_order(pp: int, n: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's ScheduleZBVZeroBubble._calculate_single_rank_operations (at least 2 pp - 1
    micro-batches walked, those past n dropped)."""
    n_micro = max(2 * pp - 1, n)
    ops: list[tuple[str, int, int]] = []
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}

    def add(kind: str, j: int, key: str) -> None:
        ops.append((kind, j, count[(key, j)]))

    def forward(j: int) -> None:
        add("F", j, "F")
        count[("F", j)] += 1

    def backward(j: int) -> None:  # its input half, then its weight half
        add("I", j, "B")
        add("W", j, "B")
        count[("B", j)] += 1

    for _ in range(2 * (pp - rank) - 1):
        forward(0)
    for _ in range(rank):
        forward(1)
        forward(0)
    for _ in range(pp - rank):
        forward(1)
        backward(1)
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n_micro:
        if count[("F", 0)] < n_micro:
            forward(0)
        backward(0)
        forward(1)
        backward(1)
    weights = {0: count[("B", 0)], 1: count[("B", 1)]}
    for _ in range(rank):
        for j in (0, 1):
            add("I", j, "B")
            count[("B", j)] += 1
    for _ in range(pp - rank):
        add("I", 0, "B")
        count[("B", 0)] += 1
        ops.append(("W", 0, weights[0]))
        weights[0] += 1
    for j in (1, 0):
        while weights[j] < count[("B", j)]:
            ops.append(("W", j, weights[j]))
            weights[j] += 1
    return [op for op in ops if op[2] < n]


def _dualpipev_order(pp: int, n: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's ScheduleDualPipeV._calculate_single_rank_operations (DeepSeek's DualPipe on a V:
    steps 1-8 of its order), its paired steps flattened to their forward, then their backward."""
    ops: list[tuple[str, int, int]] = []
    forwards, inputs = [0, 0], [0, 0]  # per local stage: the next forward's and backward's micro-batch
    weights: list[
        tuple[int, int]
    ] = []  # (local stage, micro-batch) of the input halves' weight halves to come

    def forward(j: int) -> None:
        ops.append(("F", j, forwards[j]))
        forwards[j] += 1

    def backward(j: int, split: bool = False) -> None:
        ops.append(("I" if split else "B", j, inputs[j]))
        if split:
            weights.append((j, inputs[j]))
        inputs[j] += 1

    def weight() -> None:
        if weights:
            ops.append(("W", *weights.pop(0)))

    for _ in range((pp - rank - 1) * 2):
        forward(0)
    for _ in range(rank + 1):
        forward(0)
        forward(1)
    for _ in range(pp - rank - 1):
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(n - pp * 2 + rank + 1):
        forward(0)  # paired with 1's backward, but the last rank's first pair (not overlapped)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(pp - rank - 1):
        backward(1)
        forward(1)
        backward(0)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        backward(1, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(pp - rank - 1):
        weight()
        backward(0, split)
    for _ in range(rank + 1):
        weight()
    return ops


@functools.lru_cache(maxsize=4096)
def v_idle(schedule: str, pp: int, n: int, dw_share: float) -> float:
    """A V schedule's idle time on its busiest rank, in micro-batch stage-times (a rank's forward
    and backward of one micro-batch, both local stages): every rank runs its own order (v_order)
    on a clock, an op starting once the rank is free and its input is there (a forward after the
    previous stage's, a backward's input half after the next stage's, a weight half after its
    input half); a local stage's forward takes 1/6 of a stage-time, its backward's weight half
    `dw_share` / 2 (the weight gradients' GEMMs), its input half the rest. Sends take no time here
    (priced on their own: pipeline_part's p2p). The makespan less a rank's own work."""
    dw_share = round(min(max(dw_share, 0.0), 2 / 3), 3)
    f, w = 1 / 6, dw_share / 2
    i = 1 / 3 - w
    duration = {"F": f, "I": i, "W": w, "B": i + w}
    orders = [v_order(schedule, pp, n, r) for r in range(pp)]

    def stage_of(rank: int, j: int) -> int:
        return rank if j == 0 else 2 * pp - 1 - rank

    done: dict[tuple[str, int, int], float] = {}  # ("F" | "G" (input gradient) | "W", stage, mb): end
    clock, at = [0.0] * pp, [0] * pp
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while at[r] < len(orders[r]):
                kind, j, mb = orders[r][at[r]]
                s = stage_of(r, j)
                if kind == "F":
                    need = ("F", s - 1, mb) if s > 0 else None
                elif kind in ("I", "B"):
                    need = ("G", s + 1, mb) if s < 2 * pp - 1 else ("F", s, mb)
                else:
                    need = ("G", s, mb)
                if need is not None and need not in done:
                    break
                start = max(clock[r], done[need] if need is not None else 0.0)
                clock[r] = start + duration[kind]
                done[("G" if kind in ("I", "B") else kind, s, mb)] = clock[r]
                at[r] += 1
                progressed = True
    if any(at[r] < len(orders[r]) for r in range(pp)):
        raise RuntimeError(f"{schedule} with pp {pp}, {n} micro-batches: the orders deadlock")
    return max(clock) - n * (2 * f + 2 * (i + w))


def v_moments(
    p: ParallelConfig, r: RankBytes, stage: int, accumulated: float, working: float, fresh: float
) -> tuple[float, float, float]:
    """tuner.cost.memory.forward_backward's peak for a rank of a V schedule, walked through its
    order (v_order): a micro-batch's activations of a local stage stay from its forward to the end
    of its backward, split or not (torch's input half keeps the graph for the weight half, and the
    gradients at the weight-taking ops' outputs: `weight_outputs`); the first stage's input half
    does nothing and its weight half the whole backward (its input needs no gradient), its
    received gradient kept meanwhile. Local stage 1 of rank 0 is the last stage (the head and its
    loss), local stage 0 the first (the embedding). The sends: a stage's output kept to its
    backward, an input gradient's let go at once (trainer/pipeline.py Sends lets it go when the
    receiver provably has it)."""
    first_rank = stage == 0
    root_params = r.root / r.cb
    root_grads = r.accumulated_bytes * root_params
    layer_grads = accumulated - root_grads - r.vocab_grad
    acts = [r.layers * f + (r.head if first_rank and j == 1 else 0.0) for j, f in enumerate(r.chunks)]
    kept = [
        r.weight_outputs * f + (r.head_weight_outputs if first_rank and j == 1 else 0.0)
        for j, f in enumerate(r.chunks)
    ]
    grads_of = [layer_grads * f + ((root_grads + r.vocab_grad) / 2 if first_rank else 0.0) for f in r.chunks]
    zero3 = p.zero_stage == 3
    if (
        zero3
    ):  # torch's split backward keeps FSDP2 from resharding after a backward (set_reshard_after_backward):
        working = r.whole  # a layer run backward stays gathered to the step's end (its REDUCE_GRAD)
    held, grads, started = 0.0, 0.0, set()
    best, best_sum = (working, 0.0, 0.0), -math.inf

    def backward_moment(extra: float) -> None:
        nonlocal best, best_sum
        b, c = grads + fresh, held + r.flow + extra
        if working + b + c > best_sum:
            best, best_sum = (working, b, c), working + b + c

    for kind, j, _ in v_order(p.pp_schedule, p.pp, p.num_microbatches, stage):
        first_stage = first_rank and j == 0
        # the last stage's backward: the logits its schedule holds, and the head's weight gradient
        # (its weight half's, in the compute dtype, until FSDP2's next post-backward folds it in)
        logits = r.output_held + r.head_grad if first_rank and j == 1 else 0.0
        if kind == "F":
            held += acts[j] + r.boundary
            if first_rank and j == 1:  # the loss, at the end of the last stage's forward
                a, b, c = r.root if zero3 else r.whole, grads, held + r.loss
                if a + b + c > best_sum:
                    best, best_sum = (a, b, c), a + b + c
            continue
        if kind == "I":
            if first_stage:  # nothing yet; its received gradient waits for the weight half
                held += r.boundary
                continue
            backward_moment(r.boundary + logits)
            # its output's send let go, its input's gradient kept (torch sets the input's .grad)
            held += kept[j]
            continue
        if kind == "B" or first_stage:
            # the first stage's backward ends in the embedding's, its gradient in the compute dtype
            # beside the accumulated one
            backward_moment(r.boundary + logits + (r.embed_grad if first_stage else 0.0))
            # its activations and output go; the first stage's weight half (its whole backward)
            # lets go the gradient it received at its input half too
            held -= acts[j] + (r.boundary if kind == "B" else 2 * r.boundary if first_stage else 0.0)
        else:  # a weight half: the kept gradients, the activations and the input's gradient go
            backward_moment(0.0)
            held -= acts[j] + kept[j] + r.boundary
        if j not in started:  # its gradients, whole until the step's last backward
            started.add(j)
            grads += grads_of[j]
    return best
