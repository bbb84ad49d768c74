"""Pipeline parallelism: split a GPT into stages and drive them with a torch.distributed.pipelining
schedule (GPipe, 1F1B, interleaved 1F1B, and the V-shaped zero-bubble ZBV and DualPipeV), holding
its buffers and sends no longer than Megatron-LM holds them (OnDemandStage, ReleasingSends).

Every stage is the same GPT class with parts removed, so each keeps its own copy of the rotary
table (a buffer, not a parameter). A head tied to the token embedding (small Llamas) becomes two
copies of the one weight, on the first and the last stage: TiedEmbeddings keeps them equal.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining import schedules as schedules_module
from torch.distributed.pipelining import stage as stage_module
from torch.distributed.pipelining._utils import _make_tensor_from_meta
from torch.distributed.pipelining.schedules import _ComputationType as ComputationType
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor

from trainer.contract.parallel import stage_layer_ranges
from trainer.model import GPT
from trainer.moe import moe_layers


def split_model(model: GPT, stage_id: int, num_stages: int) -> GPT:
    """A copy of `model` holding only the parts of stage `stage_id`."""
    keep = stage_layer_ranges(model.cfg.num_layers, num_stages)[stage_id]
    stage = copy.deepcopy(model)
    for name in list(stage.layers.keys()):
        if int(name) not in keep:
            del stage.layers[name]
    if stage_id != 0:
        stage.embed = None
    if stage_id != num_stages - 1:
        stage.norm = None
        stage.head = None
    return stage


class TiedEmbeddings:
    """The tied token-embedding / head weight across pipeline stages, as Megatron-LM keeps it (its
    "embedding group": the ranks of the first and the last stage). The first stage holds the
    embedding and the last the head, each a copy of the one weight with the same sharding (tensor
    and data parallelism cut both the same way); one process would add both uses' gradients into
    the one weight, so after backward the two copies' gradients are all-reduced (summed) between
    the two ranks, before clipping and the optimizer: both copies get the same update and stay
    equal. The gradient norm counts the weight once: the last stage's copy is a duplicate.

    Built after parallelisation, on the parameters the optimizer steps (FSDP2's sharded ones)."""

    def __init__(self, stage_modules: list[tuple[int, GPT]], num_stages: int, pp_group: dist.ProcessGroup):
        self.copies: list[nn.Parameter] = []
        for stage_id, module in stage_modules:
            if stage_id == 0:
                self.copies.append(module.embed.tok.weight)
            if stage_id == num_stages - 1:
                self.copies.append(module.head.weight)
        # The last stage's copy: clipped with the others, but not counted in the norm.
        self.duplicates = [m.head.weight for s, m in stage_modules if s == num_stages - 1]
        self.group = embedding_group(pp_group, num_stages) if len(self.copies) == 1 else None

    def _locals(self, grads: bool) -> list[torch.Tensor]:
        tensors = [p.grad if grads else p for p in self.copies]
        return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]

    @torch.no_grad()
    def _sum(self, tensors: list[torch.Tensor]) -> None:
        """Both copies become their sum: across the two ranks, or on the one rank holding both."""
        if not tensors:
            return
        if len(tensors) == 2:
            tensors[0].add_(tensors[1])
            tensors[1].copy_(tensors[0])
        else:
            dist.all_reduce(tensors[0], group=self.group)

    def sync_weights(self) -> None:
        """Start both copies from the first stage's values: the last stage's copy is zeroed and the
        two summed (Megatron's initial all-reduce). Needed after "fast" init, where each stage
        draws its own values; after "exact" init both copies are already equal."""
        weights = self._locals(grads=False)
        with torch.no_grad():
            for p, local in zip(self.copies, weights, strict=True):
                if any(p is d for d in self.duplicates):
                    local.zero_()
        self._sum(weights)

    def sum_gradients(self) -> None:
        """After backward (data-parallel reductions included), before clipping."""
        for p in self.copies:
            # Under TP the embedding's gradient comes out Replicate (every rank holds all V rows)
            # while the head's is Shard(0) like both weights: cut it to the weight's rows first (a
            # local slice, no communication), so that both ranks sum the same rows.
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        self._sum(self._locals(grads=True))


