"""Adaptive measurement (trainer/stopping.py): the stopping rule on given step times, then two real
2-rank trials under torchrun, one stopping on a stable step time and one pruning itself."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from tests.trainer.helpers import tiny_config
from trainer.contract.parallel import ParallelConfig
from trainer.contract.result import BenchmarkConfig
from trainer.launch import run_local
from trainer.stopping import T_975, measurement_stop, rel_ci_half_width

DP2 = ParallelConfig(dp_replicate=2, micro_batch_size=4)


def cfg(**kwargs) -> BenchmarkConfig:
    return tiny_config(DP2, **{"measure_steps": 10, **kwargs})


def test_ci_half_width_is_students_t_over_the_mean() -> None:
    times = [1.0, 1.1, 0.9, 1.0]
    expected = 3.182 * statistics.stdev(times) / 2 / 1.0  # t(0.975, df=3) * s / sqrt(4) / mean
    assert math.isclose(rel_ci_half_width(times), expected)
    assert rel_ci_half_width([1.0]) == math.inf  # no spread yet
    assert T_975[0] == 12.706 and T_975[-1] == 2.042 and list(T_975) == sorted(T_975, reverse=True)


def test_stable_steps_stop_at_min_measure_steps_noisy_ones_run_to_the_maximum() -> None:
    c = cfg(stable_rel_ci=0.02, min_measure_steps=3)
    assert measurement_stop(c, [0.100, 0.100]) is None  # fewer than min_measure_steps
    stop = measurement_stop(c, [0.100, 0.1002, 0.0999])  # CI +-0.4 %
    assert stop is not None and stop.why == "stable" and "after 3 measured steps" in stop.message
    noisy = [0.10, 0.13, 0.09, 0.12, 0.10, 0.14, 0.09, 0.11, 0.12]
    assert all(measurement_stop(c, noisy[:n]) is None for n in range(1, 10))
    assert measurement_stop(c, [*noisy, 0.1]).why == "max_steps"  # measure_steps is the most
    assert measurement_stop(cfg(), [0.100] * 9) is None  # stable_rel_ci None: always all steps


def test_a_trial_below_the_floor_is_pruned_after_min_measure_steps_not_after_the_last() -> None:
    c = cfg(abandon_below_tokens_per_s=1000.0, min_measure_steps=3)  # tokens_per_step: 8 x 32 = 256
    assert measurement_stop(c, [0.5, 0.5]) is None  # 512 tokens/s, but only 2 steps
    stop = measurement_stop(c, [0.5, 0.5, 0.5])
    assert stop.why == "pruned" and "512 tokens/s < floor 1,000 tokens/s after 3" in stop.message
    assert measurement_stop(c, [0.1, 0.1, 0.1]) is None  # 2,560 tokens/s: above the floor
    assert measurement_stop(c, [0.5] * 10).why == "max_steps"  # fully measured: not pruned


def test_config_checks_the_new_fields() -> None:
    for bad in ({"stable_rel_ci": 0.0}, {"abandon_below_tokens_per_s": -1.0}, {"min_measure_steps": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            cfg(**bad)


# --- real trials: every rank takes the same decision, nobody hangs --------------------------------


@pytest.mark.distributed
@pytest.mark.usefixtures("forked_ranks")
def test_two_ranks_stop_measuring_once_the_step_time_is_stable(tmp_path: Path) -> None:
    # A loose 100 % interval, so that a busy machine still reaches it long before 40 steps.
    c = cfg(measure_steps=40, min_measure_steps=3, stable_rel_ci=1.0)
    result = run_local(c, tmp_path, timeout_s=180)
    assert result.status == "ok", result.error
    n = len(result.step_times_s)
    assert 3 <= n < 40 and result.stopped_because.startswith(f"stable after {n} measured steps")
    assert rel_ci_half_width(result.step_times_s) <= 1.0  # the first point where it held
    assert n == 3 or rel_ci_half_width(result.step_times_s[:-1]) > 1.0
    assert len(result.losses) == c.warmup_steps + n
    assert math.isclose(result.tokens_per_s, c.tokens_per_step * n / sum(result.step_times_s))


@pytest.mark.distributed
@pytest.mark.usefixtures("forked_ranks")
def test_two_ranks_prune_themselves_below_the_floor_keeping_the_partial_measurement(tmp_path: Path) -> None:
    c = cfg(measure_steps=40, min_measure_steps=3, abandon_below_tokens_per_s=1e12)
    result = run_local(c, tmp_path, timeout_s=180)
    assert result.status == "pruned" and result.measured, result.error
    assert len(result.step_times_s) == 3 and result.stopped_because.startswith("pruned while running")
    assert 0 < result.tokens_per_s < 1e12 and result.mfu > 0
    assert len(result.peak_memory_bytes_per_rank) == 2 and result.peak_memory_bytes > 0
