"""What communication costs: moved to tuner/cost/collectives.py (the cost model by parts); tensor
parallelism's collectives to tuner/cost/tensor.py. This module keeps the names callers import."""

from __future__ import annotations

from tuner.cost.collectives import (
    CallPath,
    Comm,
    Link,
    Tier,
    allreduce,
    call_overhead_s,
    group_link,
    ranks_per_core,
    ring_allreduce_s,
    send_s,
    wait_s,
)

__all__ = [
    "CallPath",
    "Comm",
    "Link",
    "Tier",
    "allreduce",
    "call_overhead_s",
    "group_link",
    "ranks_per_core",
    "ring_allreduce_s",
    "send_s",
    "wait_s",
]
