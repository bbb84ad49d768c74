"""What a gloo collective costs on CPU ranks that share cores, in its parts: the per-call cost by
group size, the bandwidth, the wait behind the compute before it, and what the trainer's DTensor
tensor parallelism adds per collective. The measured parts are the CPU defaults of the
performance model (tuner/perfconstants.py); docs/benchmarks.md says how.

    flock /tmp/parallel-tuner-measure.lock .venv/bin/python -m bench.gloo_groups [--worlds 8 4 2]

For each world size W (gloo ranks on this machine, one thread each, as the trainer runs them) and
group size g dividing it, W ranks start once per repeat, split into W/g groups of g consecutive
ranks that all run at once (the pattern of a tensor-parallel layer: each group reduces its own
activations), and measure in each group, after warm-up:
- call: back-to-back all-reduces of 1 KiB and 64 KiB (the cost is per call at these sizes);
- bandwidth: back-to-back all-reduces of 4 MiB;
- wait: a compute segment of C ms of the rank's CPU time (small matmuls), then an all-reduce of
  1 KiB: what a collective after compute costs beyond the compute and the bare call;
- the trainer's transformer block (trainer/model.py, gpt-small's shape, one sequence) with
  Megatron tensor parallelism over the group, forward and backward: `none` (one rank's shard,
  no communication), `plain` (the same with its 4 all-reduces per layer as plain dist.all_reduce
  calls, Megatron's f and g) and `dtensor` (the trainer's own trainer.parallelize.apply_tp, on
  DTensor). dtensor - plain is what the DTensor path adds per collective; plain - none - 4 calls,
  the wait behind the block's real compute segments.
Every configuration runs `--repeats` times, the configurations alternating; the median is
printed. Times are "busy" seconds: wall time x cores / W when W ranks share fewer cores (the model's
shared-cores bound multiplies a rank's busy time by W / cores, so this is the number it needs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from trainer.contract.presets import MODEL_PRESETS
from trainer.model import Block

CALL_BYTES = (1024, 65536)  # a layer norm's statistics; a gpt-small activation (128 x 128 fp32)
BANDWIDTH_BYTES = 4 << 20  # gpt-small's gradients are ~4.4 MB
SEGMENTS_MS = (1.0, 4.0)  # compute before a collective: a gpt-small TP segment is ~1-2 ms
LAYERS = 4
CHUNKS = 8


class _AllReduce(torch.autograd.Function):
    """Megatron's g (forward all-reduce, backward identity) or f (the reverse), by `forward_op`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, forward_op: bool) -> torch.Tensor:
        ctx.group, ctx.forward_op = group, forward_op
        if not forward_op:
            return x.view_as(x)
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.forward_op:
            return dy, None, None
        dy = dy.clone()
        dist.all_reduce(dy, group=ctx.group)
        return dy, None, None


