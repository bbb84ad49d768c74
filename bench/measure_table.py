"""Measure a ground-truth table on this machine: every valid layout of a small GPT, run for real.

    .venv/bin/python -m bench.measure_table --out bench/own_tables/own_gpt-tiny_8rank_gbs16.csv [--repeats 2]
    .venv/bin/python -m bench.measure_table --slurm --nodes 4 --inter-node-mbit 200 \\
        --warmup-steps 1 --measure-steps 3 --out bench/own_tables/own_gpt-tiny_4node_200mbit_gbs16.csv
    .venv/bin/python -m bench.measure_table --space cp --model llama-tiny --seq-len 2048 --global-batch 8 \\
        --out bench/own_tables/own_llama-tiny_8rank_cp_gbs8.csv

Every valid layout of the space below, each run `repeats` times; the row keeps the median
iteration time and says the spread in `notes`. Written in the column format of
bench/data/README.md (plus `tp_col`), so bench/search_efficiency.py and bench/model_validation.py read
it like the public tables.

Where the ranks run:
- default: the trainer under torchrun, 8 gloo ranks on CPU on this one machine (one node);
- `--slurm --nodes N`: a local Slurm cluster of N nodes started for the table and stopped after it
  (tests/slurm_cluster.py: each node a network namespace with 2 advertised CPUs, links between
  nodes shaped to `--inter-node-mbit` or left unshaped; all nodes share this machine's cores).
  Each layout is one Slurm job (tuner/dispatch/slurm.py), one at a time, ranks in blocks per node
  (trainer/contract/topology.py); `notes` adds where the ranks landed (topology.summary).
The `gpu_type` column names the cluster; bench/validation_data.py CLUSTERS has its spec.

`--report CSV...` reads finished tables instead: per table the measured best layout and its
placement, where the uncalibrated performance model (default constants, the table's cluster spec)
ranks it among all layouts, Spearman rho of predicted vs measured step time, and the noise: how
two repeats of the same layout differ, and rho between the first and the second repeat.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as dt
import json
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig, BenchmarkResult
from trainer.contract.topology import summary
from trainer.launch import run_local
from tuner.cost.experts import measured_imbalance
from tuner.space import SearchSpace
from tuner.spec import SpaceSpec

ROOT = Path(__file__).resolve().parent.parent

COLUMNS = ["source", "table_id", "model_name", "num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "seq_len", "vocab_size", "global_batch_size", "num_gpus", "gpu_type", "gpus_per_node", "tp", "pp", "dp", "micro_batch_size", "grad_accum_steps", "activation_checkpoint", "zero_stage", "framework", "measured_metric_name", "measured_value", "status", "alt_metric_name", "alt_value", "peak_memory_gb", "notes"]  # fmt: skip
# Our tables add one column to the shared format: 2D tensor parallelism's column degree (tp_col;
# num_gpus = tp x tp_col x pp x dp). bench/validation_data.py reads it as 1 where it is absent.
OWN_COLUMNS = [*COLUMNS, "tp_col"]
# A mixture of experts' table adds two more: expert parallelism's degree (ep, folded into dp x tp:
# num_gpus stays tp x pp x dp) and the model as JSON (model_config: ModelConfig.to_dict, the experts'
# fields the shared columns have no place for). bench/validation_data.py reads both where present.
MOE_COLUMNS = [*OWN_COLUMNS, "ep", "model_config"]
# A context-parallel table adds cp (each sequence split over cp ranks: num_gpus = tp x tp_col x pp x
# dp x cp, the batch still micro-batch x grad_accum x dp) to those: its Llama-style model (GQA, SwiGLU,
# RoPE) has no shared column either, so model_config says it; ep stays 1 for a dense model.
CP_COLUMNS = [*MOE_COLUMNS, "cp"]
# A pipeline-schedule table adds the schedule and its stages a rank (bench/validation_data.py reads
# them where present, the framework column's "interleaved pipeline chunks" otherwise).
SCHEDULE_COLUMNS = [*MOE_COLUMNS, "pp_schedule", "virtual_stages"]
# Every column table_row fills (a table's writer keeps those of its header: table_columns).
ROW_COLUMNS = [*CP_COLUMNS, "pp_schedule", "virtual_stages"]
SPACE = SpaceSpec(tp=[1, 2, 4], pp=[1, 2, 4], micro_batch_size=[1, 2, 4], zero_stage=[0, 3],
                  activation_checkpoint=["none"], sequence_parallel=[False], pp_schedule=["1f1b"])  # fmt: skip
# `--space column`: strong scaling, where 2D tensor parallelism could win. With a global batch of
# 2-4 sequences on 8 ranks, data parallelism and pipelining run out of sequences, so every layout
# splits the weights over 2-8 ranks, and on the 4-node cluster that group crosses nodes: 1D as
# Megatron's tp, or 2D as tp x tp_col (the column pairs inside a node, the row group across).
COLUMN_SPACE = SpaceSpec(tp=[1, 2, 4, 8], tp_col=[1, 2, 4, 8], pp=[1, 2], micro_batch_size=[1, 2], zero_stage=[0],
                         activation_checkpoint=["none"], sequence_parallel=[False], pp_schedule=["1f1b"])  # fmt: skip
# `--space moe` (a mixture of experts, e.g. --model moe-small): expert parallelism 1-8 folded into
# dp x tp, inside a node (ep 2: the node's 2 ranks) or across 2-4 nodes (ep 4, 8), against FSDP or
# replicated dense weights, tp 1-2 (SP, as EP with TP needs) and pp 1-2, at micro-batch 2.
MOE_SPACE = SpaceSpec(tp=[1, 2], pp=[1, 2], ep=[1, 2, 4, 8], micro_batch_size=[2], zero_stage=[0, 3],
                      activation_checkpoint=["none"], sequence_parallel=[False, True], pp_schedule=["1f1b"],
                      allow_cross_node_ep=True)  # fmt: skip
# `--space cp` (a long sequence, e.g. --model llama-tiny --seq-len 2048, so attention dominates):
# context parallelism 1-8 against tp 1-2 (with SP) and data parallelism, dense weights replicated or
# FSDP-sharded (ZeRO-3 over dp x cp), pp 1, micro-batch 1: with a global batch of 8 sequences, dp 8
# down to 1 (cp 8: every sequence over all ranks, 8 micro-batches). On the 4-node cluster cp 4-8
# (and cp 2 with tp 2) cross nodes: every layer's K/V gather on the shaped links.
CP_SPACE = SpaceSpec(tp=[1, 2], pp=[1], cp=[1, 2, 4, 8], micro_batch_size=[1], zero_stage=[0, 3],
                     activation_checkpoint=["none"], sequence_parallel=[True], pp_schedule=["1f1b"])  # fmt: skip
# `--space schedule` (a mixture of experts of 8 layers, e.g. --model moe-small --num-layers 8): the
# pipeline schedules side by side, 1F1B, interleaved 1F1B over 2 stages a rank and the V schedules
# (ZBV, DualPipeV: 2 stages a rank in a V, the backward split into its input and weight halves),
# at pp 2 (dp 4) and pp 4 (dp 2) with ep 1-2, micro-batch 1 (4 or 8 micro-batches: the V schedules
# need 2 pp).
SCHEDULE_SPACE = SpaceSpec(tp=[1], pp=[2, 4], ep=[1, 2], micro_batch_size=[1], zero_stage=[0],
                           activation_checkpoint=["none"], sequence_parallel=[False],
                           pp_schedule=["1f1b", "interleaved_1f1b", "zbv", "dualpipev"], virtual_stages=[2],
                           allow_cross_node_ep=True)  # fmt: skip
SPACES = {
    "default": SPACE,
    "column": COLUMN_SPACE,
    "moe": MOE_SPACE,
    "cp": CP_SPACE,
    "schedule": SCHEDULE_SPACE,
}
RANKS_PER_NODE = 2  # scripts/slurm-local.sh advertises 2 CPUs on each node of a multi-node cluster
TRIAL_TIMEOUT_S = 600  # a layout across 200 Mbit/s links takes 1-2 s per step; start-up ~20 s
INFRA_ATTEMPTS = 3  # a job lost to the cluster (not the layout) runs again, at most this often

Runner = Callable[[BenchmarkConfig, Path], BenchmarkResult]


def table_columns(model: ModelConfig, space: str) -> list[str]:
    """A table's header: the shared columns plus tp_col, ep and the model for a mixture of experts,
    cp (and ep and the model) for the context-parallel space."""
    if space == "cp":
        return CP_COLUMNS
    if space == "schedule":
        return SCHEDULE_COLUMNS
    return MOE_COLUMNS if model.moe else OWN_COLUMNS  # a mixture of experts' rows add the experts' columns


def cluster_label(num_nodes: int, inter_node_mbit: int | None) -> str:
    """The `gpu_type` of a table: bench/validation_data.py CLUSTERS maps it to a cluster spec."""
    if num_nodes == 1:
        return "CPU ranks, gloo (2-core VM)"
    links = f"{inter_node_mbit} Mbit/s links" if inter_node_mbit else "unshaped links"
    return f"CPU ranks, gloo, {num_nodes} nodes x {RANKS_PER_NODE} (2-core VM, {links})"


def row_status(results: list[BenchmarkResult]) -> str:
    if all(r.ok for r in results):
        return "ok"
    return "oom" if any(r.status == "oom" for r in results) else "fail"


def table_row(
    layout: ParallelConfig, cfg: BenchmarkConfig, results: list[BenchmarkResult], *, model_name: str,
    table_id: str, source: str, gpu_type: str, gpus_per_node: int, with_placement: bool,
) -> dict[str, object]:  # fmt: skip
    """One layout's CSV row from its repeated runs: the median of the per-run median step times.
    Every column of ROW_COLUMNS; a table's writer keeps those of its header (table_columns)."""
    model, ok = cfg.model, [r for r in results if r.ok]
    times = [statistics.median(r.step_times_s) for r in ok]
    status = row_status(results)
    notes = (f"median step time of {len(results)} runs x {cfg.measure_steps} measured steps; per-run medians "
             + ", ".join(f"{t:.4f}" for t in times))  # fmt: skip
    if with_placement and ok:
        placed = ok[0].placement
        rule = "" if placed.get("follows_rule") else " (NOT the placement rule's)"
        notes += f"; placement: {summary(placed)}{rule}"
    if imbalances := [i for r in ok if (i := measured_imbalance(r.to_dict())) is not None]:
        notes += (
            "; routed imbalance (max / mean tokens per expert; median over steps, mean over layers) per run: "
        )
        notes += ", ".join(f"{i:.3f}" for i in imbalances)
    if status != "ok":
        notes += "; " + "; ".join(f"{r.status}: {r.error.strip()[-200:]}" for r in results if not r.ok)
    return {
        "source": source, "table_id": table_id, "model_name": f"{model_name} (L{model.num_layers} h{model.hidden_size})",
        "num_layers": model.num_layers, "hidden_size": model.hidden_size, "num_heads": model.num_heads,
        "ffn_hidden_size": model.ffn_size, "seq_len": model.seq_len, "vocab_size": model.vocab_size,
        "global_batch_size": layout.global_batch_size, "num_gpus": layout.world_size,
        "gpu_type": gpu_type, "gpus_per_node": gpus_per_node, "tp": layout.tp, "tp_col": layout.tp_col, "pp": layout.pp,
        "dp": layout.dp, "micro_batch_size": layout.micro_batch_size, "grad_accum_steps": layout.num_microbatches,
        "activation_checkpoint": ("yes" if layout.activation_checkpoint == "full" else "no")
        + (", sequence parallel" if layout.sequence_parallel else ""),
        "zero_stage": layout.zero_stage, "framework": "parallel-tuner trainer (torch 2.13 gloo), fp32",
        "measured_metric_name": "iteration_time_s",
        "measured_value": f"{statistics.median(times):.5f}" if status == "ok" else "", "status": status,
        "alt_metric_name": "tokens_per_s" if ok else "", "alt_value": f"{ok[0].tokens_per_s:.1f}" if ok else "",
        "peak_memory_gb": f"{max(r.peak_memory_bytes for r in ok) / 1e9:.5f}" if ok else "",
        "notes": notes,
        "ep": layout.ep, "cp": layout.cp, "model_config": json.dumps(model.to_dict()),
        "pp_schedule": layout.pp_schedule, "virtual_stages": layout.virtual_stages,
    }  # fmt: skip


