"""The memory oracle: a trial's own build of one layout, at full size, on fake tensors.

FakeTensorMode gives every tensor its shape, dtype and storage size but no data, and torch's fake
process group ("fake" backend) answers every collective of a world of any size without sending
anything. Under both, `trainer.benchmark.Trainer` builds the model, applies TP/SP, activation
checkpointing and FSDP2/replicate on the same DeviceMesh and cuts the same pipeline stages as a
real trial, and steps it with the schedule's in-flight micro-batches and the AdamW step; the
trainer's own LiveBytesTracker (`memory_tracker`) counts the live tensor bytes. torchtitan's
memory estimator takes the same approach for FSDP. Where a fake world behaves unlike a real one,
trainer/fakeworld.py makes it behave like the real one.

One rank is simulated per forked child: torch.distributed and DTensor keep per-world state
(process groups, sharding caches keyed by mesh) that must not leak from one rank into the next;
children run in parallel. By default the first and the last pipeline rank at dp and tp coordinate
0: the first stage holds the embedding and the most micro-batches in flight, the last the head and
the logits; a middle stage holds no more layers (stage_layer_ranges gives the remainder to the
first) and fewer micro-batches, and dp/tp rank 0 holds the largest shard (torch.chunk rounds up
first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import os
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from trainer import benchmark, moe, offload, parallelize
from trainer import model as model_module
from trainer.benchmark import Trainer, _dtype, memory_step, memory_tracker
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from trainer.contract.result import BenchmarkConfig, trainer_problems
from trainer.contract.topology import MESH_AXES, axis_sizes, axis_strides
from trainer.fakeworld import as_in_a_real_world
from trainer.metrics import LiveBytesTracker

# What a rank's live bytes at its peak are, in this order of precedence (a storage counts once).
# gathered_parameters: FSDP2's unsharded (all-gathered, compute-dtype) parameters; activations:
# everything else (saved activations, pipeline buffers, logits, temporaries).
CATEGORIES = ("parameters", "optimizer", "gradients", "gathered_parameters", "batch", "activations")
# Phases of Trainer.step, each with its own peak: the schedule or gradient accumulation; gradient
# norm, clipping, AdamW and zero_grad. Extrapolation extends each phase on its own.
PHASES = ("forward_backward", "optimizer")
# A GPU trial's peak covers every step; the first creates AdamW's state, later ones repeat the second.
GPU_STEPS = 2


class MemcheckError(RuntimeError):
    """The trainer could not build or step this layout on fake tensors; the message has the
    child's traceback."""


@dataclass(frozen=True)
class RankMemory:
    rank: int
    coords: dict[str, int]  # mesh coordinate per axis (trainer/contract/topology.py MESH_AXES)
    phases: dict[str, dict[str, int]]  # PHASES -> CATEGORIES -> bytes live at the phase's peak
    seconds: float  # simulation time (both simulations when extrapolated)
    steps: list[dict[str, dict[str, int]]] = field(default_factory=list)  # "cuda": phases per step

    @property
    def phase(self) -> str:
        """The phase the peak falls in."""
        return max(self.phases, key=lambda k: sum(self.phases[k].values()))

    @property
    def breakdown(self) -> dict[str, int]:
        return self.phases[self.phase]

    @property
    def peak_bytes(self) -> int:
        return sum(self.breakdown.values())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"peak_bytes": self.peak_bytes, "phase": self.phase}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankMemory:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@dataclass(frozen=True)
class MemoryReport:
    """Peak live bytes per simulated rank of one layout, as a trial on `device` would measure."""

    model: ModelConfig
    parallel: ParallelConfig
    device: str  # "cpu": a CPU trial exactly; "cuda": a GPU trial's tensors (bf16, cuda's kernels)
    dtype: str
    ranks: list[RankMemory] = field(default_factory=list)
    seconds: float = 0.0  # wall time
    microbatches_simulated: tuple[int, int] | None = None  # extrapolated from these two counts

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.worst.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(), "parallel": self.parallel.to_dict(), "device": self.device,
            "dtype": self.dtype, "peak_bytes": self.peak_bytes, "worst_rank": self.worst.rank,
            "breakdown": self.worst.breakdown, "ranks": [r.to_dict() for r in self.ranks],
            "seconds": self.seconds, "microbatches_simulated": self.microbatches_simulated,
        }  # fmt: skip