def embedding_group(pp_group: dist.ProcessGroup, num_stages: int) -> dist.ProcessGroup:
    """The two ranks of this rank's pipeline that hold the first and the last stage (pp ranks 0
    and pp - 1 under looped placement), at the same coordinates on every other axis. Only the
    group's own ranks create it (use_local_synchronization). With pp 2 it is the pipeline's own
    group: a second group of the same ranks would get the same name (DeviceMesh names its groups
    by a hash of their ranks, as new_group does here) and share its connections."""
    pipeline = dist.get_process_group_ranks(pp_group)  # global ranks, by pp coordinate
    first, last = pipeline[0], pipeline[(num_stages - 1) % len(pipeline)]
    if len(pipeline) == 2:
        return pp_group
    return dist.new_group([first, last], use_local_synchronization=True)


def build_schedule(
    stage_modules: list[tuple[int, GPT]],
    num_stages: int,
    pp_mesh: DeviceMesh,
    device: torch.device,
    schedule: str,
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> _PipelineSchedule:
    stages = [
        OnDemandStage(module, stage_id, num_stages, device, group=pp_mesh.get_group())
        for stage_id, module in stage_modules
    ]
    for stage in stages:
        if moe_layers([stage.submod]):
            _clean_all_after_inference(stage)
    if schedule in MULTI_STAGE:
        runner: _PipelineSchedule = MULTI_STAGE[schedule](
            stages, n_microbatches=num_microbatches, loss_fn=loss_fn
        )
    else:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        (stage,) = stages
        runner = cls(stage, n_microbatches=num_microbatches, loss_fn=loss_fn)
    for stage in stages:
        stage.schedule = weakref.ref(runner)
    return runner


class OnDemandStage(PipelineStage):
    """torch's PipelineStage with its receive buffers allocated when their receive is posted and
    dropped after the micro-batch's backward, as Megatron-LM's p2p_communication allocates them.

    torch allocates a stage's buffers once for every micro-batch: an input buffer for each
    micro-batch it receives and a gradient buffer for each it sends, kept for the whole run:
    2 n boundary tensors on a middle stage (n micro-batches), each also a local stage's share
    when interleaved: 47 GiB on Qwen3-30B-A3B's published 16-GPU layout (PP 2 x VP 24, 32
    micro-batches of 2 x 4096 tokens). Here a received input lives from its receive to its
    micro-batch's backward (autograd keeps it as long anyway) and a received gradient from its
    receive to the end of that backward.

    The last stage's loss of each micro-batch stays in its schedule (`_internal_losses`) until the
    step ends; after the backward its graph holds only the stage's input, the leaf its
    AccumulateGrad node refers to, with that input's gradient: a detached loss lets both go. And
    torch keeps the last stage's output, the logits (V / tp values a token), in its forward cache
    until the micro-batch's backward, which starts from the loss and never reads them: dropped
    once the loss is computed. (At tp 1 the chunked loss keeps the logits to its backward anyway,
    trainer/model.py ChunkedCrossEntropy; vocab-sharded logits' loss keeps its fp32 log-softmax,
    not them, and there the drop frees them.)"""

    schedule: weakref.ref[_PipelineSchedule] | None = None

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        with _no_buffers():  # torch's loop over the micro-batches, metadata only
            super()._setup_forward_recv_info(num_microbatches, has_backward)

    def _create_grad_recv_info(self, act_send_info: dict):  # type: ignore[override]
        with _no_buffers():
            return super()._create_grad_recv_info(act_send_info)

    def _get_recv_ops(self, recv_infos):  # type: ignore[override]
        for info in recv_infos:
            if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)
        return super()._get_recv_ops(recv_infos)

    def get_fwd_send_ops(self, fwd_chunk_id: int):  # type: ignore[override]
        return self._posting("F", fwd_chunk_id, super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int):  # type: ignore[override]
        return self._posting("B", bwd_chunk_id, super().get_bwd_send_ops(bwd_chunk_id))

    def _posting(self, kind: str, mb: int, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        """Tell an interleaved schedule's Sends which send the next batch of isends is."""
        if (sends := self._sends()) is not None and ops:
            sends.pending = (kind, self.stage_index, mb)
        return ops

    def _runner(self) -> _PipelineSchedule | None:
        return self.schedule() if self.schedule is not None else None

    def _sends(self) -> Sends | None:
        """A multi-stage schedule's sends (ReleasingSends), or None under any other schedule."""
        runner = self._runner()
        return runner.sends if isinstance(runner, ReleasingSends) else None

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):  # type: ignore[override]
        """A split backward (ZBV, DualPipeV) finds each weight's gradient by the weight's place in
        the graph; torch hands it the module's registered parameters, which under FSDP2 and its
        replicate (the experts over edp) are the sharded DTensors, not the unsharded tensors the
        forward used: the weights' gradients were lost (FSDP2) or the walk failed (a KeyError on
        replicate's experts). Handed the tensors the graph holds instead; the weight half sets
        their .grad, which FSDP2's post-backward (torch's REDUCE_GRAD step) reduces."""
        if backward_type not in ("input", "weight"):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if not isinstance(self.submod, FSDPModule):  # FSDP2 / replicate inside (the experts over edp):
            for m in self._inner_fsdp():  # as torch's stage does it for an FSDP2 root
                m.set_is_last_backward(False)
                m.set_reshard_after_backward(False)
                m.set_requires_gradient_sync(False)
            self._split_inner = True
        names = ("stage_backward_input", "stage_backward_weight")
        originals = {n: stage_module.__dict__[n] for n in names}
        submod = self.submod
        stage_module.__dict__["stage_backward_input"] = lambda out, grads, inputs, _weights: originals[
            "stage_backward_input"
        ](out, grads, inputs, graph_params(submod))
        stage_module.__dict__["stage_backward_weight"] = lambda _weights, groups, *a: originals[
            "stage_backward_weight"
        ](graph_params(submod), groups, *a)
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        finally:
            stage_module.__dict__.update(originals)

    _split_inner = False  # a split backward left inner FSDP2 modules' gradients to reduce

    def _inner_fsdp(self) -> list[FSDPModule]:
        """The outermost FSDP2 / replicate modules under a root that is neither."""
        found: list[FSDPModule] = []
        for m in self.submod.modules():
            if isinstance(m, FSDPModule) and not any(m in f.modules() for f in found):
                found.append(m)
        return found

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:  # type: ignore[override]
        """torch's post-backward for an FSDP2 root, done for the inner ones a split backward kept
        from syncing (the experts' replicate under a stage without FSDP2), before its scaling."""
        if self._split_inner:
            self._split_inner = False
            for m in self._inner_fsdp():
                m.set_is_last_backward(True)
                m.set_reshard_after_backward(True)
                m.set_requires_gradient_sync(True)
                state = m._get_fsdp_state()
                for inner in state._state_ctx.all_states:
                    for group in inner._fsdp_param_groups:
                        group.post_backward()
                state._root_post_backward_final_callback()
        super().perform_reduce_grad(grad_scale_factor)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):  # type: ignore[override]
        if (sends := self._sends()) is not None and not self.is_first:  # its input has arrived
            sends.received_forward(self.stage_index, fwd_chunk_id)
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if self.is_last:  # its backward starts from the loss: the logits need not wait for it
            self.fwd_cache[fwd_chunk_id] = ((), self.fwd_cache[fwd_chunk_id][1])
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):  # type: ignore[override]
        if (sends := self._sends()) is not None and not self.is_last:  # its gradient has arrived
            sends.received_backward(self.stage_index, bwd_chunk_id)
        result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        for infos in (self.args_recv_info.get(bwd_chunk_id, ()), self.grad_recv_info.get(bwd_chunk_id, ())):
            for info in infos:
                if not info.is_root_arg and info.tensor_meta is not None:
                    info.buffer = None
        losses = getattr(self._runner(), "_internal_losses", None)
        if self.is_last and losses is not None and bwd_chunk_id < len(losses):
            losses[bwd_chunk_id] = losses[bwd_chunk_id].detach()
        return result