@contextmanager
def slurm_runner(num_nodes: int, inter_node_mbit: int | None) -> Iterator[Runner]:
    """A local Slurm cluster of `num_nodes` for the table's lifetime; each run one job on it."""
    from tests.slurm_cluster import slurm_cluster
    from trainer.contract.trial_dir import read_result
    from tuner.dispatch.sbatch import SiteSettings
    from tuner.dispatch.slurm import SlurmDispatcher
    from tuner.outcome import FailureKind
    from tuner.spec import SlurmSpec

    with slurm_cluster(nodes=num_nodes, inter_node_mbit=inter_node_mbit) as cluster:
        # The dispatcher runs sbatch/sacct in this process's environment.
        os.environ.update({key: cluster.env[key] for key in ("SLURM_CONF", "PATH")})
        # eth0: each node's own interface in its namespace (docs/slurm.md, "What a real site must set").
        dispatcher = SlurmDispatcher(spec=SlurmSpec(partition="debug"), site=SiteSettings(socket_ifname="eth0"),
                                     gpus_per_node=RANKS_PER_NODE, min_interval_s=0.5, max_interval_s=2.0)  # fmt: skip

        def run(cfg: BenchmarkConfig, work_dir: Path) -> BenchmarkResult:
            for attempt in range(1, INFRA_ATTEMPTS + 1):
                job = dispatcher.submit(cfg, name=f"{work_dir.name}-{attempt}", work_dir=work_dir / str(attempt),
                                        timeout_s=TRIAL_TIMEOUT_S)  # fmt: skip
                while not (report := dispatcher.poll(job)).done:
                    time.sleep(0.5)
                outcome = report.outcome
                if outcome.failure != FailureKind.INFRA:
                    break
                print(f"  infrastructure failure, attempt {attempt}: {outcome.message}", flush=True)
            if (result := read_result(job.work_dir)) is not None:
                return result
            status = {FailureKind.OOM: "oom", FailureKind.TIMEOUT: "timeout"}.get(outcome.failure, "error")
            return BenchmarkResult(status=status, error=outcome.message)

        yield run