def rank_of(p: ParallelConfig, **coords: int) -> int:
    """Global rank of a mesh coordinate (trainer/contract/topology.py: pp outermost, tp innermost)."""
    strides = axis_strides(p)
    return sum(coords.get(axis, 0) * strides[axis] for axis in MESH_AXES)


def coords_of(p: ParallelConfig, rank: int) -> dict[str, int]:
    sizes = axis_sizes(p)
    return {axis: rank // stride % sizes[axis] for axis, stride in axis_strides(p).items()}


def default_ranks(p: ParallelConfig, all_stages: bool = False) -> list[int]:
    """The first and last pipeline rank (every pipeline rank with all_stages), dp and tp rank 0."""
    stages = range(p.pp) if all_stages else sorted({0, p.pp - 1})
    return [rank_of(p, pp=s) for s in stages]


@dataclass(frozen=True)
class Simulation:
    """One rank of one (simulated) configuration: what a child process runs."""

    cfg: BenchmarkConfig
    rank: int
    gpu: bool
    steps: int = GPU_STEPS  # "cuda": steps simulated (a CPU trial's are its measured window's)


def memcheck(
    cfg: BenchmarkConfig,
    *,
    ranks: Sequence[int] | None = None,
    all_stages: bool = False,
    extrapolate: bool = False,
    simulator: Simulator | None = None,
) -> MemoryReport:
    """Peak memory per rank of `cfg` as its trial would measure it, without allocating it.

    cfg.device "cpu": a CPU trial to the byte, i.e. the live-tensor peak of the trial's measured
    step window (fp32 unless cfg.dtype says otherwise). "cuda" (or "auto" on a GPU machine):
    what a GPU trial's torch.cuda.max_memory_allocated sees, less the allocator's rounding: every
    tensor allocated since the model was built counts, over the first two steps (every later step
    repeats the second); bf16 mixed precision by default. AdamW is fused (in place, no temporary)
    as the trial runs it on either device. The tensors are fake and on the CPU either way.

    extrapolate ("cuda" only): simulate the step with two micro-batch counts n1 < n2
    (extrapolation_points) and extend each phase's peak linearly to the layout's count, then take
    the largest. Past the pipeline's warm-up every extra micro-batch adds the same bytes to a
    phase (its pipeline receive buffers and batch rows), but phases grow at different rates
    (under GPipe the forward/backward also by every micro-batch's activations). A phase grows by
    the same bytes per micro-batch in every step, so n2 is simulated for one step only: its
    later steps are n1's plus the first step's growth (_extend).
    tests/trainer/test_memcheck.py checks the extension against full simulations."""
    problems = cfg.parallel.problems(cfg.model) + trainer_problems(cfg)
    if cfg.model.moe and cfg.moe_routing != "balanced":
        problems.append(
            "memcheck of a mixture of experts needs moe_routing 'balanced': learned routing's tokens per "
            "expert depend on the data, which fake tensors do not have"
        )
    if problems:
        raise ValueError("; ".join(problems))
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if extrapolate and device != "cuda":
        raise ValueError("extrapolate needs device 'cuda': a CPU trial's window counts only what it touches")
    dtype = _dtype(cfg, torch.device(device))
    # Simulated on CPU tensors, built whole from the seed ("exact"): initialisation happens before
    # the measured step and does not change it; a fake parameter cannot be moved to another device.
    sim = dataclasses.replace(
        cfg, device="cpu", dtype="bf16" if dtype == torch.bfloat16 else "fp32", init="exact", compile=False
    )
    started, gpu = time.perf_counter(), device == "cuda"
    ranks = list(ranks) if ranks is not None else default_ranks(cfg.parallel, all_stages)
    counts = extrapolation_points(cfg.parallel) if extrapolate else None
    simulator = simulator or Simulator()
    if counts is None:
        results = simulator.run([Simulation(sim, r, gpu) for r in ranks])
    else:
        n1, n2 = (_with_microbatches(sim, n) for n in counts)
        done = simulator.run([Simulation(s, r, gpu, k) for r in ranks for s, k in ((n1, GPU_STEPS), (n2, 1))])
        results = [
            _extend(a, b, counts, cfg.parallel.num_microbatches) for a, b in zip(done[::2], done[1::2])
        ]
    return MemoryReport(
        model=cfg.model, parallel=cfg.parallel, device=device, dtype=str(dtype).removeprefix("torch."),
        ranks=results, seconds=time.perf_counter() - started, microbatches_simulated=counts,
    )  # fmt: skip


def extrapolation_points(p: ParallelConfig) -> tuple[int, int] | None:
    """Two micro-batch counts from which on every phase's peak grows by the same bytes per extra
    micro-batch, or None when the layout has no more than those. Found by simulating counts up to
    3-4 x pp on 8-layer models: the step is linear from 2 micro-batches without a pipeline (the
    second is the first to accumulate gradients), from 2pp - 1 with 1F1B and GPipe (the last
    count at which the peak still moves within the steady state) and from 3pp interleaved; the V
    schedules (ZBV, DualPipeV) from 3pp too (pp 2, 12 micro-batches: extrapolated from 6 and 8
    equal to the whole simulation to the byte on both ranks, 2026-12-06)."""
    if p.pp_schedule in ("interleaved_1f1b", "zbv", "dualpipev") and p.pp > 1:
        # multiples of pp: valid rounds for the interleaved schedule; the V schedules need 2 pp
        counts = (3 * p.pp, 4 * p.pp)
    else:
        first = max(2, 2 * p.pp - 1)
        counts = (first, first + 1)
    return counts if p.num_microbatches > counts[1] else None


def _with_microbatches(cfg: BenchmarkConfig, n: int) -> BenchmarkConfig:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, num_microbatches=n))


