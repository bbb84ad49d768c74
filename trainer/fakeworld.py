"""Making a world of fake tensors and a fake process group behave like a real one, for the memory
oracle (trainer/memcheck.py).

Each difference was found by diffing per-op live-byte timelines of fake and real CPU runs of the
same layout; tests/trainer/test_memcheck.py holds the oracle to the real runs' peaks:
- pipeline stages exchange shape metadata in their first step; a fake peer sends garbage, so the
  answer comes from the stage boundary (b, s or s/tp with SP, h), checked against every shape
  this rank sends itself;
- a fake Work holds no tensor; gloo's and NCCL's hold the tensors of a send or receive until the
  Work object dies, which keeps a sent activation alive into the next micro-batch;
- FakeTensor is not a foreach type, so grad-norm would take another (per-tensor) path;
- deepcopy of a FakeTensor makes a new fake mode (pipeline stages are deep copies);
- a functional collective's wait returns the tensor it waited on (in a real world the result is
  an AsyncCollectiveTensor around that same tensor); the fake kernel allocates a new one;
- DeviceMesh computes its rank tables with tensors, which must be real.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed import _functional_collectives as funcol
from torch.distributed import _mesh_layout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as pp_schedules
from torch.distributed.pipelining._utils import (
    _derive_grad_metas,
    _StageBackwardMeta,
    _StageForwardMeta,
    _TensorMeta,
)
from torch.utils import _foreach_utils

from trainer.contract.result import BenchmarkConfig


class FakeWorldError(RuntimeError):
    """A pipeline stage sends what the oracle did not assume (its answers would be wrong)."""


@contextlib.contextmanager
def as_in_a_real_world(cfg: BenchmarkConfig) -> Iterator[None]:
    """Inside a FakeTensorMode and a fake process group: every fix of the module docstring."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_pipeline_peers(stage_boundary(cfg)))
        stack.enter_context(mock.patch.object(pp_schedules, "_batch_p2p", _p2p_holding_tensors))
        stack.enter_context(mock.patch.object(FakeTensor, "__deepcopy__", _fake_deepcopy, create=True))
        stack.enter_context(mock.patch.object(funcol, "wait_tensor", _wait_in_place))
        stack.enter_context(_fake_is_foreach_type())
        stack.enter_context(_real_device_mesh())
        yield


def stage_boundary(cfg: BenchmarkConfig) -> _TensorMeta:
    """What one pipeline stage sends the next per micro-batch: the residual stream, (b, s, h), or
    (b, s/tp, h) with sequence parallelism, (b, s, h/tp_col) with 2D tensor parallelism (its
    column-split stream), s being a context-parallel rank's seq_len / cp tokens; in the
    parameters' dtype under FSDP2/replicate's mixed precision (over dp x cp), fp32 otherwise
    (autocast leaves the residual adds in fp32)."""
    p, m = cfg.parallel, cfg.model
    seq = m.seq_len // p.cp // (p.tp if p.sequence_parallel else 1)
    hidden = m.hidden_size // p.tp_col
    low = cfg.dtype == "bf16" and p.dp * p.cp > 1
    return _TensorMeta(
        shape=torch.Size((p.micro_batch_size, seq, hidden)),
        stride=(seq * hidden, hidden, 1),
        dtype=torch.bfloat16 if low else torch.float32,
        requires_grad=True,
    )


class _DynamicVote:
    """The pipeline's warm-up vote as a real world decides it: no stage was given static shapes,
    so every stage infers them (0 = DYNAMIC); a fake tensor has no value to read. It carries the
    vote's tensor, which a V schedule's stage hands to the other stage on its rank to send on."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def item(self) -> int:
        return 0


@contextlib.contextmanager
def _pipeline_peers(boundary: _TensorMeta) -> Iterator[None]:
    original_result = PipelineStage._warmup_backward_result
    grads = _derive_grad_metas((boundary,))

    def vote_result(stage, received_result=None):
        if isinstance(received_result, _DynamicVote):  # from this rank's other stage (a V)
            received_result = received_result.tensor
        # its sends and receives, as in a real world
        return _DynamicVote(original_result(stage, received_result))

    def recv_meta(stage, src_stage: int):
        if src_stage < stage.stage_index:
            return _StageForwardMeta(forward_metas=(boundary,))
        return _StageBackwardMeta(backward_metas=grads)

    def send_meta(stage, meta, dst_stage: int) -> None:
        forward = dst_stage > stage.stage_index
        sent, expected = (meta.forward_metas, (boundary,)) if forward else (meta.backward_metas, grads)
        if sent != expected:
            raise FakeWorldError(f"stage {stage.stage_index} sends {sent}, the oracle assumed {expected}")

    with (
        mock.patch.object(PipelineStage, "_warmup_backward_result", vote_result),
        mock.patch.object(PipelineStage, "_recv_meta", recv_meta),
        mock.patch.object(PipelineStage, "_send_meta", send_meta),
    ):
        yield


class _HeldWork:
    """A Work that keeps its tensors alive as long as itself, as gloo's and NCCL's do."""

    def __init__(self, work: dist.Work, tensors: list[torch.Tensor]) -> None:
        self._work, self._tensors = work, tensors

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


_original_batch_p2p = pp_schedules._batch_p2p


def _p2p_holding_tensors(p2p_ops: list[dist.P2POp], desc: str | None = None) -> list[Any]:
    works = _original_batch_p2p(p2p_ops, desc)
    if len(works) == len(p2p_ops):
        return [_HeldWork(w, [op.tensor]) for w, op in zip(works, p2p_ops, strict=True)]
    # coalesced into fewer works: the first holds every tensor (gloo would give one work per op)
    return [_HeldWork(works[0], [op.tensor for op in p2p_ops]), *works[1:]] if works else works


def _wait_in_place(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _fake_deepcopy(self: FakeTensor, memo: dict[int, Any]) -> torch.Tensor:
    """deepcopy within the current fake mode (torch's makes a new one, which cannot mix)."""
    if id(self) not in memo:
        data = self.detach().clone()
        memo[id(self)] = (
            torch.nn.Parameter(data, self.requires_grad)
            if isinstance(self, torch.nn.Parameter)
            else data.requires_grad_(self.requires_grad)
        )
    return memo[id(self)]


@contextlib.contextmanager
def _fake_is_foreach_type() -> Iterator[None]:
    """A plain FakeTensor takes the same foreach paths (grad-norm) as a plain CPU tensor."""
    _foreach_utils._foreach_supported_types.append(FakeTensor)
    try:
        yield
    finally:
        _foreach_utils._foreach_supported_types.remove(FakeTensor)


def _real(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return inner


_MESH_SKIP = ("__new__", "__getattr__", "__getattribute__", "__init_subclass__", "__class__")


@contextlib.contextmanager
def _real_device_mesh() -> Iterator[None]:
    """DeviceMesh's rank tables are real data: its methods run outside the fake mode (FSDP2
    builds a combined dp x tp mesh, and pipeline/TP plans slice meshes, all under the mode)."""
    with contextlib.ExitStack() as stack:
        for cls in (DeviceMesh, _mesh_layout._MeshLayout):
            for name, attr in list(vars(cls).items()):
                if name in _MESH_SKIP:
                    continue
                if isinstance(attr, property):
                    new: Any = property(_real(attr.fget), attr.fset and _real(attr.fset))
                elif isinstance(attr, staticmethod | classmethod):
                    new = type(attr)(_real(attr.__func__))
                elif callable(attr) and hasattr(attr, "__code__"):
                    new = _real(attr)
                else:
                    continue
                stack.enter_context(mock.patch.object(cls, name, new))
        yield
