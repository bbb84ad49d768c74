"""The memory model against the memory oracle's recorded simulations (bench/memory_oracle.py,
bench/own_tables/memory_oracle*.jsonl), without simulating: the suites re-simulated with the
trainer as it is meet the oracle's criteria (median error <= 1 %, max <= 5 %, no layout the oracle
fits that the model refuses, no OOM the model misses). A trainer change that moves a peak makes
its records stale: re-simulate them (the module's docstring has the commands)."""

from __future__ import annotations

import pytest

from bench import memory_oracle
from tuner.hardware import cluster_preset
from tuner.perfconstants import ModelConstants
from tuner.spec import ClusterSpec


def _recorded(suite: str, models: tuple[str, ...] | None) -> tuple[list[dict], tuple[str, ...]]:
    todo = [x for x in memory_oracle.layouts(suite) if models is None or x[0] in models]
    _, _, _, clusters, records = memory_oracle.SUITES.get(suite, memory_oracle.SUITES["large"])
    rows = memory_oracle.run_oracle(todo, records, simulate=False)
    assert len(rows) == len(todo), "layouts without a recorded simulation: re-run the suite"
    return rows, clusters


# each suite re-simulated since the trainer last moved a peak, with the models of it (None: all)
@pytest.mark.parametrize(
    ("suite", "models"), [("small", None), ("moe", None), ("long", None), ("llama", None)]
)
def test_the_recorded_oracle_suites_meet_their_criteria(suite: str, models: tuple[str, ...] | None) -> None:
    rows, clusters = _recorded(suite, models)
    for name in clusters:
        summary = memory_oracle.compare(rows, ModelConstants(), ClusterSpec(**cluster_preset(name)))
        assert summary["median_error"] <= 0.01, (name, summary)
        assert summary["max_error"] <= 0.05, (name, summary)
        assert (summary["fit_disagreements"], summary["missed_ooms"]) == (0, 0), (
            name,
            summary["disagreements"],
        )


def test_the_published_bf16_layouts_fit_as_the_oracle_says() -> None:
    """Each published BF16 layout of bench/moe_published.py and bench/cp_published.py fits, and the
    oracle agrees, within the suites' 5 % (Llama 3's 128k stage, 405B tp8 pp16 cp16, was at -5.2 %
    until the embedding's backward was priced: docs/benchmarks.md, twelfth session)."""
    rows, (cluster,) = _recorded("published", None)
    summary = memory_oracle.compare(rows, ModelConstants(), ClusterSpec(**cluster_preset(cluster)))
    assert summary["oracle_fits"] == len(rows) == 2
    assert (summary["fit_disagreements"], summary["missed_ooms"]) == (0, 0), summary["disagreements"]
    assert summary["max_error"] <= 0.05, summary