def _extend(a: RankMemory, b: RankMemory, counts: tuple[int, int], n: int) -> RankMemory:
    """Each step's phases (a: every step at counts[0]), by category, extended to n micro-batches
    by the growth per micro-batch of the first step (b: the first step at counts[1])."""
    scale = (n - counts[0]) / (counts[1] - counts[0])
    first_a, first_b = a.steps[0], b.steps[0]
    steps = [
        {
            phase: {k: v + round((first_b[phase][k] - first_a[phase][k]) * scale) for k, v in at_a.items()}
            for phase, at_a in step.items()
            if phase in first_a and phase in first_b
        }
        for step in a.steps
    ]
    return dataclasses.replace(a, phases=_peaks(steps), steps=steps, seconds=a.seconds + b.seconds)


def _peaks(steps: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Each phase at its peak over the steps (the earliest step on a tie)."""
    phases: dict[str, dict[str, int]] = {}
    for step in steps:
        for phase, breakdown in step.items():
            if phase not in phases or sum(breakdown.values()) > sum(phases[phase].values()):
                phases[phase] = breakdown
    return phases


class Simulator:
    """Runs simulations in forked children (a fresh torch.distributed world each), `processes` at
    a time (default: one per CPU core). `cache=True` remembers each result: layouts that differ
    only in their micro-batch count share extrapolation points."""

    def __init__(self, processes: int | None = None, cache: bool = False) -> None:
        self.processes = max(1, processes or os.cpu_count() or 1)
        self.cache: dict[Simulation, RankMemory] | None = {} if cache else None

    def run(self, sims: Sequence[Simulation]) -> list[RankMemory]:
        known = self.cache if self.cache is not None else {}
        todo = list(dict.fromkeys(s for s in sims if s not in known))
        if todo:
            known.update(zip(todo, self._in_children(todo), strict=True))
        return [known[s] for s in sims]

    def _in_children(self, sims: list[Simulation]) -> list[RankMemory]:
        ctx = multiprocessing.get_context("fork")
        results: dict[int, RankMemory] = {}
        running: dict[Any, tuple[int, Any]] = {}  # receiving end -> (index, process)
        pending = list(enumerate(sims))
        while pending or running:
            while pending and len(running) < self.processes:
                index, sim = pending.pop(0)
                receive, send = ctx.Pipe(duplex=False)
                child = ctx.Process(target=_child_main, args=(send, sim), daemon=True)
                child.start()
                send.close()
                running[receive] = (index, child)
            for receive in wait(list(running)):
                index, child = running.pop(receive)
                try:
                    status, payload = receive.recv()
                except EOFError:
                    status, payload = "error", "the simulating process died without a result"
                child.join()
                if status != "ok":
                    sim = sims[index]
                    raise MemcheckError(f"rank {sim.rank} of {sim.cfg.parallel.describe()}: {payload}")
                results[index] = payload
        return [results[i] for i in range(len(sims))]


def _child_main(conn, sim: Simulation) -> None:
    try:
        conn.send(("ok", simulate_rank(sim.cfg, sim.rank, gpu=sim.gpu, steps=sim.steps)))
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=-12)))
    finally:
        conn.close()
        os._exit(0)  # a fork: no atexit handlers, no teardown of the parent's state


def simulate_rank(
    cfg: BenchmarkConfig, rank: int, *, gpu: bool = False, steps: int = GPU_STEPS
) -> RankMemory:
    """One rank of cfg's trial on fake tensors, in this process (which it leaves with a
    destroyed process group; `memcheck` runs it in a fresh child). gpu: see memcheck; its
    `steps` first steps are simulated."""
    warnings.filterwarnings("ignore")  # timeouts on a fake group, deprecations
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)  # DTensor's plan notes
    started, world, window = time.perf_counter(), cfg.parallel.world_size, memory_step(cfg)
    if world > 1:  # as in a real trial: one rank alone has no process group
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    tracker = BreakdownTracker()
    try:
        with (
            FakeTensorMode(),
            as_in_a_real_world(cfg),
            _marking_phases(tracker),
            _cuda_kernels() if gpu else contextlib.nullcontext(),
            tracker if gpu else contextlib.nullcontext(),
        ):
            torch.manual_seed(cfg.seed)
            trainer = Trainer(cfg, world, torch.device("cpu"))
            tracker.watch(trainer)
            if gpu:  # as torch.cuda.reset_peak_memory_stats after the build
                tracker.reset_peak()
            for step in range(steps if gpu else window + 1):
                if gpu and step:
                    tracker.steps.append({})
                tracker.phase = PHASES[0]
                x, y = tracker.batch = trainer.batch(step)
                window_tracker = (
                    memory_tracker(trainer, x, y, tracker) if step == window and not gpu else None
                )
                with window_tracker or contextlib.nullcontext():
                    trainer.step(x, y)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    memory = RankMemory(
        rank, coords_of(cfg.parallel, rank), _peaks(tracker.steps), time.perf_counter() - started,
        steps=tracker.steps if gpu else [],
    )  # fmt: skip
    assert memory.peak_bytes == tracker.peak_bytes, (memory.phases, tracker.peak_bytes)
    return memory


class BreakdownTracker(LiveBytesTracker):
    """LiveBytesTracker (its peak unchanged) that also keeps, for each step and each phase of it
    (PHASES), the bytes live at its peak sorted into CATEGORIES, once it watches a trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.trainer: Trainer | None = None
        self.batch: tuple[torch.Tensor, ...] = ()
        self.phase = PHASES[0]
        self.steps: list[dict[str, dict[str, int]]] = [{}]  # per step: phase -> breakdown at its peak
        self._fsdp: list[Any] = []

    def watch(self, trainer: Trainer) -> None:
        self.trainer, self._fsdp = trainer, list(_fsdp_params(trainer.modules))

    def reset_peak(self) -> None:
        self.peak_bytes, self.steps = 0, [{}]
        self._update()

    def _update(self) -> None:
        super()._update()
        phases = self.steps[-1]
        seen = phases.get(self.phase)
        if self.trainer is not None and (seen is None or self._live > sum(seen.values())):
            phases[self.phase] = self._categorise()

    def _categorise(self) -> dict[str, int]:
        kinds = self._kinds()
        out = dict.fromkeys(CATEGORIES, 0)
        for key, (_, nbytes) in self._storages.items():
            out[kinds.get(key, "activations")] += nbytes
        return out

    def _kinds(self) -> dict[int, str]:
        """Category per storage key; later entries win (CATEGORIES' precedence)."""
        assert self.trainer is not None
        kinds: dict[int, str] = {_key(t): "batch" for t in self.batch}
        for fsdp_param in self._fsdp:
            for t in getattr(fsdp_param, "all_gather_outputs", None) or []:
                kinds[_key(t)] = "gathered_parameters"
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                kinds[_key(unsharded)] = "gathered_parameters"
                if unsharded.grad is not None:
                    kinds[_key(unsharded.grad)] = "gradients"
            if fsdp_param.unsharded_accumulated_grad is not None:  # fp32, kept between micro-batches
                kinds[_key(fsdp_param.unsharded_accumulated_grad)] = "gradients"
        for p in self.trainer.params:
            if p.grad is not None:
                kinds[_key(p.grad)] = "gradients"
        kinds |= {_key(t): "optimizer" for t in _optimizer_state(self.trainer.optimizer)}
        kinds |= {_key(p): "parameters" for p in self.trainer.params}
        return kinds


