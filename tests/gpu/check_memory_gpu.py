"""Prepared GPU check of the memory oracle (not part of CI; one GPU): a real trial's
torch.cuda.max_memory_allocated against trainer/memcheck.py's fake-tensor simulation of the same
config ("cuda" mode: bf16, foreach AdamW, first two steps), dense and mixture of experts.

    PYTHONPATH=$PWD python3 tests/gpu/check_memory_gpu.py --real peaks.json      # on the GPU
    PYTHONPATH=$PWD python3 tests/gpu/check_memory_gpu.py --compare peaks.json   # the oracle, anywhere

(two steps: the GPU machine's torch 2.11 lacks a pipelining helper the oracle's fake world imports.)

One line per config: the real peak, the oracle's, and their difference (the oracle leaves out the
caching allocator's rounding to 512-byte blocks and cuBLAS's workspace, which the real peak holds).
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig

# An 8-layer Qwen3-30B-shaped mixture (tests/gpu/check_moe_gpu.py's): h 2048, 64 experts of 1024, top 8.
MID = dataclasses.replace(
    MODEL_PRESETS["moe-small"], num_layers=8, hidden_size=2048, num_heads=16, num_kv_heads=4, ffn_hidden_size=5632,
    num_experts=64, moe_top_k=8, moe_ffn_hidden_size=1024, vocab_size=32000, seq_len=2048,
)  # fmt: skip
CONFIGS = [  # label, model, parallel knobs
    ("moe-mid mbs2", MID, dict(micro_batch_size=2)),
    ("moe-mid mbs2 x2 full", MID, dict(micro_batch_size=2, num_microbatches=2, activation_checkpoint="full")),
    ("gpt-1.3b mbs4", MODEL_PRESETS["gpt-1.3b"], dict(micro_batch_size=4)),
    ("gpt-1.3b mbs4 full", MODEL_PRESETS["gpt-1.3b"], dict(micro_batch_size=4, activation_checkpoint="full")),
    ("moe-mid mbs4 selective", MID, dict(micro_batch_size=4, activation_checkpoint="selective")),
]


def config(model, knobs: dict) -> BenchmarkConfig:
    return BenchmarkConfig(
        model=model, parallel=ParallelConfig(**knobs), warmup_steps=1, measure_steps=2, device="cuda",
        dtype="bf16", moe_routing="balanced" if model.moe else "learned",
    )  # fmt: skip


def real_peaks(out: Path) -> None:
    """The real trials on the GPU: {label: max_memory_allocated} to `out`."""
    from trainer.benchmark import run

    print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    peaks = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    for label, model, knobs in CONFIGS:
        t0 = time.time()
        r = run(config(model, knobs))
        err = r.error.strip().splitlines()[-1] if r.error else ""
        print(
            f"{label}: {r.status} {err} peak {r.peak_memory_bytes / 2**30:.3f} GiB, {time.time() - t0:.0f} s",
            flush=True,
        )
        if r.status == "ok":
            peaks[label] = r.peak_memory_bytes
        out.write_text(json.dumps(peaks, indent=1))
        torch.cuda.empty_cache()


def compare(recorded: Path) -> None:
    """The oracle (this machine's torch, CPU fake tensors) against the recorded real peaks."""
    from trainer.memcheck import memcheck

    peaks = json.loads(recorded.read_text())
    print(f"real: {peaks['device']}, torch {peaks['torch']}; oracle: torch {torch.__version__}")
    print("| config | real peak (max_memory_allocated) | oracle | oracle - real |")
    print("| --- | --- | --- | --- |", flush=True)
    for label, model, knobs in CONFIGS:
        if label not in peaks:
            continue
        real, oracle = peaks[label], memcheck(config(model, knobs)).peak_bytes
        print(f"| {label} | {real / 2**30:.3f} GiB | {oracle / 2**30:.3f} GiB | {(oracle - real) / real:+.2%} "
              f"({(oracle - real) / 2**20:+.1f} MiB) |", flush=True)  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--real", type=Path, help="run the real trials on the GPU, write their peaks here")
    parser.add_argument("--compare", type=Path, help="simulate with the oracle, compare with these peaks")
    args = parser.parse_args()
    if args.real:
        real_peaks(args.real)
    if args.compare:
        compare(args.compare)
