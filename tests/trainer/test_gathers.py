"""How often FSDP2 gathers a rank's parameters in the trainer's step, counted on the memory
oracle's fake world (trainer/memcheck.py simulate_rank, one step of rank 0): what
tuner/cost/data.py prices. The tiny model has 5 FSDP2 units (4 blocks and the root)."""

from __future__ import annotations

import multiprocessing
from unittest import mock

import pytest
import torch.distributed as dist

from tests.trainer.helpers import tiny_config
from trainer.contract.parallel import ParallelConfig
from trainer.memcheck import simulate_rank

UNITS = 5


def _count(conn, parallel: ParallelConfig) -> None:
    calls = 0
    real = dist.all_gather_single  # FSDP2's DefaultAllGather

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    with mock.patch.object(dist, "all_gather_single", counting):
        simulate_rank(tiny_config(parallel), 0, steps=1)
    conn.send(calls)


def gathers(parallel: ParallelConfig) -> int:
    """All-gathers in one step of rank 0, in a forked child (simulate_rank leaves its world)."""
    receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_count, args=(send, parallel))
    child.start()
    calls = receive.recv()
    child.join()
    return calls


@pytest.mark.parametrize("microbatches", [1, 4])
def test_zero2_gathers_every_forward_and_zero3_every_pass(microbatches: int) -> None:
    """FSDP2 reshards after every backward by default, so the trainer's ZeRO-2 gathers its
    parameters again for every micro-batch's forward (Megatron's distributed optimizer and
    DeepSpeed gather once a step); ZeRO-3 gathers every block for each forward and backward, the
    root (never resharded after forward) once a forward. tuner/cost/data.py prices these counts.
    Keeping ZeRO-2's parameters gathered across micro-batches (set_reshard_after_backward on the
    last one only) cut the gathers to one pass a step but raised the peak: the blocks already
    through their backward stay gathered for the rest of it (the tiny model at 3+ micro-batches:
    +98,816 bytes, +3.5 %), which the memory model does not price: not adopted (issue 37)."""
    mbs = 8 // microbatches
    z2 = ParallelConfig(dp_shard=2, zero_stage=2, micro_batch_size=mbs, num_microbatches=microbatches)
    z3 = ParallelConfig(dp_shard=2, zero_stage=3, micro_batch_size=mbs, num_microbatches=microbatches)
    assert gathers(z2) == microbatches * UNITS
    assert gathers(z3) == microbatches * (2 * (UNITS - 1) + 1)
