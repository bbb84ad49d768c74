"""What torch's split backward (the V schedules' input and weight halves) costs beyond one whole
backward, per layer and micro-batch, on this machine's CPU.

    .venv/bin/python -m bench.split_backward [--model moe-small] [--layers 2] [--repeats 30]

A middle pipeline stage of `--layers` layers (trainer/pipeline.py split_model) runs a forward of
one micro-batch, then either torch.distributed.pipelining's whole backward (stage_backward) or its
two halves (stage_backward_input, then stage_backward_weight: the walk of the autograd graph for
the weights' groups, the input half keeping the graph for the weight half). Each variant is timed
`--repeats` times in alternation (a pair at a time, the order flipped every pair); reported: the
medians and the difference per layer, the price tuner/cost's `split_backward_s` takes (ModelConstants).
One process, one thread (as a trial's rank runs: docs/slurm.md, "Threads per rank").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

from trainer.contract.presets import MODEL_PRESETS
from trainer.model import GPT
from trainer.pipeline import split_model


def timed(stage: torch.nn.Module, x: torch.Tensor, split: bool) -> float:
    inp = x.detach().requires_grad_()
    out = stage(inp)
    grad = torch.ones_like(out)
    start = time.perf_counter()
    if split:
        _, groups = stage_backward_input([out], [grad], [inp], stage.parameters())
        stage_backward_weight(stage.parameters(), groups)
    else:
        stage_backward(out, grad, [inp])
    seconds = time.perf_counter() - start
    stage.zero_grad(set_to_none=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="moe-small")
    parser.add_argument("--layers", type=int, default=2, help="the stage's layers")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--experts", type=int, help="the experts a rank runs, for the preset's (ep: E / ep)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = dataclasses.replace(MODEL_PRESETS[args.model], num_layers=3 * args.layers)
    if args.experts:
        cfg = dataclasses.replace(cfg, num_experts=args.experts)
    full = GPT(cfg)
    full.init_weights(torch.Generator().manual_seed(0))
    stage = split_model(full, 1, 3)  # a middle stage: its input needs a gradient
    x = torch.randn(args.micro_batch, cfg.seq_len, cfg.hidden_size)
    for split in (False, True):  # warm-up
        timed(stage, x, split)
    whole, halves = [], []
    for i in range(args.repeats):
        for split in (i % 2 == 0, i % 2 == 1):
            (halves if split else whole).append(timed(stage, x, split))
    w, h = statistics.median(whole), statistics.median(halves)
    print(f"{args.model}, {args.layers} layers, micro-batch {args.micro_batch} x {cfg.seq_len} tokens, "
          f"{args.repeats} pairs, torch {torch.__version__}")  # fmt: skip
    print(f"whole backward: median {w * 1e3:.2f} ms (min {min(whole) * 1e3:.2f}, max {max(whole) * 1e3:.2f})")
    print(
        f"input + weight halves: median {h * 1e3:.2f} ms (min {min(halves) * 1e3:.2f}, max {max(halves) * 1e3:.2f})"
    )
    print(
        f"split - whole: {(h - w) * 1e3:.2f} ms, {(h - w) / args.layers * 1e3:.2f} ms per layer ({h / w:.2f} x)"
    )


if __name__ == "__main__":
    main()