class ReleasingSends:
    """A multi-stage schedule (torch's _PipelineScheduleRuntime) with each send let go once its
    receiver has it, not at the step's end. torch's runtime keeps every send's Work, and with it
    the tensor sent, until the step ends (`send_ops`): every local stage's output and input
    gradient of every micro-batch, 2 n v boundary tensors a rank (another 48 GiB on
    Qwen3-30B-A3B's published layout; see OnDemandStage). Waiting on a send early could deadlock
    (both neighbours sending before either receives); waiting on one the receiver has provably
    received cannot. `Sends` says when, from what this rank has itself received. Mixed into
    torch's interleaved 1F1B, ZBV and DualPipeV schedules below."""

    sends: Sends

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        mapping = getattr(self, "stage_index_to_group_rank", None) or {
            i: i % self.pp_group_size for i in range(self._num_stages)
        }
        self.sends = Sends(self.pipeline_order, self.rank, mapping)

    def _step_microbatches(self, *args, **kwargs):  # type: ignore[override]
        original = schedules_module._batch_p2p

        def batch_p2p(ops: list[dist.P2POp], desc: str | None = None) -> list:
            works = original(ops, desc)
            if ops and all(op.op is dist.isend for op in ops):
                return self.sends.hold(works)
            return works

        schedules_module.__dict__["_batch_p2p"] = batch_p2p
        try:
            return super()._step_microbatches(*args, **kwargs)  # type: ignore[misc]
        finally:
            schedules_module.__dict__["_batch_p2p"] = original
            self.sends.clear()