@contextlib.contextmanager
def _marking_phases(tracker: BreakdownTracker) -> Iterator[None]:
    """Tell the tracker when Trainer.step reaches the optimizer (the step loop sets
    "forward_backward")."""
    original = benchmark.grad_norm_

    @functools.wraps(original)
    def grad_norm_(*args, **kwargs):
        tracker.phase = "optimizer"
        return original(*args, **kwargs)

    with mock.patch.object(benchmark, "grad_norm_", grad_norm_):
        yield


@contextlib.contextmanager
def _cuda_kernels() -> Iterator[None]:
    """A GPU trial's kernels where CUDA's keep other tensors for backward than the CPU's the
    simulation runs: torch's rms_norm calls `_fused_rms_norm`, whose backward keeps the input and
    the fp32 rstd (tools/autograd/derivatives.yaml), where on CPU it runs the composite, which keeps
    an fp32 copy of the input and the fp32 normalised input besides: 6h more bytes per token and
    norm in bf16. And a mixture of experts' experts run as on a GPU with grouped GEMMs (compute
    capability >= 9: H100, H200; trainer/moe.py use_grouped_mm), not the CPU's loop over experts:
    the grouped path keeps a padded copy of the routed tokens for backward that the loop's views
    do not have (an A100 trial runs the loop: its oracle would over-count that copy). And op-level
    checkpointing keeps attention's output as it keeps CUDA's SDPA kernels' (flash, efficient),
    which the CPU's kernel the simulation runs is not among (trainer/parallelize.py). And offloaded
    activations (trainer/offload.py) leave the device: their host copies keep no (fake) bytes."""
    original = F.rms_norm
    saved_ops = parallelize._op_sac_saved

    @functools.wraps(original)
    def rms_norm(x, normalized_shape, weight=None, eps=None):
        if weight is not None and weight.dtype != x.dtype:  # CUDA falls back to the composite too
            return original(x, normalized_shape, weight, eps)
        eps = torch.finfo(torch.float32).eps if eps is None else eps
        return FusedRMSNorm.apply(x, weight, len(normalized_shape), eps)

    def op_sac_saved() -> set:
        return saved_ops() | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    sdpa = F.scaled_dot_product_attention

    @functools.wraps(sdpa)
    def narrow_values_sdpa(
        q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if v.shape[-1] == q.shape[-1]:
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)  # fmt: skip
        assert dropout_p == 0.0, "the simulation's narrow-value attention has no dropout"
        return NarrowValuesAttention.apply(q, k, v, attn_mask, is_causal, scale, enable_gqa, sdpa)

    with (
        mock.patch.object(F, "rms_norm", rms_norm),
        mock.patch.object(F, "scaled_dot_product_attention", narrow_values_sdpa),
        mock.patch.object(model_module, "sdpa_needs_equal_widths", lambda device: False),
        mock.patch.object(moe, "use_grouped_mm", lambda x: x.dtype == torch.bfloat16),
        mock.patch.object(parallelize, "_op_sac_saved", op_sac_saved),
        mock.patch.object(offload, "to_host", _host_copy),
        mock.patch.object(offload, "to_device", _device_copy),
    ):
        yield


