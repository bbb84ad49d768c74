"""Speed of the planner: enumerating a big space, and `tuner plan` end to end.

    .venv/bin/python -m bench.plan_speed

Issue 3's bounds: a 1T model on 3072 GPUs enumerates in under 1 s; `tuner plan --model gpt-175b
--cluster frontier-mi250x --gpus 1024 --global-batch 640 --json` returns in under 3 s.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tuner.space import SearchSpace
from tuner.spec import parse_spec

REPEATS = 5


def main() -> None:
    spec = parse_spec({"model": "gpt-1t", "cluster": {"preset": "frontier-mi250x", "num_nodes": 384},
                       "training": {"global_batch_size": 1536}})  # fmt: skip
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        result = SearchSpace.from_spec(spec).enumerate()
        times.append(time.perf_counter() - t0)
    print(f"enumerate gpt-1t on 3072 GCDs: {result.space_size} layouts, {len(result.valid)} valid; "
          f"median {statistics.median(times) * 1e3:.1f} ms over {REPEATS} (max {max(times) * 1e3:.1f} ms)")  # fmt: skip
    tuner = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"
    cmd = [tuner, "plan", "--model", "gpt-175b", "--cluster", "frontier-mi250x", "--gpus", "1024",
           "--global-batch", "640", "--json"]  # fmt: skip
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    print(
        f"`{' '.join(cmd[1:])}` (process start included): median {statistics.median(times):.2f} s "
        f"over {REPEATS} (max {max(times):.2f} s)"
    )


if __name__ == "__main__":
    main()