class Interleaved1F1B(ReleasingSends, ScheduleInterleaved1F1B):
    """torch's interleaved 1F1B (looped placement), its sends released early."""


class ZBV(ReleasingSends, ScheduleZBVZeroBubble):
    """torch's ZBV zero-bubble schedule (Qi et al. 2024, "Zero Bubble Pipeline Parallelism": two
    stages a rank in a V, each backward split into its input half, sent on at once, and its weight
    half, run where a bubble would be), its sends released early."""


class DualPipeV(ReleasingSends, ScheduleDualPipeV):
    """torch's DualPipeV (DeepSeek-V3's DualPipe on half the ranks, in a V), its sends released
    early. Its paired forward-and-backward steps (OVERLAP_F_B) run one after the other here:
    torch overlaps them only through a function the user registers, and the trainer registers
    none (the overlap of one micro-batch's all-to-all with another's compute is not built)."""


MULTI_STAGE: dict[str, type[_PipelineSchedule]] = {
    "interleaved_1f1b": Interleaved1F1B, "zbv": ZBV, "dualpipev": DualPipeV,
}  # fmt: skip


class SentWork:
    """A send's Work, waited on and dropped (with its tensor) when released; torch's runtime
    waits on this proxy at the step's end as on the Work itself."""

    __slots__ = ("work",)

    def __init__(self, work: dist.Work) -> None:
        self.work: dist.Work | None = work

    def wait(self, *args, **kwargs) -> bool:
        if self.work is not None:
            self.work.wait(*args, **kwargs)
            self.work = None
        return True