def _host_copy(t: torch.Tensor) -> tuple[torch.Size, tuple[int, ...], torch.dtype]:
    """A simulated GPU's offload to host memory: nothing on the device, nothing to count."""
    return t.size(), t.stride(), t.dtype


def _device_copy(
    packed: tuple[torch.Size, tuple[int, ...], torch.dtype], device: torch.device
) -> torch.Tensor:
    size, stride, dtype = packed
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


class NarrowValuesAttention(torch.autograd.Function):
    """SDPA with values narrower than q and k (latent attention's v_head_dim < nope + rope) keeping
    for backward what CUDA's memory-efficient kernel keeps: q, k, v, its output (laid out token-
    major, as the kernel writes it: the caller's transpose back is a view) and the fp32 log-sum-exp
    of each head and query. The CPU the simulation runs on computes it with v padded to q's width
    (trainer/model.py LatentAttention does the same on a CPU trial), nothing of which is kept."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, enable_gqa, sdpa) -> torch.Tensor:
        ctx.args = (mask, is_causal, scale, enable_gqa, sdpa)
        b, heads, t, dv = q.shape[:3] + v.shape[-1:]
        padded = F.pad(v, (0, q.shape[-1] - dv))
        full = sdpa(q, k, padded, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        out = q.new_empty(b, t, heads, dv).transpose(1, 2)
        out.copy_(full[..., :dv])
        del padded, full
        lse = q.new_empty(b, heads, t, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        mask, is_causal, scale, enable_gqa, sdpa = ctx.args
        with torch.enable_grad():
            q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
            padded = F.pad(v_, (0, q.shape[-1] - v.shape[-1]))
            full = sdpa(
                q_, k_, padded, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
            )
            dq, dk, dv = torch.autograd.grad(full[..., : v.shape[-1]], (q_, k_, v_), grad)
        return dq, dk, dv, None, None, None, None, None


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm keeping for backward what CUDA's fused kernel keeps: its input, the fp32 rstd per
    row (and the weight). Ops are in place where they can be, so that its temporaries stay near
    the kernel's (which has none): one hidden-sized tensor at a time besides the output."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, dims: int, eps: float) -> torch.Tensor:
        reduce = tuple(range(-dims, 0))
        n = x[(0,) * (x.dim() - dims)].numel()  # values per row
        acc = torch.promote_types(x.dtype, torch.float32)  # rstd in fp32 (in fp64 for fp64)
        rms = torch.linalg.vector_norm(x, 2, dim=reduce, keepdim=True, dtype=acc)
        rstd = rms.pow_(2).div_(n).add_(eps).rsqrt_()
        out = x * rstd.to(x.dtype)
        if weight is not None:
            out.mul_(weight)
        ctx.save_for_backward(x, rstd, weight)
        ctx.reduce, ctx.n = reduce, n
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # y = w x r, r = (mean(x^2) + eps)^-1/2: dx = r g' - x r^3 mean(g' x), g' = g w; dw = sum g x r
        x, rstd, weight = ctx.saved_tensors
        gw = grad * weight if weight is not None else grad.clone()
        dot = (gw * x).sum(ctx.reduce, keepdim=True, dtype=rstd.dtype)
        scale = dot.mul_(rstd.pow(3)).div_(ctx.n).to(x.dtype)
        dweight = None
        if weight is not None and ctx.needs_input_grad[1]:
            rows = tuple(range(x.dim() - len(ctx.reduce)))
            dweight = (grad * x).mul_(rstd.to(x.dtype)).sum(rows, dtype=rstd.dtype).to(weight.dtype)
        dx = gw.mul_(rstd.to(x.dtype)).sub_(x * scale)
        return dx, dweight, None, None


def _key(t: torch.Tensor) -> int:
    """The tracker's key of a tensor's storage (LiveBytesTracker.track)."""
    return id((t._local_tensor if isinstance(t, DTensor) else t).untyped_storage())


def _optimizer_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _fsdp_params(modules: list[torch.nn.Module]) -> Iterator[Any]:
    """FSDP2 / replicate parameter records of every managed module."""
    for module in modules:
        for sub in module.modules():
            get_state = getattr(sub, "_get_fsdp_state", None)
            group = getattr(get_state(), "_fsdp_param_group", None) if get_state else None
            if group is not None:
                yield from group.fsdp_params
