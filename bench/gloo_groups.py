"""What one gloo all-reduce costs when every rank of the world runs one at once in groups of
g (the pattern of a tensor-parallel layer: each tp group reduces its own activations), with the
world's ranks sharing this machine's cores, against what the performance model prices for it.

    flock /tmp/parallel-tuner-measure.lock .venv/bin/python bench/gloo_groups.py [--world 8]

`--world` gloo ranks on this machine (one thread each, as the trainer runs them), split into
groups of g consecutive ranks for g in 2, 4, ..., world; in each group `--ops` back-to-back
all-reduces of each message size after 20 warm-up ones. Every configuration runs `--repeats`
times, the configurations alternating. Prints per configuration the median over repeats of the
wall seconds per all-reduce and of the CPU seconds per all-reduce per rank (the process's own
time, gloo's threads included), and the model's price: one collective of the group on the
cpu-local link with the CPU default constants (tuner/perfconstants.py), times world / cores,
as the model's shared-cores bound counts a collective's time on every rank as busy.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tuner import perfmodel  # noqa: E402
from tuner.hardware import cluster_preset  # noqa: E402
from tuner.perfconstants import CPU_CONSTANTS  # noqa: E402
from tuner.spec import ClusterSpec  # noqa: E402

SIZES = (1024, 65536)  # bytes: a layer norm's statistics, a gpt-small activation (128 x 128 fp32)


def _rank(rank: int, world: int, group_size: int, port: int, ops: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        groups = [dist.new_group(list(range(s, s + group_size))) for s in range(0, world, group_size)]
        group = groups[rank // group_size]
        out = {}
        for nbytes in SIZES:
            x = torch.zeros(nbytes // 4)
            for _ in range(20):
                dist.all_reduce(x, group=group)
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(ops):
                dist.all_reduce(x, group=group)
            out[nbytes] = ((time.perf_counter() - wall) / ops, (time.process_time() - cpu) / ops)
        queue.put(out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, group_size: int, ops: int) -> dict[int, tuple[float, float]]:
    """{bytes: (wall s per all-reduce, CPU s per all-reduce per rank)}, means over the ranks."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, group_size, port, ops, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
    return {n: tuple(statistics.fmean(r[n][i] for r in results) for i in (0, 1)) for n in SIZES}


def model_price(nbytes: int, group_size: int, world: int, cores: int) -> float:
    cluster = ClusterSpec(**cluster_preset("cpu-local"))
    link = (cluster.intra_node_gbps, cluster.intra_node_latency_us)
    return perfmodel._collective_s(nbytes, group_size, link, CPU_CONSTANTS) * world / cores


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sizes = [g for g in (2, 4, 8, 16, 32) if g <= args.world and args.world % g == 0]
    runs: dict[int, list[dict]] = {g: [] for g in sizes}
    for _ in range(args.repeats):
        for g in sizes:
            runs[g].append(measure(args.world, g, args.ops))
    cores = os.cpu_count() or 1
    print(f"{args.world} gloo ranks on {cores} cores, {args.ops} all-reduces per group, "
          f"median of {args.repeats} runs")  # fmt: skip
    print("group | bytes | wall ms/op | CPU ms/op/rank | model ms (shared-cores price)")
    for g in sizes:
        for n in SIZES:
            wall = statistics.median(r[n][0] for r in runs[g]) * 1e3
            cpu = statistics.median(r[n][1] for r in runs[g]) * 1e3
            print(f"{g} | {n} | {wall:.2f} | {cpu:.2f} | {model_price(n, g, args.world, cores) * 1e3:.2f}")


if __name__ == "__main__":
    main()