def _per_run_medians(notes: str) -> list[float]:
    m = re.search(r"per-run medians ([0-9., ]+)", notes)
    return [float(t) for t in m[1].rstrip(", ").split(", ")] if m else []


def measured_layouts(path: Path) -> set[str]:
    """The layouts (ParallelConfig.describe()) a finished table has rows for."""
    from bench.priors import inputs
    from bench.validation_data import load_csv

    return {inputs(r).parallel.describe() for r in load_csv(path)}


def report(path: Path) -> list[str]:
    """The lines `--report` prints for one table (see the module docstring)."""
    from scipy.stats import spearmanr

    from bench.priors import inputs, prior_imbalance
    from bench.validation_data import load_csv
    from tuner import perfmodel

    rows = load_csv(path)
    predicted = [perfmodel.estimate(m.model, m.parallel, m.cluster, m.precision, moe_imbalance=prior_imbalance(r)).step_time_s
                 for r, m in zip(rows, map(inputs, rows), strict=True)]  # fmt: skip
    ok = [(r, p) for r, p in zip(rows, predicted, strict=True) if r.status == "ok"]
    best, best_pred = min(ok, key=lambda rp: rp[0].iteration_time_s)
    t_best = best.iteration_time_s
    model_pick, _ = min(ok, key=lambda rp: rp[1])
    near = [p for r, p in ok if r.iteration_time_s <= 1.05 * t_best]
    placed = m[1] if (m := re.search(r"placement: ([^;]+)", best.notes)) else "not recorded"
    runs = [_per_run_medians(r.notes) for r, _ in ok]
    pairs = [(a[0], a[1]) for a in runs if len(a) >= 2]
    spreads = sorted(abs(a - b) / ((a + b) / 2) for a, b in pairs)
    rho = spearmanr([p for _, p in ok], [r.iteration_time_s for r, _ in ok]).statistic
    lines = [
        f"{path.stem}: {len(rows)} layouts, {len(ok)} ran; cluster {best.cluster['name']}",
        f"  measured best: {best.parallel.describe()} {t_best:.3f} s; placement {placed}",
        f"  uncalibrated model ranks it {1 + sum(p < best_pred for p in predicted)} of {len(rows)}; "
        f"the model's pick {model_pick.parallel.describe()} measured {model_pick.iteration_time_s:.3f} s "
        f"({model_pick.iteration_time_s / t_best:.2f} x best)",
        f"  {len(near)} layouts within 5 % of the best; the model's best rank among them: "
        f"{1 + sum(p < min(near) for p in predicted)}",
        f"  Spearman rho predicted vs measured over {len(ok)} layouts: {rho:.3f}",
    ]
    if imbalances := [float(i) for r, _ in ok if (m := re.search(r"per run: ([0-9., ]+)", r.notes))
                      for i in m[1].rstrip(", ").split(", ")]:  # fmt: skip
        lines.append(f"  routed imbalance measured: median {statistics.median(imbalances):.2f} "
                     f"({min(imbalances):.2f}-{max(imbalances):.2f}) over {len(imbalances)} runs; "
                     f"the model priced {prior_imbalance(best):.2f} (the study default)")  # fmt: skip
    if pairs:
        rerun = spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic
        lines.append(f"  repeats: |run1 - run2| / mean median {statistics.median(spreads):.1%}, "
                     f"max {spreads[-1]:.1%}; rho run 1 vs run 2 over {len(pairs)} layouts {rerun:.3f}")  # fmt: skip
    return lines + schedule_lines(ok)


