"""Our trainer at tp1 pp1 dp1 against a plain PyTorch loop of the same model, batch and dtype.

    .venv/bin/python -m bench.trainer_overhead [--model small] [--mbs 8] [--steps 20] [--rounds 5]

Each round runs both variants, one after the other, in fresh child processes of this one (the
order alternates between rounds), so that machine noise hits both alike. Both time the same way:
device sync, perf_counter around each step, after the same number of warm-up steps; tokens/s is
tokens per step / median step time (the median, because one descheduled step on a shared machine
would otherwise decide the round). The ratio trainer / plain is what we report
(target >= 0.97: the trainer may not cost more than 3 %).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig

ROOT = Path(__file__).resolve().parent.parent


def bench_config(args: argparse.Namespace) -> BenchmarkConfig:
    return BenchmarkConfig(
        model=MODEL_PRESETS[args.model],
        parallel=ParallelConfig(micro_batch_size=args.mbs),
        warmup_steps=args.warmup,
        measure_steps=args.steps,
        device=args.device,
    )


def run_trainer(cfg: BenchmarkConfig) -> float:
    from trainer.benchmark import run

    result = run(cfg)
    assert result.ok, result.error
    return cfg.tokens_per_step / statistics.median(result.step_times_s)


def run_plain(cfg: BenchmarkConfig) -> float:
    """What someone would write by hand: model, AdamW, forward, loss, backward, clip, step."""
    import torch
    import torch.nn.functional as F

    from trainer.model import GPT

    device = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    model.init_weights(torch.Generator().manual_seed(cfg.seed))
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    low_precision = device.type == "cuda"
    b, s, v = cfg.parallel.micro_batch_size, cfg.model.seq_len, cfg.model.vocab_size
    times = []
    for step in range(cfg.warmup_steps + cfg.measure_steps):
        tokens = torch.randint(v, (b, s + 1), device=device)
        x, y = tokens[:, :-1], tokens[:, 1:]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=low_precision):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the trainer reads its loss back too
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= cfg.warmup_steps:
            times.append(time.perf_counter() - t0)
    return cfg.tokens_per_step / statistics.median(times)


def child(variant: str, cfg_json: str) -> None:
    cfg = BenchmarkConfig.from_json(cfg_json)
    tokens_per_s = run_trainer(cfg) if variant == "trainer" else run_plain(cfg)
    print(json.dumps({"variant": variant, "tokens_per_s": tokens_per_s}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gpt-small", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--mbs", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--child", choices=["trainer", "plain"], help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.config)
        return

    cfg = bench_config(args)
    measured: dict[str, list[float]] = {"trainer": [], "plain": []}
    for r in range(args.rounds):
        order = ["trainer", "plain"] if r % 2 == 0 else ["plain", "trainer"]
        for variant in order:
            cmd = [
                sys.executable,
                "-m",
                "bench.trainer_overhead",
                "--child",
                variant,
                "--config",
                cfg.to_json(),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
            measured[variant].append(json.loads(out.strip().splitlines()[-1])["tokens_per_s"])
        print(
            f"round {r + 1}: trainer {measured['trainer'][-1]:.0f}  plain {measured['plain'][-1]:.0f} tokens/s"
        )
    ratios = [t / p for t, p in zip(measured["trainer"], measured["plain"], strict=True)]
    median = {k: statistics.median(v) for k, v in measured.items()}
    print(
        f"\nmodel {args.model} ({cfg.model.num_params / 1e6:.1f}M params), mbs {args.mbs}, seq "
        f"{cfg.model.seq_len}, {args.device}, {args.steps} steps x {args.rounds} rounds, "
        f"{platform.processor() or platform.machine()}"
    )
    print(f"median tokens/s: trainer {median['trainer']:.0f}, plain {median['plain']:.0f}")
    print(
        f"ratio trainer/plain: median of per-round ratios {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}); ratio of medians "
        f"{median['trainer'] / median['plain']:.3f}"
    )


if __name__ == "__main__":
    main()