class Sends:
    """The sends of one multi-stage pipeline rank, each released as soon as this rank has
    received something its receiver sent after receiving it (causality, no clock):
    - a local stage s's output for micro-batch k (to stage s + 1): once s's gradient for k arrives
      (stage s + 1 ran k's forward, so it had received k's input, before its backward sent it);
    - s's input gradient for k (to stage s - 1, on rank R): once an input arrives from R that R
      sent after its backward of (s - 1, k), in R's order (`pipeline_order`: every rank computes
      every rank's; a split backward's input half is the one that sends).
    `stage_rank` maps a stage to its rank (looped: s mod pp; a V: torch's mapping)."""

    def __init__(self, pipeline_order: dict, rank: int, stage_rank: dict[int, int]) -> None:
        self.stage_rank = stage_rank
        # where each forward and backward falls in each rank's order (paired steps flattened)
        self.position: dict[tuple[str, int, int], int] = {}
        kinds = {ComputationType.FORWARD: "F", ComputationType.FULL_BACKWARD: "B",
                 ComputationType.BACKWARD_INPUT: "B"}  # fmt: skip
        for r, order in pipeline_order.items():
            if r == rank:
                continue
            i = 0
            for a in order:
                for sub in (a.sub_actions or (a,)) if a is not None else ():
                    if sub.computation_type in kinds:
                        self.position[
                            (kinds[sub.computation_type], sub.stage_index, sub.microbatch_index)
                        ] = i
                    i += 1
        self.pending: tuple[str, int, int] | None = None  # the send being posted (stage reports it)
        self.outputs: dict[tuple[int, int], list[SentWork]] = {}  # (stage, micro-batch): its output
        # input gradients: (the receiving rank, its position of the backward they wait for, the send)
        self.gradients: list[tuple[int, int, list[SentWork]]] = []

    def hold(self, works: list[dist.Work]) -> list[SentWork]:
        held = [SentWork(w) for w in works]
        kind, stage, mb = self.pending if self.pending is not None else ("?", -1, -1)
        self.pending = None
        if kind == "F":
            self.outputs[(stage, mb)] = held
        elif kind == "B":
            receiver = self.stage_rank[stage - 1]
            self.gradients.append((receiver, self.position.get(("B", stage - 1, mb), -1), held))
        return held

    def received_backward(self, stage: int, mb: int) -> None:
        for sent in self.outputs.pop((stage, mb), ()):
            sent.wait()

    def received_forward(self, stage: int, mb: int) -> None:
        sender = self.stage_rank[stage - 1]
        reached = self.position.get(("F", stage - 1, mb))
        if reached is None:
            return
        keep = []
        for receiver, after, held in self.gradients:
            if receiver == sender and 0 <= after < reached:
                for sent in held:
                    sent.wait()
            else:
                keep.append((receiver, after, held))
        self.gradients = keep

    def clear(self) -> None:
        self.outputs.clear()
        self.gradients.clear()
        self.pending = None


def graph_params(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters as its forward used them: an FSDP2- or replicate-managed one's
    unsharded tensor, any other itself."""
    unsharded: dict[int, torch.Tensor] = {}
    for m in module.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            for group in state._fsdp_param_groups:
                for fp in group.fsdp_params:
                    unsharded[id(fp.sharded_param)] = fp.unsharded_param
    return [unsharded.get(id(p), p) for p in module.parameters()]


@contextlib.contextmanager
def _no_buffers() -> Iterator[None]:
    """torch.distributed.pipelining.stage allocates a receive buffer by calling its module-level
    _make_tensor_from_meta: make it allocate none (the receive allocates, OnDemandStage)."""
    stage_module.__dict__["_make_tensor_from_meta"] = lambda meta, device: None
    try:
        yield
    finally:
        stage_module.__dict__["_make_tensor_from_meta"] = _make_tensor_from_meta


def _clean_all_after_inference(stage: PipelineStage) -> None:
    """The stage's first step infers its tensors' shapes by a real forward and backward on
    placeholder tensors; torch then clears the gradients of FSDP-managed parameters only. A
    mixture of experts' experts may be managed by no FSDP module (edp 1: split over ep, not
    replicated), and its layers count the tokens they route: clear those too, or the
    placeholder pass would leak into the first step's gradients and load."""
    original = getattr(stage, "_post_metadata_inference_cleanup", None)
    if original is None:  # torch before 2.13 infers shapes on meta tensors: nothing to clean
        return

    def cleanup() -> None:
        original()
        for param in stage.submod.parameters():
            param.grad = None
        for layer in moe_layers([stage.submod]):
            layer.reset_stats()

    stage._post_metadata_inference_cleanup = cleanup
