"""Time of one gloo all-reduce between two ranks on the local Slurm cluster: in one node and
across the links between nodes (shaped or not). The cluster specs of our own 4-node tables
(bench/validation_data.py CLUSTERS) take their link latency from it.

    flock /tmp/parallel-tuner-measure.lock .venv/bin/python -m bench.link_latency --inter-node-mbit 200

Starts a 4-node cluster (tests/slurm_cluster.py; each node a network namespace, links shaped to
--inter-node-mbit), runs one 2-task job step in one node and one across two nodes (srun,
gloo over each node's eth0, the trainer's env:// rendezvous), and in each times `--repeats`
all-reduces per message size after 20 warm-up ones. Prints the median and the 10th/90th
percentile seconds per all-reduce. A 2-rank ring all-reduce is two steps, each a send and a
receive of half the message: half the small-message time is one step's latency.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SIZES = (8, 65536, 1 << 20)  # bytes: a scalar, a gpt-small activation (128 x 128 fp32), 1 MiB

CHILD = r"""
import json, os, statistics, sys, time
import torch, torch.distributed as dist
from trainer.benchmark import dist_env
repeats, sizes = int(sys.argv[1]), [int(a) for a in sys.argv[2:]]
rank, _, world = dist_env()
dist.init_process_group("gloo", rank=rank, world_size=world)
out = {}
for size in sizes:
    x = torch.zeros(size // 4)
    for _ in range(20):
        dist.all_reduce(x)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    times.sort()
    out[size] = {"median_s": statistics.median(times), "p10_s": times[len(times) // 10],
                 "p90_s": times[9 * len(times) // 10]}
if rank == 0:
    print("RESULT " + json.dumps({"host": os.uname().nodename, "sizes": out}), flush=True)
dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inter-node-mbit", type=int, help="shape the links between nodes")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    from tests.slurm_cluster import slurm_cluster

    results = {}
    with slurm_cluster(nodes=4, inter_node_mbit=args.inter_node_mbit) as cluster:
        env = {**cluster.env, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "eth0"}
        for name, shape in (
            ("intra_node", ["-N1", "-n2"]),
            ("inter_node", ["-N2", "-n2", "--ntasks-per-node=1"]),
        ):
            done = subprocess.run(
                ["srun", "-p", "debug", *shape, f"--chdir={ROOT}", sys.executable, "-c", CHILD, str(args.repeats), *map(str, SIZES)],
                env=env, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                raise RuntimeError(f"{name}: srun exited {done.returncode}: {done.stderr.strip()[-2000:]}")
            results[name] = json.loads(lines[0].removeprefix("RESULT "))
    print(json.dumps({"inter_node_mbit": args.inter_node_mbit, "repeats": args.repeats, **results}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
