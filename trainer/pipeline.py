"""Pipeline parallelism: split a GPT into stages and drive them with a torch.distributed.pipelining
schedule (GPipe, 1F1B, interleaved 1F1B)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule

from trainer.model import GPT


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
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=num_microbatches, loss_fn=loss_fn)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    (stage,) = stages
    return cls(stage, n_microbatches=num_microbatches, loss_fn=loss_fn)
