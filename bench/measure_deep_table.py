"""Measure our third own table: a deeper GPT on 8 CPU ranks, where pp = 8 and full activation
checkpointing are in the space (issue 13; held out from the CPU defaults, bench/priors.py).

    flock /tmp/parallel-tuner-measure.lock .venv/bin/python -m bench.measure_deep_table \\
        --out bench/own_tables/own_gpt-deep_8rank_gbs16.csv --repeats 2

`gpt-deep`: 16 layers, hidden 64, 4 heads, seq 32, vocabulary 1024 (a multiple of 128 x 8, so no
layout pads it): gpt-tiny's width, four times its depth, so a pipeline of 8 stages holds 2
layers each. Every valid layout of DEEP_SPACE (tp 1/2/4 x pp 1/2/4/8 x micro-batch 1/2/4 x ZeRO
0/3 x checkpointing none/full, 1F1B), each run `repeats` times (2 warm-up + 5 measured steps) by
the trainer under torchrun, 8 gloo ranks on this machine; the row keeps the median of the per-run
median step times and lists them in `notes`. The column format and cluster (`gpu_type`) are those
of bench/measure_table.py's tables, so the benchmarks read it like the others.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.measure_table import OWN_COLUMNS
from trainer.contract.model import ModelConfig
from trainer.contract.result import BenchmarkConfig
from trainer.launch import run_local
from tuner.space import SearchSpace
from tuner.spec import SpaceSpec, padded_model

ROOT = Path(__file__).resolve().parent.parent

MODEL_NAME = "gpt-deep"
MODEL = ModelConfig(num_layers=16, hidden_size=64, num_heads=4, vocab_size=1024, seq_len=32)
DEEP_SPACE = SpaceSpec(tp=[1, 2, 4], pp=[1, 2, 4, 8], micro_batch_size=[1, 2, 4], zero_stage=[0, 3],
                       activation_checkpoint=["none", "full"], sequence_parallel=[False], pp_schedule=["1f1b"])  # fmt: skip
GPU_TYPE = "CPU ranks, gloo (2-core VM)"  # bench/validation_data.py CLUSTERS: the cpu-local spec
WARMUP_STEPS, MEASURE_STEPS = 2, 5


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    layouts = SearchSpace(MODEL, args.ranks, args.ranks, args.global_batch, DEEP_SPACE).enumerate().valid
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    source = f"parallel-tuner@{commit}:bench/measure_deep_table.py ({dt.date.today()}, {platform.node()})"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{len(layouts)} layouts x {args.repeats} repeats -> {args.out}", flush=True)
    start = time.monotonic()
    with args.out.open("w", newline="") as f, tempfile.TemporaryDirectory() as tmp:
        writer = csv.DictWriter(f, OWN_COLUMNS)
        writer.writeheader()
        for i, layout in enumerate(layouts):
            model = padded_model(MODEL, layout.tp)  # what the tuner's trials build (here: unchanged)
            cfg = BenchmarkConfig(model=model, parallel=layout, warmup_steps=WARMUP_STEPS,
                                  measure_steps=MEASURE_STEPS, device="cpu")  # fmt: skip
            results = [run_local(cfg, Path(tmp) / f"{i}-{r}", timeout_s=600) for r in range(args.repeats)]
            ok = [r for r in results if r.ok]
            times = [statistics.median(r.step_times_s) for r in ok]
            status = (
                "ok"
                if len(ok) == len(results)
                else "oom"
                if any(r.status == "oom" for r in results)
                else "fail"
            )
            notes = (f"median step time of {args.repeats} runs x {MEASURE_STEPS} measured steps; per-run medians "
                     + ", ".join(f"{t:.4f}" for t in times))  # fmt: skip
            if status != "ok":
                notes += "; " + "; ".join(
                    f"{r.status}: {r.error.strip()[-200:]}" for r in results if not r.ok
                )
            writer.writerow({
                "source": source, "table_id": args.out.stem,
                "model_name": f"{MODEL_NAME} (L{model.num_layers} h{model.hidden_size})",
                "num_layers": model.num_layers, "hidden_size": model.hidden_size, "num_heads": model.num_heads,
                "ffn_hidden_size": model.ffn_size, "seq_len": model.seq_len, "vocab_size": model.vocab_size,
                "global_batch_size": args.global_batch, "num_gpus": args.ranks, "gpu_type": GPU_TYPE,
                "gpus_per_node": args.ranks, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                "micro_batch_size": layout.micro_batch_size, "grad_accum_steps": layout.num_microbatches,
                "activation_checkpoint": "yes" if layout.activation_checkpoint == "full" else "no",
                "zero_stage": layout.zero_stage, "framework": "parallel-tuner trainer (torch 2.13 gloo), fp32",
                "measured_metric_name": "iteration_time_s",
                "measured_value": f"{statistics.median(times):.5f}" if status == "ok" else "", "status": status,
                "alt_metric_name": "tokens_per_s" if ok else "", "alt_value": f"{ok[0].tokens_per_s:.1f}" if ok else "",
                "peak_memory_gb": f"{max(r.peak_memory_bytes for r in ok) / 1e9:.5f}" if ok else "", "notes": notes,
            })  # fmt: skip
            f.flush()
            print(f"{i + 1}/{len(layouts)} {layout.describe()}: {status} {times} "
                  f"({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
