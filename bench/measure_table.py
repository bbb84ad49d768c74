"""Measure a ground-truth table on this machine: every valid layout of a small GPT, run for real.

    .venv/bin/python bench/measure_table.py --out bench/own_tables/own_gpt-tiny_8rank_gbs16.csv [--repeats 2]

Every valid layout of the space below (the trainer under torchrun, 8 gloo ranks on CPU), each run
`repeats` times; the row keeps the median iteration time and says the spread in `notes`. Written
in the column format of shared/data/validation/README.md, so bench/search_efficiency.py and
bench/model_validation.py read it like the public tables.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.config import MODEL_PRESETS, BenchmarkConfig  # noqa: E402
from trainer.launch import run_local  # noqa: E402
from tuner.space import SearchSpace  # noqa: E402
from tuner.spec import SpaceSpec  # noqa: E402

COLUMNS = ["source", "table_id", "model_name", "num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "seq_len", "vocab_size", "global_batch_size", "num_gpus", "gpu_type", "gpus_per_node", "tp", "pp", "dp", "micro_batch_size", "grad_accum_steps", "activation_checkpoint", "zero_stage", "framework", "measured_metric_name", "measured_value", "status", "alt_metric_name", "alt_value", "peak_memory_gb", "notes"]  # fmt: skip
SPACE = SpaceSpec(tp=[1, 2, 4], pp=[1, 2, 4], micro_batch_size=[1, 2, 4], zero_stage=[0, 3],
                  activation_checkpoint=["none"], sequence_parallel=[False], pp_schedule=["1f1b"])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = MODEL_PRESETS[args.model]
    layouts = SearchSpace(model, args.ranks, args.ranks, args.global_batch, SPACE).enumerate().valid
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    table_id = args.out.stem
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{len(layouts)} layouts x {args.repeats} repeats -> {args.out}", flush=True)
    with args.out.open("w", newline="") as f, tempfile.TemporaryDirectory() as tmp:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for i, layout in enumerate(layouts):
            cfg = BenchmarkConfig(model=model, parallel=layout, warmup_steps=2, measure_steps=5, device="cpu")
            results = [run_local(cfg, Path(tmp) / f"{i}-{r}", timeout_s=300) for r in range(args.repeats)]
            ok = [r for r in results if r.ok]
            times = [statistics.median(r.step_times_s) for r in ok]
            status = (
                "ok"
                if len(ok) == len(results)
                else ("oom" if any(r.status == "oom" for r in results) else "fail")
            )
            writer.writerow({
                "source": f"parallel-tuner@{commit}:bench/measure_table.py ({dt.date.today()}, {platform.node()})",
                "table_id": table_id, "model_name": f"{args.model} (L{model.num_layers} h{model.hidden_size})",
                "num_layers": model.num_layers, "hidden_size": model.hidden_size, "num_heads": model.num_heads,
                "ffn_hidden_size": model.ffn_size, "seq_len": model.seq_len, "vocab_size": model.vocab_size,
                "global_batch_size": args.global_batch, "num_gpus": args.ranks,
                "gpu_type": "CPU ranks, gloo (2-core VM)", "gpus_per_node": args.ranks, "tp": layout.tp, "pp": layout.pp,
                "dp": layout.dp, "micro_batch_size": layout.micro_batch_size, "grad_accum_steps": layout.num_microbatches,
                "activation_checkpoint": "yes" if layout.activation_checkpoint == "full" else "no",
                "zero_stage": layout.zero_stage, "framework": "parallel-tuner trainer (torch 2.13 gloo), fp32",
                "measured_metric_name": "iteration_time_s",
                "measured_value": f"{statistics.median(times):.5f}" if status == "ok" else "", "status": status,
                "alt_metric_name": "tokens_per_s" if ok else "", "alt_value": f"{ok[0].tokens_per_s:.1f}" if ok else "",
                "peak_memory_gb": f"{max(r.peak_memory_bytes for r in ok) / 1e9:.5f}" if ok else "",
                "notes": f"median step time of {args.repeats} runs x 5 measured steps; per-run medians "
                         + ", ".join(f"{t:.4f}" for t in times),
            })  # fmt: skip
            f.flush()
            print(f"{i + 1}/{len(layouts)} {layout.describe()}: {status} {times}", flush=True)


if __name__ == "__main__":
    main()