def _shard(layer: nn.Linear, g: int, rank: int, dim: int) -> nn.Linear:
    out_f, in_f = layer.weight.shape
    part = nn.Linear(in_f // g if dim else in_f, out_f if dim else out_f // g, bias=False)
    with torch.no_grad():
        part.weight.copy_(layer.weight.chunk(g, dim=dim)[rank])
    return part


def _plain_tp(block: Block, g: int, rank: int, group: dist.ProcessGroup | None) -> Block:
    """Megatron's 1D tensor parallelism on plain tensors: q/k/v and MLP-up split by output, out and
    MLP-down by input; all-reduce the outputs of the latter (g) and the inputs' gradients (f).
    Without a group: one rank's shard of the work, no communication."""
    attn, mlp = block.attn, block.mlp
    for name in ("wq", "wk", "wv"):
        setattr(attn, name, _shard(getattr(attn, name), g, rank, 0))
    mlp.fc = _shard(mlp.fc, g, rank, 0)
    attn.wo, mlp.proj = _shard(attn.wo, g, rank, 1), _shard(mlp.proj, g, rank, 1)
    if group is not None:
        for module in (attn, mlp):
            module.register_forward_pre_hook(lambda _, a: (_AllReduce.apply(a[0], group, False),))
            module.register_forward_hook(lambda _, __, y: _AllReduce.apply(y, group, True))
    return block


def _spin(cpu_s: float, a: torch.Tensor) -> None:
    start = time.process_time()
    while time.process_time() - start < cpu_s:
        a @ a


def _timed(fn, ops: int, warmup: int, chunks: int = CHUNKS) -> float:
    """Wall seconds per call of fn: `ops` calls in `chunks` chunks, the lower quartile of the
    chunks' means. Other work on this machine only ever slows a chunk down, and a chunk is long
    against a scheduling slice, so the lower quartile is the configuration's own cost."""
    for _ in range(warmup):
        fn()
    dist.barrier()
    means = []
    for _ in range(chunks):
        start = time.perf_counter()
        for _ in range(max(ops // chunks, 1)):
            fn()
        means.append((time.perf_counter() - start) / max(ops // chunks, 1))
    return statistics.quantiles(means, n=4)[0]


def _stack(mode: str, g: int, group: dist.ProcessGroup, mesh) -> nn.Module:
    """gpt-small's blocks (no embedding, norm or head) parallelised over the group as `mode` says."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from trainer.model import GPT
    from trainer.parallelize import apply_fsdp, apply_replicate, apply_tp

    cfg = dataclasses.replace(MODEL_PRESETS["gpt-small"], num_layers=LAYERS)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.embed = model.norm = model.head = None
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    if mode == "dtensor":  # the trainer's 1D tensor parallelism (DTensor), no sequence parallelism
        apply_tp(model, mesh, sequence_parallel=False)
    elif mode == "replicate":  # the trainer's replicated data parallelism (FSDP2's replicate)
        apply_replicate(model, mesh, mp_policy=fp32)
    elif mode == "zero3":  # the trainer's ZeRO-3 (FSDP2, resharded after forward)
        apply_fsdp(model, mesh, reshard_after_forward=True, mp_policy=fp32)
    elif mode in ("none", "plain"):  # one tensor-parallel rank's shard; plain: with Megatron's f and g
        rank = dist.get_rank(group)
        for block in model.layers.values():
            _plain_tp(block, g, rank, group if mode == "plain" else None)
    return model  # "whole": every rank the whole blocks, no communication


def _rank(rank: int, world: int, g: int, port: int, ops: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // g, g), mesh_dim_names=("rest", "tp"))
        group = mesh.get_group("tp")
        out: dict[str, float] = {}
        for nbytes in (*CALL_BYTES, BANDWIDTH_BYTES):
            x = torch.zeros(nbytes // 4)
            n = max(ops // 10, CHUNKS) if nbytes == BANDWIDTH_BYTES else ops
            out[f"call {nbytes}"] = _timed(lambda x=x: dist.all_reduce(x, group=group), n, 10)
        x, a = torch.zeros(256), torch.randn(32, 32)
        for ms in SEGMENTS_MS:
            out[f"segment {ms}"] = _timed(lambda ms=ms: (_spin(ms / 1e3, a), dist.all_reduce(x, group=group)),
                                          max(ops // 4, CHUNKS), 5)  # fmt: skip
        cfg = MODEL_PRESETS["gpt-small"]
        tokens = torch.randn(1, cfg.seq_len, cfg.hidden_size)
        modes = ("whole", "replicate", "zero3") + (
            ("none", "plain", "dtensor") if cfg.num_heads % g == 0 else ()
        )
        for mode in modes:
            model = _stack(mode, g, group, mesh["tp"])
            out[f"block {mode}"] = _timed(
                lambda model=model: model(tokens).sum().backward(), max(ops // 8, 2 * CHUNKS), 3
            )
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out["cpu_s"] = usage.ru_utime + usage.ru_stime
        queue.put(out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine_busy_s() -> float:
    """CPU seconds this machine has been busy (all processes), from /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def measure(world: int, g: int, ops: int) -> dict[str, float]:
    """{part: wall seconds}, means over the ranks, and `foreign`: the share of the machine's CPU
    that other processes used meanwhile (0 on a quiet machine)."""
    ctx = mp.get_context("spawn")
    busy0, wall0 = _machine_busy_s(), time.perf_counter()
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, g, port, ops, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=900) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    ours = sum(r.pop("cpu_s") for r in results)
    foreign = (_machine_busy_s() - busy0 - ours) / ((os.cpu_count() or 1) * (time.perf_counter() - wall0))
    return {**{k: statistics.fmean(r[k] for r in results) for k in results[0]}, "foreign": max(foreign, 0.0)}


def parts(busy: dict[str, float], g: int) -> dict[str, float]:
    """The model's parts from one configuration's busy seconds (see the module docstring)."""
    call, call_64k = busy[f"call {CALL_BYTES[0]}"], busy[f"call {CALL_BYTES[1]}"]
    out = {"foreign": busy["foreign"], "call_s": call, "call_64k_s": call_64k}
    gbps = 2 * (g - 1) / g * BANDWIDTH_BYTES / max(busy[f"call {BANDWIDTH_BYTES}"] - call, 1e-9) / 1e9
    out["gbps"] = gbps
    for ms in SEGMENTS_MS:
        out[f"wait_{ms:g}ms_s"] = busy[f"segment {ms}"] - ms / 1e3 - call
    cfg = MODEL_PRESETS["gpt-small"]
    block_bytes = 4 * (12 * cfg.hidden_size**2 + 4 * cfg.hidden_size)  # a block's fp32 gradients
    whole = busy["block whole"]
    # replicated: one all-reduce of a block's gradients per block; ZeRO-3: per block an all-gather
    # in forward and in backward and a reduce-scatter, each half a ring all-reduce's bytes
    ring_s = 2 * (g - 1) / g * block_bytes / (gbps * 1e9)
    out["replicate_per_call_s"] = (busy["block replicate"] - whole) / LAYERS - ring_s - call
    out["zero3_per_call_s"] = (busy["block zero3"] - whole) / (3 * LAYERS) - ring_s / 2 - call
    if "block none" in busy:
        calls = 4 * LAYERS  # Megatron's: 2 all-reduces forward, 2 backward per layer (no SP)
        compute = busy["block none"]
        out["tp_compute_s"] = compute / calls
        out["dtensor_per_call_s"] = (busy["block dtensor"] - busy["block plain"]) / calls
        out["tp_wait_per_call_s"] = (busy["block plain"] - compute) / calls - call_64k
        out["tp_wait_fraction"] = out["tp_wait_per_call_s"] * calls / compute
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 4, 2])
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write every run's parts here")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    configs = [(w, g) for w in args.worlds for g in (2, 4, 8, 16) if g <= w and w % g == 0]
    runs: dict[tuple[int, int], list[dict[str, float]]] = {wg: [] for wg in configs}
    started = time.monotonic()
    for _ in range(args.repeats):
        for w, g in configs:
            share = min(1.0, cores / w)  # busy = wall x cores / W when ranks share cores
            wall = measure(w, g, args.ops)
            runs[(w, g)].append(parts({k: v if k == "foreign" else v * share for k, v in wall.items()}, g))
    print(f"gloo ranks on {cores} cores, one thread each, all groups at once; medians of {args.repeats} "
          f"runs ({time.monotonic() - started:.0f} s); busy ms = wall ms x cores / ranks when ranks share cores")  # fmt: skip
    names = list(runs[configs[0]][0])
    print("ranks | ranks per core | group | " + " | ".join(names))
    for w, g in configs:
        cells = []
        for name in names:
            vals = [r[name] for r in runs[(w, g)] if name in r]
            med = statistics.median(vals) if vals else float("nan")
            scale = 1.0 if name in ("foreign", "gbps", "tp_wait_fraction") else 1e3
            cells.append(f"{med * scale:.3g}")
        print(f"{w} | {w / cores:g} | {g} | " + " | ".join(cells))
    if args.json:
        args.json.write_text(json.dumps({f"{w}x{g}": runs[(w, g)] for w, g in configs}, indent=1))


if __name__ == "__main__":
    main()
