"""Activation offloading to host memory (activation_checkpoint: offload).

Each transformer block's forward runs under saved-tensor hooks: every tensor autograd saves for the
backward is copied to host memory when saved and copied back when the backward reaches it, so a
block's activations leave the device between its forward and its backward (as
torch.autograd.graph.save_on_cpu, and Megatron-LM's --cpu-offloading, do). Not copied (`is_weight`):
parameters and what autograd puts between one and the saved tensor (FSDP2's gathered weights,
which it frees and gathers again on its own; autocast's cached casts; views, an expert's slice),
and tensors every layer shares (context parallelism's cached masks): copying those frees nothing.
Everything else goes, indices and the rotary table's per-block casts included.

On a GPU the copies go through pinned host memory, non-blocking on the compute stream: ordered
with the kernels around them, so their time is exposed (tuner/cost prices it on the device's host
link; nothing overlaps it, unlike Megatron's offload stream). On a CPU rank host memory is the
device: the copies are made (the round trip is exercised by the parity tests) and save nothing.
The memory oracle (trainer/memcheck.py) swaps `to_host` / `to_device` for fakes that keep no data,
so that it counts what a GPU would hold.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def to_host(t: torch.Tensor) -> Any:
    """A host copy of `t` (pinned when `t` is on a GPU)."""
    if t.device.type == "cpu":
        return t.detach().clone()
    host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
    return host.copy_(t.detach(), non_blocking=True)


def to_device(packed: Any, device: torch.device) -> torch.Tensor:
    """`packed` (to_host's) back on `device`."""
    return packed.to(device, non_blocking=True)


def offload_activations(block: nn.Module) -> None:
    """Make `block`'s saved activations wait in host memory for its backward: its forward runs
    under saved-tensor hooks, entered by a forward pre-hook and left by a forward hook (no wrapper
    module: parameter names, FSDP2's and tensor parallelism's plans are unchanged)."""
    active: list[Any] = []

    def enter(module: nn.Module, args: Any) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        active.append(hooks)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        active.pop().__exit__(None, None, None)

    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave)


# What autograd puts between a parameter and the tensor an op saves of it: autocast's cast, the
# transpose a linear multiplies by, views, a DTensor's local tensor, the experts' gradient scaling
# (trainer/moe.py)
_WEIGHT_PATH = {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "ViewBackward0", "UnsafeViewBackward0",
                "PermuteBackward0", "ExpandBackward0", "SelectBackward0", "SliceBackward0", "AliasBackward0",
                "_ToTorchTensorBackward", "GradScaleBackward"}  # fmt: skip


def is_weight(t: torch.Tensor) -> bool:
    """Whether a saved tensor is a parameter, or a cast or view of one (autocast's cached copies,
    FSDP2's gathered weights, an expert's slice), or a tensor every layer shares (context
    parallelism's cached masks: `shared_by_layers`)."""
    if _is_param(t) or (t._base is not None and _is_param(t._base)) or getattr(t, "shared_by_layers", False):
        return True
    node = t.grad_fn
    for _ in range(4):
        if node is None or type(node).__name__ not in _WEIGHT_PATH:
            break
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            break
        node = nexts[0]
    return type(node).__name__ == "AccumulateGrad" and _is_param(node.variable)


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or getattr(t, "_is_param", False)


def pack(t: torch.Tensor) -> Any:
    """A saved tensor to host memory, unless it is a weight (`is_weight`)."""
    if is_weight(t):
        return ("device", t)
    if isinstance(t, DTensor):
        return ("dtensor", to_host(t.to_local()), t.device_mesh, t.placements, t.shape, t.stride(), t.device)
    return ("host", to_host(t), t.device)


def unpack(packed: Any) -> torch.Tensor:
    kind = packed[0]
    if kind == "device":
        return packed[1]
    if kind == "dtensor":
        _, local, mesh, placements, shape, stride, device = packed
        return DTensor.from_local(to_device(local, device), mesh, placements, run_check=False, shape=shape,
                                  stride=stride)  # fmt: skip
    return to_device(packed[1], packed[2])
