"""Metrics defined once: device peak FLOP/s (from trainer/contract/devices.py), peak memory, gradient norm."""

from __future__ import annotations

import platform
import weakref
from collections import defaultdict
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer.contract.devices import peak_tflops


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_tflops_of(device: torch.device, dtype: torch.dtype) -> float:
    """The device's dense peak in `dtype` from the one device table (trainer/contract/devices.py), the
    figure the performance model prices against: a data sheet's on GPUs (0.0 for a GPU not in the
    table: MFU 0), the nominal CPU figure on CPU ranks."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return peak_tflops(name, "fp32" if dtype == torch.float32 else "bf16")


class LiveBytesTracker(TorchDispatchMode):
    """Peak bytes of live tensor storages on CPU, where no allocator statistics exist and process
    RSS is mostly torch itself. Every op's outputs are registered by storage; a storage counts
    until it is freed, at its current size. Deterministic for a deterministic step.

    The live total is kept incrementally (the memory oracle steps models of thousands of
    storages): a storage's size is re-read when an op that may mutate it runs and when its
    `resize_` is called (FSDP2 frees all-gather buffers by resizing storages to 0); the peak is
    taken after each op. `_recount()` is the same total summed from scratch.

    A wrapper tensor subclass (DTensor; the AsyncCollectiveTensor a functional collective returns
    in a real world) counts by the tensors it wraps: its own storage holds no data."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, tuple[weakref.ref, int]] = {}  # key -> (storage, bytes as last read)
        self._live = 0
        self.peak_bytes = 0

    def track(self, t: torch.Tensor) -> None:
        for st in _storages(t):
            self._read(st)

    def _read(self, st: torch.UntypedStorage) -> None:
        key = id(st)  # torch keeps one Python object per live storage
        entry = self._storages.get(key)
        nbytes = st.nbytes()
        if entry is None:
            self._storages[key] = (weakref.ref(st, lambda _, k=key: self._forget(k)), nbytes)
            self._live += nbytes
        elif entry[1] != nbytes:
            self._storages[key] = (entry[0], nbytes)
            self._live += nbytes - entry[1]

    def _forget(self, key: int) -> None:
        entry = self._storages.pop(key, None)
        if entry is not None:
            self._live -= entry[1]

    def track_all(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.track(t)
        self._update()

    def live_bytes(self) -> int:
        return self._live

    def _recount(self) -> int:
        return sum(st.nbytes() for ref, _ in list(self._storages.values()) if (st := ref()) is not None)

    def _update(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self._live)

    def __enter__(self):
        tracker, original = self, torch.UntypedStorage.resize_

        def resize_(storage, *args, **kwargs):
            out = original(storage, *args, **kwargs)
            if id(storage) in tracker._storages:
                tracker._read(storage)
            return out

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        if func._schema.is_mutable:  # an op may resize what it mutates (resize_, set_, out=)
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    for st in _storages(t):
                        if id(st) in self._storages:
                            self._read(st)
        self._update()
        return out


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding a tensor's data: a wrapper subclass's inner tensors' (recursively)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
        return [st for x in inner if isinstance(x, torch.Tensor) for st in _storages(x)]
    return [] if t.device.type == "meta" else [t.untyped_storage()]


def grad_norm_(
    params: list[torch.nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None,
    duplicates: Collection[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Global L2 norm of the gradients over every parallel axis, then clip to max_norm (0: don't).

    DTensor gradients are grouped by (mesh, placements), so each group's norm is reduced over
    exactly the axes it is sharded on; pipeline stages hold disjoint parameters, so their squared
    norms add up over the pp group (torchtitan's clip_grad_norm_). `duplicates` are parameters
    whose gradient is a copy of one counted elsewhere (the last stage's copy of a tied embedding,
    trainer/pipeline.py): clipped, not counted."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    skip = {id(p) for p in duplicates}
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
            groups[(key, id(p) in skip)].append(g)
    squares = []
    for (_, duplicate), grads in groups.items():
        if duplicate:
            continue
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total_sq = torch.stack(squares).sum()
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups.values():
            local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
            torch._foreach_mul_(local, coef.to(local[0].dtype))
    return total