def schedule_lines(ok: list[tuple[Any, float]]) -> list[str]:
    """A table of several pipeline schedules (`--space schedule`): per layout but its schedule,
    the schedules in measured and in predicted order, and each against 1F1B, measured / predicted."""
    groups: dict[str, list[tuple[str, float, float]]] = {}
    for r, p in ok:
        c = r.parallel
        if c.pp > 1:
            key = dataclasses.replace(c, pp_schedule="1f1b", virtual_stages=1).describe()
            groups.setdefault(key, []).append((c.pp_schedule, r.iteration_time_s, p))
    lines = []
    for key, rows in groups.items():
        base = next(((t, p) for s, t, p in rows if s == "1f1b"), None)
        if len(rows) < 2 or base is None:
            continue
        measured = " < ".join(s for s, _, _ in sorted(rows, key=lambda x: x[1]))
        predicted = " < ".join(s for s, _, _ in sorted(rows, key=lambda x: x[2]))
        ratios = ", ".join(f"{s} {t / base[0]:.2f} / {p / base[1]:.2f}" for s, t, p in rows if s != "1f1b")
        lines.append(f"  {key}: measured {measured}; predicted {predicted}; "
                     f"x 1F1B measured / predicted: {ratios}")  # fmt: skip
    return ["  schedules, per layout but its schedule:", *lines] if lines else []


