"""Trial cost before and after adaptive measurement and pruning while running, side by side.

    .venv/bin/python -m bench.trial_cost [--spec studies/gpt-small-cpu.yaml] [--measure-steps N]
                                         [--global-batch B] [--repeats R] [--json out.json]
                                         [--before-launcher spawn|torchrun]
                                         [--fork-server after|both|none]
    .venv/bin/python -m bench.trial_cost --report out.json      (summarize a saved run again)

The same real study (local dispatch, the spec's sampler and seed) runs with `tuner run`, before
and after alternating, R times each:
  before  every trial measures all of trial.measure_steps (stable_rel_ci and
          prune_running_fraction null: the trainer as it was), ranks started by
          --before-launcher (spawn, or torchrun as local trials were launched until 2026-12-02);
  after   the spec's trial section (defaults: stop once the 95 % CI of the mean step time is
          within 2 %, prune below 0.5 x the best so far; trainer/stopping.py), ranks started by
          trainer.spawn.
--fork-server says which runs fork their ranks from a fork server (trainer/forkserver.py; the
default since 2026-12-02) instead of starting each as a Python of its own: the after runs only
(default), both, or none. Its start (~3 s) is charged to each run's first trial.
Each run gets its own database, so no run starts from another's calibration. From each database:
device-seconds (world size x attempt time, summed as the device-hours budget sums them) until the
trial of the study's best layout finished, and in total; the best layout; how many trials were
pruned while running or stopped as stable. Per repeat, the after run is charged the
device-seconds until it had measured the before run's best layout (the same layout, whichever
won in the after run), and "same best" says whether the after run's own best is that layout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from trainer.contract.trial_dir import FORKSERVER_VAR, LAUNCHER_VAR
from trainer.launch import LAUNCHERS
from tuner import store
from tuner.db import connect
from tuner.outcome import PRUNED_RUNNING, TrialState

ROOT = Path(__file__).resolve().parent.parent

TUNER = str(Path(sys.executable).parent / "tuner")
FIXED = {"stable_rel_ci": None, "prune_running_fraction": None}


def run_study(spec: dict, tmp: Path, name: str, launcher: str = "spawn", fork_server: bool = True) -> dict:
    """One `tuner run` of `spec` in a fresh database, its local trials started by `launcher`
    (trainer/launch.py: LAUNCHERS), their ranks forked from a fork server or not; what it cost
    and found."""
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**spec, "name": name}))
    db = f"sqlite:///{tmp / name}.db"
    env = {
        **os.environ,
        "TUNER_DATABASE_URL": db,
        "TUNER_WORK_DIR": str(tmp / name),
        LAUNCHER_VAR: launcher,
        FORKSERVER_VAR: "1" if fork_server else "0",
    }
    started = time.monotonic()
    done = subprocess.run([TUNER, "run", str(path)], env=env, capture_output=True, text=True, timeout=7200)
    wall_s = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{name}: tuner run failed\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with connect(db)() as s:
        study = store.get_study(s, name)
        rows = sorted(
            (t for t in store.trials(s, study) if t.finished_at), key=lambda t: (t.finished_at, t.id)
        )
        best = store.best_trial(s, study)
        trials = [
            {"number": t.number, "layout": store.config_of(t).describe(), "state": t.state.word,
             "kind": PRUNED_RUNNING if store.pruned_while_running(t) else t.failure_kind or "ok", "tokens_per_s": t.tokens_per_s, "device_s": t.device_s,
             "measured_steps": len((t.result or {}).get("step_times_s", [])),
             "stopped_because": (t.result or {}).get("stopped_because", "")}
            for t in rows
        ]  # fmt: skip
    spent, to_best = 0.0, None
    for t in trials:
        spent += t["device_s"]
        if best is not None and t["number"] == best.number:
            to_best = spent
    return {
        "name": name, "wall_s": round(wall_s, 1), "best_layout": store.config_of(best).describe() if best else None,
        "best_tokens_per_s": best.tokens_per_s if best else None, "device_s_to_best": to_best,
        "device_s_total": spent, "trials": len(trials),
        "pruned_running": sum(t["kind"] == PRUNED_RUNNING for t in trials),
        "stopped_stable": sum(t["stopped_because"].startswith("stable") for t in trials),
        "trial_rows": trials,
    }  # fmt: skip


def spent_until(run: dict, layout: str | None) -> float | None:
    """Device-seconds of `run` until its trial of `layout` finished (None: it never ran it)."""
    spent = 0.0
    for t in run["trial_rows"]:
        spent += t["device_s"]
        if t["layout"] == layout:
            return spent
    return None


def row(r: dict) -> str:
    return (f"{r['name']:>9} {r['best_layout'] or '-':<28} {r['best_tokens_per_s'] or 0:>10,.0f} "
            f"{r['device_s_to_best'] or 0:>12.1f} {r['device_s_total']:>11.1f} {r['trials']:>6} "
            f"{r['pruned_running']:>6} {r['stopped_stable']:>6} {r['wall_s']:>7.0f}")  # fmt: skip


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per repeat: the before run's best layout, the device-seconds each run spent until it had
    measured that layout, whether the after run's own best is the same layout; totals. Saved
    fractions are over the sums of the repeats."""
    pairs = [
        {"before_best": b["best_layout"], "after_best": a["best_layout"], "same_best": b["best_layout"] == a["best_layout"],
         "before_device_s_to_best": round(b["device_s_to_best"], 1),
         "after_device_s_to_same_layout": round(spent_until(a, b["best_layout"]) or math.nan, 1),
         "before_device_s_total": round(b["device_s_total"], 1), "after_device_s_total": round(a["device_s_total"], 1)}
        for b, a in zip(runs["before"], runs["after"], strict=True)
    ]  # fmt: skip
    to_best = [sum(p[k] for p in pairs) for k in ("before_device_s_to_best", "after_device_s_to_same_layout")]
    total = [sum(p[k] for p in pairs) for k in ("before_device_s_total", "after_device_s_total")]
    return {
        "pairs": pairs,
        "saved_to_best": round(1 - to_best[1] / to_best[0], 3),
        "saved_total": round(1 - total[1] / total[0], 3),
        "same_best": sum(p["same_best"] for p in pairs),
        "before_bests": sorted({r["best_layout"] for r in runs["before"]}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--spec", type=Path, default=ROOT / "studies" / "gpt-small-cpu.yaml")
    parser.add_argument(
        "--measure-steps", type=int, help="trial.measure_steps for both (default: the spec's)"
    )
    parser.add_argument("--global-batch", type=int, help="training.global_batch_size (default: the spec's)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--before-launcher", choices=sorted(LAUNCHERS), default="spawn",
                        help="what starts the before runs' ranks (the after runs': spawn); torchrun: "
                             "the launcher local trials used until 2026-12-02")  # fmt: skip
    parser.add_argument("--fork-server", choices=["after", "both", "none"], default="after",
                        help="which runs fork their ranks from a fork server")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every run's figures and trials here")
    parser.add_argument("--report", type=Path, help="summarize a --json file again instead of running")
    args = parser.parse_args()
    if args.report:
        print(json.dumps(summarize(json.loads(args.report.read_text())["runs"]), indent=1))
        return
    base = yaml.safe_load(args.spec.read_text())
    trial = {**base.get("trial", {}), "device": "cpu"}
    if args.measure_steps:
        trial["measure_steps"] = args.measure_steps
    if args.global_batch:
        base["training"] = {**base["training"], "global_batch_size": args.global_batch}
    specs = {"before": {**base, "trial": {**trial, **FIXED}}, "after": {**base, "trial": trial}}
    print(f"{args.spec.name}: training {json.dumps(base['training'])}, trial {json.dumps(trial)}, "
          f"sampler {base.get('sampler', 'model')}, before launcher {args.before_launcher}, "
          f"fork server: {args.fork_server}")  # fmt: skip
    print(f"{'run':>9} {'best layout':<28} {'tokens/s':>10} {'dev-s->best':>12} {'dev-s total':>11} "
          f"{'trials':>6} {TrialState.PRUNED.word:>6} {'stable':>6} {'wall s':>7}", flush=True)  # fmt: skip
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(1, args.repeats + 1):
            for mode in ("before", "after"):
                launcher = args.before_launcher if mode == "before" else "spawn"
                forked = args.fork_server == "both" or (args.fork_server == "after" and mode == "after")
                runs[mode].append(run_study(specs[mode], Path(tmp), f"{mode}-{i}", launcher, forked))
                print(row(runs[mode][-1]), flush=True)
    summary = summarize(runs)
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"spec": str(args.spec), "training": base["training"], "trial": trial,
                                         "before_launcher": args.before_launcher,
                                         "fork_server": args.fork_server, "runs": runs,
                                         "summary": summary}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
