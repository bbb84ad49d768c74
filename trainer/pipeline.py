"""Pipeline parallelism: split a GPT into stages and drive them with a torch.distributed.pipelining
schedule (GPipe, 1F1B, interleaved 1F1B).

Every stage is the same GPT class with parts removed, so each keeps its own copy of the rotary
table (a buffer, not a parameter). A head tied to the token embedding (small Llamas) becomes two
copies of the one weight, on the first and the last stage: TiedEmbeddings keeps them equal.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor

from trainer.model import GPT
from trainer.moe import moe_layers


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges, as even as possible; earlier stages take the remainder because
    the last stage also carries the head (a V x h matmul per token)."""
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        ranges.append(range(start, start + n))
        start += n
    return ranges


def local_stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Looped placement (Narayanan et al. 2021): rank r holds stages r, r + pp, r + 2pp, ..."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


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
        PipelineStage(module, stage_id, num_stages, device, group=pp_mesh.get_group())
        for stage_id, module in stage_modules
    ]
    for stage in stages:
        if moe_layers([stage.submod]):
            _clean_all_after_inference(stage)
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=num_microbatches, loss_fn=loss_fn)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    (stage,) = stages
    return cls(stage, n_microbatches=num_microbatches, loss_fn=loss_fn)


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
