"""Dispatch overhead per trial: local process groups vs Slurm job-per-trial vs allocation mode.

    .venv/bin/python -m bench.dispatch_overhead [--trials 6]      (as root: starts a local Slurm cluster)

The same study (gpt-tiny, world size 1, 1 warm-up + 2 measured steps, one trial at a time) runs
with `tuner run` on each backend, side by side in one invocation, on a real single-node Slurm
cluster started by scripts/slurm-local.sh. Per trial: overhead = (result stored - trial submitted,
both from the database) - the trial's own wall time (the trainer's `wall_time_s`, from its entry
to its result). What remains is launching (torchrun / sbatch + queue + srun), the interpreter and
torch import in the trial, and the dispatcher noticing the end (sacct polling).
For allocation mode the allocation's own start (submit -> first trial submitted) is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from tests.slurm_cluster import slurm_cluster
from tuner import store
from tuner.db import connect
from tuner.outcome import TrialState

TUNER = str(Path(sys.executable).parent / "tuner")


def study(name: str, backend: str, trials: int, mode: str = "job-per-trial") -> dict:
    return {
        "name": name, "model": "gpt-tiny", "num_gpus": 1, "backend": backend,
        "cluster": {"preset": "cpu-local", "gpus_per_node": 8},
        "training": {"global_batch_size": 8, "precision": "fp32"},
        "space": {"tp": [1], "pp": [1], "micro_batch_size": [1, 2, 4, 8], "zero_stage": [0],
                  "activation_checkpoint": ["none", "full"], "sequence_parallel": [False]},
        "trial": {"warmup_steps": 1, "measure_steps": 2, "timeout_s": 120, "device": "cpu"},
        "budget": {"max_trials": trials, "trials_in_flight": 1}, "sampler": "grid",
        "prune_predicted_oom": False,
        "slurm": {"mode": mode, "allocation_minutes": 30, "env": {"GLOO_SOCKET_IFNAME": "lo"}},
    }  # fmt: skip


def measure(tmp: Path, env: dict[str, str], name: str, spec: dict) -> dict:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    db = f"sqlite:///{tmp / 'bench.db'}"
    run_env = {**env, "TUNER_DATABASE_URL": db, "TUNER_WORK_DIR": str(tmp / "runs")}
    done = subprocess.run(
        [TUNER, "run", str(path)], env=run_env, capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name}: tuner run failed\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    with connect(db)() as s:
        st = store.get_study(s, name)
        rows = store.trials(s, st)
        overheads = [
            (t.finished_at - t.started_at).total_seconds() - t.result["wall_time_s"]
            for t in rows
            if t.state is TrialState.COMPLETE
        ]
        own = [t.result["wall_time_s"] for t in rows if t.state is TrialState.COMPLETE]
        first_start = min(t.started_at for t in rows)
        out = {
            "trials": len(overheads), "median_overhead_s": statistics.median(overheads),
            "min_overhead_s": min(overheads), "max_overhead_s": max(overheads),
            "median_trial_wall_s": statistics.median(own),
            "study_start_to_first_trial_s": (first_start - st.created_at).total_seconds(),
        }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=6)
    args = parser.parse_args()
    results = {}
    with slurm_cluster() as cluster, tempfile.TemporaryDirectory() as tmp:
        env = {**cluster.env}
        os.environ.update({k: cluster.env[k] for k in ("SLURM_CONF", "PATH")})
        for name, backend, mode in [("local", "local", "job-per-trial"), ("slurm-job", "slurm", "job-per-trial"),
                                    ("slurm-allocation", "slurm", "allocation")]:  # fmt: skip
            results[name] = measure(Path(tmp), env, name, study(name, backend, args.trials, mode))
            print(f"{name:>17}: {json.dumps(results[name])}", flush=True)
    base = results["local"]["median_overhead_s"]
    print("\nmedian dispatch overhead per trial (ratio to local):")
    for name, r in results.items():
        print(f"  {name:>17}: {r['median_overhead_s']:.2f} s ({r['median_overhead_s'] / base:.2f}x), "
              f"trial's own run {r['median_trial_wall_s']:.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
