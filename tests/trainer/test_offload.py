"""Activation offload (activation_checkpoint: offload, trainer/offload.py): which saved tensors go to
host memory, the rules that refuse what is not priced, and that one process trains the same with
it (multi-rank parity: tests/trainer/test_parity.py, tp2-dp2-sp-zero3-offload)."""

from __future__ import annotations

import torch
from torch import nn

from tests.trainer.helpers import MODELS, tiny_config
from trainer import offload
from trainer.benchmark import run
from trainer.contract.parallel import ParallelConfig as P


def _saved(module: nn.Module, x: torch.Tensor, autocast: bool = False) -> list[tuple[str, torch.Tensor]]:
    """(pack's verdict, tensor) for everything `module`'s forward saves."""
    seen = []

    def pack(t):
        packed = offload.pack(t)
        seen.append((packed[0], t))
        return packed

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, offload.unpack),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        module(x).sum().backward()
    return seen


def test_weights_stay_and_activations_go() -> None:
    """A linear saves its input (an activation: to host) and its weight (stays); under autocast the
    weight's bf16 cast (the autocast cache's, not a parameter) stays too, and so does an expert's
    slice of a stacked weight."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    for autocast in (False, True):
        saved = _saved(mlp, x, autocast)
        weights = [t for kind, t in saved if kind == "device"]
        moved = [t for kind, t in saved if kind == "host"]
        assert {tuple(t.shape) for t in weights} <= {(16, 8), (8, 16)}, saved
        assert len(weights) == 2 and moved, saved  # each linear's weight (or its cast) once
        assert all(t.shape[0] == 4 for t in moved)  # the batch's rows: activations
    stacked = nn.Parameter(torch.randn(3, 8, 8))
    tokens = torch.randn(5, 8, requires_grad=True)
    expert = _saved(lambda t: t @ stacked[1], tokens)
    assert sorted(kind for kind, _ in expert) == ["device", "host"]


def test_the_round_trip_gives_the_same_gradients() -> None:
    """What comes back from host memory is what was saved: gradients equal to the bit."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(4, 8)
    mlp(x).pow(2).sum().backward()
    plain = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack):
        mlp(x).pow(2).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, mlp.parameters(), strict=True))


def test_what_is_not_priced_is_refused_with_its_reason() -> None:
    model = MODELS["llama"]
    assert not P(tp=2, sequence_parallel=True, activation_checkpoint="offload").violations(model)
    interleaved = P(pp=2, virtual_stages=2, pp_schedule="interleaved_1f1b", num_microbatches=4,
                    activation_checkpoint="offload")  # fmt: skip
    assert "offload needs one stage a rank" in [r for r, _ in interleaved.violations(model)]
    column = P(tp=2, tp_col=2, activation_checkpoint="offload")
    assert "offload needs tp_col 1" in [r for r, _ in column.violations(model)]
    assert not P(cp=2, activation_checkpoint="offload").violations(model)


def test_one_process_trains_the_same_with_its_activations_offloaded() -> None:
    """The Llama block (rotary positions, GQA, SwiGLU) under autocast-free fp32 on one CPU rank:
    the losses and gradient norms of an offloaded run are those of a plain one, bit for bit."""
    runs = [
        run(tiny_config(P(micro_batch_size=4, num_microbatches=2, activation_checkpoint=ac), MODELS["llama"]))
        for ac in ("none", "offload")
    ]
    assert all(r.status == "ok" for r in runs), [r.error for r in runs]
    assert runs[0].losses == runs[1].losses and runs[0].grad_norms == runs[1].grad_norms