@contextmanager
def local_runner() -> Iterator[Runner]:
    yield lambda cfg, work_dir: run_local(cfg, work_dir, timeout_s=300)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--report", type=Path, nargs="+", metavar="CSV", help="report on finished tables")
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--measure-steps", type=int, default=5)
    parser.add_argument("--slurm", action="store_true", help="run on a local Slurm cluster (needs root)")
    parser.add_argument("--nodes", type=int, default=4, help="with --slurm: nodes of 2 ranks each")
    parser.add_argument("--inter-node-mbit", type=int, help="with --slurm: shape links between nodes")
    parser.add_argument(
        "--space",
        choices=sorted(SPACES),
        default="default",
        help="the layouts: default, column (strong scaling with 2D tensor parallelism), moe (expert "
        "parallelism), cp (context parallelism) or schedule (pipeline schedules)",
    )
    parser.add_argument("--seq-len", type=int, help="the model's sequence length, for the preset's (e.g. cp)")
    parser.add_argument("--num-layers", type=int, help="the model's layers, for the preset's (e.g. schedule)")
    parser.add_argument(
        "--add-missing",
        action="store_true",
        help="keep --out's rows and measure only the space's layouts it lacks (a space that grew)",
    )
    args = parser.parse_args()
    if args.report:
        for path in args.report:
            print("\n".join(report(path)))
        return
    if args.out is None:
        parser.error("--out is required (or --report)")
    if not args.slurm and args.inter_node_mbit:
        parser.error("--inter-node-mbit needs --slurm")
    if args.slurm and args.ranks != args.nodes * RANKS_PER_NODE:
        parser.error(f"--ranks {args.ranks} != --nodes {args.nodes} x {RANKS_PER_NODE} ranks per node")
    model = MODEL_PRESETS[args.model]
    if args.seq_len:
        model = dataclasses.replace(model, seq_len=args.seq_len)
    if args.num_layers:
        model = dataclasses.replace(model, num_layers=args.num_layers)
    gpus_per_node = RANKS_PER_NODE if args.slurm else args.ranks
    layouts = (
        SearchSpace(model, args.ranks, gpus_per_node, args.global_batch, SPACES[args.space]).enumerate().valid
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    num_nodes = args.nodes if args.slurm else 1
    meta = {
        "model_name": args.model, "table_id": args.out.stem,
        "source": f"parallel-tuner@{commit}:bench/measure_table.py ({dt.date.today()}, {platform.node()})",
        "gpu_type": cluster_label(num_nodes, args.inter_node_mbit),
        "gpus_per_node": RANKS_PER_NODE if args.slurm else args.ranks, "with_placement": args.slurm,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    appending = args.add_missing and args.out.exists()
    if appending:
        done = measured_layouts(args.out)
        layouts = [c for c in layouts if c.describe() not in done]
    print(f"{len(layouts)} layouts x {args.repeats} repeats on {meta['gpu_type']} -> {args.out}", flush=True)
    runner = slurm_runner(args.nodes, args.inter_node_mbit) if args.slurm else local_runner()
    started = time.monotonic()
    # Every node of the local cluster sees this machine's /tmp: the jobs' shared work dir.
    with (
        args.out.open("a" if appending else "w", newline="") as f,
        tempfile.TemporaryDirectory() as tmp,
        runner as run,
    ):
        writer = csv.DictWriter(f, table_columns(model, args.space), extrasaction="ignore")
        if not appending:
            writer.writeheader()
        for i, layout in enumerate(layouts):
            cfg = BenchmarkConfig(model=model, parallel=layout, warmup_steps=args.warmup_steps,
                                  measure_steps=args.measure_steps, device="cpu")  # fmt: skip
            results = [run(cfg, Path(tmp) / f"{i}-{r}") for r in range(args.repeats)]
            writer.writerow(table_row(layout, cfg, results, **meta))
            f.flush()
            times = [statistics.median(r.step_times_s) if r.ok else r.status for r in results]
            print(f"{i + 1}/{len(layouts)} {layout.describe()}: {row_status(results)} {times} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
