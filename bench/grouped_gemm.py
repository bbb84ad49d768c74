"""The experts' grouped GEMMs on one GPU against the model's expert GEMM efficiency n / (n + ridge)
(tuner/cost/experts.py expert_gemm_efficiency): a SwiGLU expert layer's forward (three torch._grouped_mm,
as trainer/moe.py GroupedExperts runs them) at n tokens per expert, its TFLOP/s over a large dense
bf16 GEMM's on the same GPU, beside n / (n + ridge) with the ridge the model takes for the device.

    python -m bench.grouped_gemm [--json OUT.json]

Needs a GPU with torch._grouped_mm (compute capability >= 9, bf16). Forward only: the backward's
data-gradient GEMMs have the forward's shapes; its weight gradients group over the token dimension
and are not timed here. Shapes: the local experts of Qwen3-30B-A3B at ep 8 (16 of 128, h 2048,
ffn 768), DeepSeek-V3 at ep 8 (32 of 256, h 7168, ffn 2048) and Mixtral-8x7B at ep 8 (1 of 8,
h 4096, ffn 14336).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.moe import GROUPED_MM_ALIGN

SHAPES = {  # name: (local experts, hidden, expert ffn)
    "qwen3-30b-a3b ep8": (16, 2048, 768),
    "deepseek-v3 ep8": (32, 7168, 2048),
    "mixtral-8x7b ep8": (1, 4096, 14336),
}
TOKENS_PER_EXPERT = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def timed(fn, iters: int = 20) -> float:
    """Seconds per call, CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def dense_rate() -> float:
    """FLOP/s of an 8192^3 bf16 GEMM: the compute-bound rate the model's dense efficiency is of."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / timed(lambda: a @ b)


def expert_rate(experts: int, hidden: int, ffn: int, n: int) -> float:
    """FLOP/s of a SwiGLU expert layer's forward at n tokens for each of `experts` experts."""
    rows = -(-n // GROUPED_MM_ALIGN) * GROUPED_MM_ALIGN
    x = torch.randn(experts * rows, hidden, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(experts, hidden, ffn, device="cuda", dtype=torch.bfloat16) * 0.02
    w3 = torch.randn(experts, hidden, ffn, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, ffn, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    offs = torch.full((experts,), rows, device="cuda", dtype=torch.int32).cumsum(0).to(torch.int32)

    def layer() -> torch.Tensor:
        h = F.silu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)
        return torch._grouped_mm(h, w2, offs=offs)

    return 3 * 2 * experts * n * hidden * ffn / timed(layer)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument(
        "--ridge", type=float, help="the model's ridge in tokens (default: peak / HBM of the device)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("bench/grouped_gemm.py needs a GPU of compute capability >= 9 (torch._grouped_mm in bf16)")
    name = torch.cuda.get_device_name()
    # tuner/cost/experts.py ridge_tokens: peak FLOP/s over HBM bytes/s of the device (H100 SXM
    # 989 TFLOP/s over 3.35 TB/s, H200 over 4.8 TB/s)
    ridge = args.ridge or (989.4e12 / (4.8e12 if "H200" in name else 3.35e12))
    dense = dense_rate()
    print(
        f"{name}, torch {torch.__version__}: dense 8192^3 bf16 GEMM {dense / 1e12:.1f} TFLOP/s; ridge {ridge:.0f}"
    )
    print(
        "| experts (local x h x ffn) | tokens per expert | TFLOP/s | measured / dense | model n/(n+ridge) |"
    )
    print("| --- | --- | --- | --- | --- |")
    rows = []
    for label, (experts, hidden, ffn) in SHAPES.items():
        for n in TOKENS_PER_EXPERT:
            rate = expert_rate(experts, hidden, ffn, n)
            model = n / (n + ridge)
            rows.append({"shape": label, "experts": experts, "hidden": hidden, "ffn": ffn, "tokens_per_expert": n,
                         "tflops": rate / 1e12, "ratio": rate / dense, "model": model})  # fmt: skip
            print(f"| {label} ({experts} x {hidden} x {ffn}) | {n} | {rate / 1e12:.1f} | {rate / dense:.3f} | "
                  f"{model:.3f} |", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": name, "torch": torch.__version__, "dense_tflops": dense / 1e12,
                                         "ridge": ridge, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
