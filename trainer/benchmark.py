"""One tuner trial: build the GPT on a mesh, run W warm-up and up to M measured steps (fewer once
the step time is stable, or when the trial is too slow to matter: trainer/stopping.py), write a
result.

    torchrun --nproc-per-node 4 -m trainer.benchmark --config cfg.json --out result.json

Also runs under `srun` (ranks from Slurm's environment) and as a plain single process. Synthetic
token batches, so no dataset is downloaded; the sequences are learnable, so the loss falls.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainer.context_parallel import shard_sequence
from trainer.contract.result import BenchmarkConfig, BenchmarkResult, trainer_problems
from trainer.contract.topology import placement
from trainer.contract.trial_dir import FAULT_VAR, STORE_FD_VAR, write_result
from trainer.failures import FailureBoard, InvalidLayout, MemoryCapExceeded
from trainer.metrics import LiveBytesTracker, cpu_name, grad_norm_, peak_tflops_of
from trainer.model import GPT, cross_entropy_loss, init_param_
from trainer.moe import configure as configure_moe
from trainer.moe import finish_step as finish_moe_step
from trainer.parallel_dims import ParallelDims
from trainer.parallelize import data_parallel_modules, parallelize_gpt
from trainer.stopping import measurement_stop


def init_process_group(backend: str, rank: int, world_size: int, timeout: timedelta) -> None:
    """env:// as under torchrun or srun; under trainer.spawn rank 0 hosts the store on the
    listening socket it was handed and the others connect to it."""
    if STORE_FD_VAR not in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    fd = os.environ.pop(STORE_FD_VAR)  # rank 0: the socket's number; the others: empty
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0, timeout=timeout, master_listen_fd=int(fd) if rank == 0 else None)  # fmt: skip
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def dist_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun, or from Slurm under srun."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ:
        env = os.environ
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        # env:// rendezvous at the step's first node, on a port derived from the job and step ids
        # so that concurrent steps of one allocation do not collide.
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "localhost")
        env.setdefault("MASTER_ADDR", first_host(nodes))
        step_id = env.get("SLURM_STEP_ID", "0")  # may be "batch" or "extern"
        step = int(step_id) if step_id.isdigit() else 0
        if not env.get("MASTER_PORT"):  # job scripts pick a free one (tuner/dispatch/sbatch.py)
            env["MASTER_PORT"] = str(20000 + (int(env.get("SLURM_JOB_ID", "0")) * 97 + step) % 20000)
        if "OMP_NUM_THREADS" not in env and (threads := slurm_threads(env)):
            env["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)  # OpenMP read the environment when torch was imported
        return int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
    return 0, 0, 1


def slurm_threads(env: dict[str, str] | os._Environ) -> int | None:
    """Threads per rank under srun when OMP_NUM_THREADS is unset: `--cpus-per-task` when the job
    gave one, else 1 when the step runs several ranks on this node (torchrun's rule: each rank
    would otherwise start a thread per core and N ranks oversubscribe the node N times), else
    None (torch's default; also when Slurm's count is in a form not parsed here: a thread count
    is no reason to fail the trial)."""
    if (cpus := env.get("SLURM_CPUS_PER_TASK", "")).isdigit():
        return int(cpus)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    node = env.get("SLURM_NODEID", "0")
    try:
        return 1 if tasks_on_node(per_node, int(node) if node.isdigit() else 0) > 1 else None
    except ValueError:
        return None


def tasks_on_node(per_node: str, node: int) -> int:
    """Tasks on node `node` from Slurm's compressed count: '2(x3),1' -> [2, 2, 2, 1][node]; 0 when
    the count is missing or shorter than `node`."""
    counts = []
    for item in filter(None, per_node.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ValueError(f"cannot parse Slurm tasks per node {per_node!r}")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts[node] if node < len(counts) else 0


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'nid[00012-00015,00020],login1' -> 'nid00012'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}")
    prefix, ranges = m.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def synthetic_batch(cfg: BenchmarkConfig, step: int, rows: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `rows` of step `step`'s global batch: arithmetic sequences mod V with a random start
    and stride per row, the same for every layout (so losses are comparable) and learnable."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    n, vocab, seq = cfg.parallel.global_batch_size, cfg.model.vocab_size, cfg.model.seq_len
    start = torch.randint(vocab, (n, 1), generator=gen)[rows.start : rows.stop]
    stride = torch.randint(1, 8, (n, 1), generator=gen)[rows.start : rows.stop]
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def optimizer_groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """AdamW's parameter groups: DTensor parameters apart from plain ones, and by mesh. Tensor
    parallelism without data parallelism leaves the position embedding a plain tensor beside the
    DTensor shards, and AdamW's fused (and foreach) implementation refuses a list that
    mixes them ("got mixed torch.Tensor and DTensor"), or DTensors of two meshes (a mixture of
    experts' experts live on the sparse mesh, trainer/parallelize.py). Same hyperparameters: the
    same update."""
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for q in params:
        by_mesh.setdefault(q.device_mesh if isinstance(q, DTensor) else None, []).append(q)
    return [{"params": group} for group in by_mesh.values()]


class Trainer:
    """The model (or this rank's pipeline stages), optimizer and step function of one layout."""

    def __init__(self, cfg: BenchmarkConfig, world_size: int, device: torch.device):
        self.cfg, self.device, p = cfg, device, cfg.parallel
        self.dims = ParallelDims.from_config(p, world_size)
        # The mesh's rank table is data, not a tensor to simulate: built for real even under the
        # memory oracle's FakeTensorMode (trainer/memcheck.py); a no-op otherwise.
        with unset_fake_temporarily():
            self.mesh = self.dims.build_mesh(device.type)
            moe = cfg.model.moe and world_size > 1
            self.sparse_mesh = self.dims.build_sparse_mesh(device.type) if moe else None
        self.groups = [self.mesh.get_group(a) for a in self.dims.enabled_axes] if self.mesh else []
        flattened = [a for a in self.dims.weight_axes if a not in self.dims.enabled_axes]  # dp x cp
        self.groups += [self.mesh.get_group(a) for a in flattened]
        self.cp_rank = self.mesh.get_local_rank("cp") if p.cp > 1 else 0
        set_timeouts(self.groups, cfg.init_timeout_s)
        self.low_precision = _dtype(cfg, device) == torch.bfloat16
        param_dtype = torch.bfloat16 if self.low_precision else torch.float32
        self.dp_rank = self._dp_rank()
        self.local_rows = p.micro_batch_size * p.num_microbatches
        init = cfg.init if cfg.init != "auto" else ("exact" if device.type == "cpu" else "fast")

        # Build whole on CPU from the seed (exact) or on meta (fast), then cut stages out of it.
        with torch.device("meta") if init == "fast" else contextlib.nullcontext():
            full = GPT(cfg.model)
        if init == "exact":
            full.init_weights(torch.Generator().manual_seed(cfg.seed))
        if p.pp > 1:
            # Here, not at the top: torch's pipelining imports torch._dynamo (0.6 s of every
            # rank's start on this CPU), which a trial without a pipeline does not need.
            from trainer.pipeline import TiedEmbeddings, build_schedule, split_model

            pp_rank = self.mesh.get_local_rank("pp")
            stage_ids = p.stages_of(pp_rank)
            parts = [(s, split_model(full, s, p.num_stages)) for s in stage_ids]
        else:
            parts = [(0, full)]
        del full
        for _, module in parts:
            if init == "exact" and device.type != "cpu":  # already there (FakeTensor params cannot move)
                module.to(device)
            parallelize_gpt(
                module, self.mesh, self.dims, p, param_dtype=param_dtype, compile=cfg.compile,
                sparse_mesh=self.sparse_mesh,
                reduce_dtype=torch.bfloat16 if cfg.grad_reduce_dtype == "bf16" else torch.float32,
            )  # fmt: skip
            if init == "fast":
                module.to_empty(device=device)
                module.init_buffers()
                # One seed on every rank: replicated parameters must be equal on all replicas.
                gen = torch.Generator(device=device).manual_seed(cfg.seed)
                for name, param in module.named_parameters():
                    local = param.to_local() if isinstance(param, DTensor) else param
                    init_param_(name, local, cfg.model, gen)
            module.train()
        self.modules = [m for _, m in parts]
        # The auxiliary loss's gradient is each micro-batch's share: accumulation divides the loss
        # by the micro-batches itself; a pipeline schedule scales the gradients afterwards.
        # With cp each rank's auxiliary loss is its share of its sequences' (trainer/moe.py); the
        # gradients' mean over dp x cp would divide the sum of the shares by cp: scaled back by cp.
        aux_scale = (1.0 if p.pp > 1 else 1.0 / p.num_microbatches) * p.cp
        configure_moe(self.modules, balanced=cfg.moe_routing == "balanced", aux_scale=aux_scale,
                      capacity_factor=cfg.moe_capacity_factor)  # fmt: skip
        self.moe_step: dict[
            int, torch.Tensor
        ] = {}  # layer id -> (imbalance, aux loss, dropped) of the last step
        self.params = [q for m in self.modules for q in m.parameters()]
        # Fused (one kernel over each group, in place, on CPU and CUDA): no per-parameter
        # temporary at the step, 16 bytes a parameter as the frameworks hold it (torchtitan's
        # default); the foreach path kept an fp32 sqrt(v) of every parameter (20 bytes).
        self.optimizer = torch.optim.AdamW(
            optimizer_groups(self.params), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True
        )
        self.pp_group = self.mesh.get_group("pp") if p.pp > 1 else None
        # A head tied to the embedding: one copy on the first stage, one on the last (pipeline.py).
        self.tied = None
        if p.pp > 1 and cfg.model.tie_embeddings:
            self.tied = TiedEmbeddings(parts, p.num_stages, self.pp_group)
            if self.tied.group is not None:
                self.groups.append(self.tied.group)
            self.tied.sync_weights()
        if p.pp > 1:
            self.has_first = 0 in stage_ids
            self.has_last = p.num_stages - 1 in stage_ids
            self.schedule = build_schedule(
                parts, p.num_stages, self.mesh["pp"], device, p.pp_schedule, p.num_microbatches,
                cross_entropy_loss,
            )  # fmt: skip

    def _dp_rank(self) -> int:
        if not self.dims.dp_axes:
            return 0
        r = self.mesh.get_local_rank("dp_replicate") if self.dims.dp_replicate > 1 else 0
        s = self.mesh.get_local_rank("dp_shard") if self.dims.dp_shard > 1 else 0
        return r * self.dims.dp_shard + s

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch: every cp rank of a dp group gets the same
        sequences, then keeps its two head-tail chunks of tokens and targets."""
        start = self.dp_rank * self.local_rows
        x, y = synthetic_batch(self.cfg, step, range(start, start + self.local_rows))
        if self.dims.cp > 1:
            x, y = (shard_sequence(t, self.dims.cp, self.cp_rank) for t in (x, y))
        return x.to(self.device), y.to(self.device)

    def _context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.dims.tp > 1:  # logits stay vocab-sharded; cross-entropy reduces across tp
            stack.enter_context(loss_parallel())
        if self.low_precision and not self.dims.weight_axes:  # with FSDP2/replicate: mp_policy
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        return stack

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over num_microbatches micro-batches; returns (loss, grad norm).
        The loss is this rank's mean over its micro-batches (0 on non-last pipeline stages)."""
        p = self.cfg.parallel
        with self._context():
            if p.pp > 1:
                losses: list[torch.Tensor] = []
                kwargs = {"target": y, "losses": losses} if self.has_last else {}
                # return_outputs=False: the last stage would keep every micro-batch's logits until
                # the step ends, to return them concatenated; only the losses are used.
                self.schedule.step(*([x] if self.has_first else []), return_outputs=False, **kwargs)
                loss = torch.stack([_full(v) for v in losses]).mean() if self.has_last else None
            else:
                loss = self._accumulate(x, y)
        if loss is None:
            loss = torch.zeros((), device=self.device)
        duplicates = []
        if self.tied is not None:
            self.tied.sum_gradients()
            duplicates = self.tied.duplicates
        reduce_partial_grads(self.params)
        norm = grad_norm_(self.params, self.cfg.grad_clip, self.pp_group, duplicates)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.moe_step = finish_moe_step(self.modules, p.num_microbatches, p.dp)
        return loss.detach().float(), norm

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        (model,) = self.modules
        n = self.cfg.parallel.num_microbatches
        # Replicated DP (over dp_replicate and/or cp): all-reduce once, after the last micro-batch
        # (DDP's no_sync). Sharded DP reduce-scatters every micro-batch so that gradients stay sharded.
        replicated_only = bool(self.dims.weight_axes) and self.cfg.parallel.zero_stage == 0
        total = torch.zeros((), device=self.device)
        for i, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
            if replicated_only:
                for m in data_parallel_modules(model):
                    m.set_requires_gradient_sync(i == n - 1, recurse=False)
            loss = cross_entropy_loss(model(xm), ym)
            (loss / n).backward()
            total = total + _full(loss.detach())
        return total / n


def reduce_partial_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients still partial over a tensor-parallel group (replicated weights used on
    each rank's own tokens or heads: a mixture of experts' router and shared expert, per-head q/k
    norms), so that the norm, the clipping and AdamW see whole gradients."""
    for q in params:
        g = q.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            q.grad = g.redistribute(g.device_mesh, q.placements)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _dtype(cfg: BenchmarkConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if cfg.dtype == "bf16" else torch.float32


def set_timeouts(groups: list[dist.ProcessGroup], seconds: float) -> None:
    if dist.is_initialized():
        for g in [None, *groups]:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), g)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_reduce(values: list[float], op: dist.ReduceOp, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t.tolist()


def train(
    cfg: BenchmarkConfig, rank: int, world_size: int, device: torch.device, base: dict
) -> BenchmarkResult:
    """The measured run; collective on every rank. Raises on failure."""
    torch.manual_seed(cfg.seed)
    dtype = _dtype(cfg, device)
    peak = peak_tflops_of(device, dtype)
    trainer = Trainer(cfg, world_size, device)
    # Where the ranks landed, checked against the placement rule the planner assumes.
    placed = placement(cfg.parallel, _hostnames(world_size))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    num_steps = cfg.warmup_steps + cfg.measure_steps
    track_step = memory_step(cfg)
    cpu_tracking = device.type == "cpu" and not cfg.compile
    losses, norms, times, cpu_peak = [], [], [], 0
    moe_steps: list[dict[int, torch.Tensor]] = []
    measured: list[float] = []  # max over ranks, so every rank takes the same stop decision
    for step in range(num_steps):
        inject_fault(rank, step)
        x, y = trainer.batch(step)
        if step == cfg.warmup_steps and dist.is_initialized():
            dist.barrier()
        # torch.compile refuses a Python dispatch mode: a compiled CPU run reports no peak.
        tracker = memory_tracker(trainer, x, y) if cpu_tracking and step == track_step else None
        _sync(device)
        t0 = time.perf_counter()
        with tracker or contextlib.nullcontext():
            loss, norm = trainer.step(x, y)
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        norms.append(norm)
        moe_steps.append(trainer.moe_step)
        if tracker is not None:
            cpu_peak = tracker.peak_bytes
        if step == 0:  # past lazy init: a wedged collective should now fail fast
            set_timeouts(trainer.groups, cfg.step_timeout_s)
        if cfg.max_memory_bytes is not None and (device.type == "cuda" or tracker is not None):
            used = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else cpu_peak
            worst = _all_reduce([used], dist.ReduceOp.MAX, device)[0]
            if worst > cfg.max_memory_bytes:
                raise MemoryCapExceeded(
                    f"peak memory {worst / 2**20:.1f} MiB over the cap max_memory_bytes "
                    f"{cfg.max_memory_bytes / 2**20:.1f} MiB (step {step + 1})"
                )
        if step >= cfg.warmup_steps:
            measured += _all_reduce(times[-1:], dist.ReduceOp.MAX, device)
            if (stop := measurement_stop(cfg, measured)) is not None:
                break

    p = cfg.parallel
    # Loss: mean over the global batch. Only last-stage ranks hold one; tp (x tp_col) ranks hold
    # copies; cp ranks hold the means of equal shares of the same sequences.
    loss_sum = torch.stack(losses).to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    loss_values = (loss_sum / (p.tp * p.tp_col * p.dp * p.cp)).tolist()
    peak_bytes = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else cpu_peak
    per_rank = [0] * world_size
    per_rank[rank] = peak_bytes
    per_rank = [int(v) for v in _all_reduce(per_rank, dist.ReduceOp.SUM, device)]

    tokens_per_s = cfg.tokens_per_step * len(measured) / sum(measured)
    tflops = cfg.model.flops_per_token * tokens_per_s / world_size / 1e12
    return BenchmarkResult(
        status="pruned" if stop.why == "pruned" else "ok",
        step_times_s=measured,
        stopped_because=stop.message,
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_device=tokens_per_s / world_size,
        model_tflops_per_device=tflops,
        mfu=tflops / peak if peak else 0.0,
        peak_tflops_per_device=peak,
        peak_memory_bytes=max(per_rank),
        peak_memory_bytes_per_rank=per_rank,
        memory_source=(
            "torch.cuda.max_memory_allocated"
            if device.type == "cuda"
            else f"live tensor storages (TorchDispatchMode), warm-up step {track_step + 1}"
            if cpu_tracking
            else "not measured: torch.compile on CPU does not run under a dispatch mode"
        ),
        losses=loss_values,
        grad_norms=[float(n) for n in norms],
        dtype=str(dtype).removeprefix("torch."),
        placement=placed,
        moe=moe_result(cfg, moe_steps, device),
        **base,
    )


def moe_result(cfg: BenchmarkConfig, steps: list[dict[int, torch.Tensor]], device: torch.device) -> dict:
    """BenchmarkResult.moe: every MoE layer's imbalance and the auxiliary loss, per step. A rank
    holds its stages' layers only; their values are equal on the stage's ranks and positive, so
    a MAX over all ranks collects every layer."""
    model = cfg.model
    if not model.moe:
        return {}
    values = torch.zeros(len(steps), model.num_layers, 3, dtype=torch.float64, device=device)
    for i, step in enumerate(steps):
        for layer, v in step.items():
            values[i, layer] = v.to(values)
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    layers = range(model.moe_dense_layers, model.num_layers)
    out = {
        "routing": cfg.moe_routing,
        "imbalance": {str(layer): values[:, layer, 0].tolist() for layer in layers},
    }
    if model.moe_aux_loss_coef > 0:
        out["aux_loss"] = values[:, list(layers), 1].sum(1).tolist()
    if cfg.moe_capacity_factor is not None:  # token drop: the share of each layer's assignments dropped
        out["capacity_factor"] = cfg.moe_capacity_factor
        out["dropped"] = {str(layer): values[:, layer, 2].tolist() for layer in layers}
    return out


def memory_step(cfg: BenchmarkConfig) -> int:
    """The step whose CPU peak memory a trial reports: the last warm-up step, when the optimizer
    state is already live."""
    return cfg.warmup_steps - 1


def memory_tracker(
    trainer: Trainer, x: torch.Tensor, y: torch.Tensor, tracker: LiveBytesTracker | None = None
) -> LiveBytesTracker:
    """A tracker for one step that already counts what is live when it starts: parameters,
    optimizer state and the batch. The memory oracle (trainer/memcheck.py) measures with it too."""
    tracker = tracker or LiveBytesTracker()
    tracker.track_all([*trainer.params, *_optimizer_tensors(trainer.optimizer), x, y])
    return tracker


def _hostnames(world_size: int) -> list[str]:
    """Every rank's host, by rank."""
    if world_size == 1 or not dist.is_initialized():
        return [socket.gethostname()]
    hosts: list[str] = [""] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def inject_fault(rank: int, step: int) -> None:
    """Test hook: TRAINER_FAULT="<raise|hang|exit|oom>:<rank>:<step>[:<job name>]" makes that rank
    fail that way at the start of that (0-based) step, to exercise the failure paths for real; with
    a job name, only in the Slurm job of that name (one attempt of a trial, not its retry)."""
    spec = os.environ.get(FAULT_VAR)
    if not spec:
        return
    kind, fault_rank, fault_step, *job = spec.split(":", 3)
    if int(fault_rank) != rank or int(fault_step) != step:
        return
    if job and os.environ.get("SLURM_JOB_NAME") != job[0]:
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if kind == "oom":
        raise torch.OutOfMemoryError(f"injected: CUDA out of memory on rank {rank} at step {step}")
    if kind == "exit":  # a crash that leaves no Python traceback (segfault, kill -9)
        os._exit(1)
    if kind == "hang":
        time.sleep(3600)
    raise ValueError(f"{FAULT_VAR} kind {kind!r} is not one of raise/hang/exit/oom")


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _device(cfg: BenchmarkConfig, local_rank: int) -> torch.device:
    kind = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise InvalidLayout("device 'cuda' requested but torch.cuda.is_available() is False")
        # Slurm's --gpus-per-task shows each task only its own GPU.
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def run(cfg: BenchmarkConfig, out: Path | None = None) -> BenchmarkResult:
    """Run one trial in this process (one rank of it). Rank 0 writes `out`. Never raises for a
    failed trial: the failure is the result."""
    started = time.perf_counter()
    rank, local_rank, world_size = dist_env()
    base = {
        "world_size": world_size,
        "parallel": cfg.parallel.to_dict(),
        "model": cfg.model.to_dict(),
        "torch_version": torch.__version__,
        "num_params": cfg.model.num_params,
        "flops_per_token": cfg.model.flops_per_token,
        "tokens_per_step": cfg.tokens_per_step,
    }
    board = FailureBoard(out, rank, world_size, base)
    problems = cfg.parallel.problems(cfg.model) + trainer_problems(cfg)
    if cfg.parallel.world_size != world_size:
        problems.append(f"the layout needs {cfg.parallel.world_size} ranks, launched with {world_size}")
    try:
        if problems:  # every rank sees the same problems: no collective needed
            raise InvalidLayout("; ".join(problems))
        device = _device(cfg, local_rank)
        base["device"] = device.type
        base["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_label()
        if world_size > 1 and not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            init_process_group(backend, rank, world_size, timedelta(seconds=cfg.init_timeout_s))
        board.watch()
        result = train(cfg, rank, world_size, device, base)
    except Exception as exc:  # the trial failed; the tuner gets a classified result
        own = board.post(exc)
        if rank != 0:
            return BenchmarkResult(status=own["status"], error=own["error"], failed_rank=rank, **base)
        result = board.finish(own)
        return _with_wall(result, started, board)
    return _with_wall(result, started, board)


def _with_wall(result: BenchmarkResult, started: float, board: FailureBoard) -> BenchmarkResult:
    result = dataclasses.replace(result, wall_time_s=time.perf_counter() - started)
    board.write(result)
    return result


def _cpu_label() -> str:
    return f"{cpu_name()} ({torch.get_num_threads()} threads)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, type=Path, help="BenchmarkConfig JSON file")
    parser.add_argument(
        "--out", required=True, type=Path, help="where rank 0 writes the BenchmarkResult JSON"
    )
    args = parser.parse_args(argv)
    try:
        cfg = BenchmarkConfig.from_json(args.config.read_text())
    except (OSError, ValueError) as e:
        print(f"trainer.benchmark: bad config {args.config}: {e}", file=sys.stderr)
        result = BenchmarkResult(status="invalid", error=f"bad config: {e}")
        if dist_env()[0] == 0:
            write_result(args.out, result)
        return 2
    result = run(cfg, args.out)
    rank = dist_env()[0]
    if rank == 0:
        summary = f"{result.status}: {result.tokens_per_s:.0f} tokens/s, mfu {result.mfu:.1%}"
        print(
            summary if result.measured else f"{result.status}: {result.error.strip().splitlines()[-1:]}",
            flush=True,
        )
    if result.measured and dist.is_initialized():
        dist.destroy_process_group()
        return 0
    # A failed trial: peers may be wedged in collectives, so skip teardown entirely.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
