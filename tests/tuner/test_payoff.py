"""What tuning cost next to what it bought (tuner/payoff.py), and the same figures in the API's and
the CLI's rows (tuner/views.py)."""

from __future__ import annotations

import math

import pytest

from tests.records import record_trial
from trainer.contract.parallel import ParallelConfig as P
from tuner import store, views
from tuner.db import connect
from tuner.outcome import Outcome
from tuner.payoff import Measured, describe, payoff
from tuner.spec import parse_spec


def test_speedup_payback_and_saving_follow_from_the_measurements() -> None:
    measured = [
        Measured(4, 1000.0, 5000.0),  # the model's first guess: predicted best, measured 1000
        Measured(4, 1500.0, 3000.0),  # the best
        Measured(4, 800.0, 2000.0),
        Measured(
            2, 9000.0, 100.0
        ),  # another device count: not a baseline for a 4-device best... but the best
    ]
    # The fastest overall is the 2-device one: baselines come from its own device count.
    p = payoff(7200.0, measured, total_tokens=10**9)
    assert (p.best_tokens_per_s, p.devices, p.tuning_device_hours) == (9000.0, 2, 2.0)
    assert [b.name for b in p.baselines] == ["first_guess", "median"]
    assert all(b.speedup == 1.0 and b.payback_minutes is None for b in p.baselines)  # nothing to gain
    p = payoff(7200.0, measured[:3], total_tokens=10**9)
    guess, median = p.baselines
    assert (guess.tokens_per_s, guess.speedup) == (1000.0, 1.5)
    # 4 devices x (1.5 - 1) = 2 device-seconds saved per second of training: 7200 / 2 s = 60 min.
    assert math.isclose(guess.payback_minutes, 60.0)
    # 1e9 tokens: 4 x (1e9/1000 - 1e9/1500) s = 1.333e6 device-s = 370.4 device-h.
    assert math.isclose(guess.saved_device_hours, 4 * (1e6 - 1e9 / 1500) / 3600)
    assert (median.tokens_per_s, median.speedup) == (1000.0, 1.5)
    assert "1.50x the model's first guess (pays back in 60 min of training" in describe(p)


def test_no_measurement_no_baselines() -> None:
    assert payoff(10.0, []).baselines == []


@pytest.fixture
def sessions(tmp_path):
    return connect(f"sqlite:///{tmp_path / 'db.sqlite'}")


def test_the_api_and_cli_rows_carry_the_payoff(sessions) -> None:
    spec = parse_spec({"name": "s", "model": "gpt-tiny", "cluster": "cpu-local", "num_gpus": 2,
                       "training": {"global_batch_size": 8, "precision": "fp32", "total_tokens": 10**8},
                       "space": {"tp": [1, 2]}})  # fmt: skip
    with sessions.begin() as s:
        study = store.create_study(s, spec)
        for config, tokens, predicted in [
            (P(tp=2, micro_batch_size=8), 1000.0, 9e3),
            (P(dp_replicate=2, micro_batch_size=4), 2000.0, 1e3),
        ]:
            record_trial(
                s,
                study,
                config,
                Outcome(ok=True, tokens_per_s=tokens, step_time_s=1.0),
                {"tokens_per_s": predicted},
            )
    with sessions() as s:
        (summary,) = views.summaries(s, store.list_studies(s))
        (best,) = views.best_rows(s)
    for p in (summary.payoff, best.payoff):
        guess = p.baselines[0]
        assert (guess.name, guess.tokens_per_s, guess.speedup) == ("first_guess", 1000.0, 2.0)
        assert guess.saved_device_hours > 0 and p.devices == 2


def test_of_equal_predictions_the_first_guess_is_the_trial_run_first(sessions) -> None:
    """Two layouts the model prices the same (gpipe and 1F1B at pp 2 with 2 micro-batches): the
    sampler ran the first of them first, and that trial is the first guess (the demo once
    reported its best, trial 0, as 1.05x "the first guess", its 1F1B twin measured later)."""
    spec = parse_spec({"name": "s", "model": "gpt-tiny", "cluster": "cpu-local", "num_gpus": 2,
                       "training": {"global_batch_size": 8, "precision": "fp32"}, "space": {"tp": [1], "pp": [2]}})  # fmt: skip
    with sessions.begin() as s:
        study = store.create_study(s, spec)
        for schedule, tokens in (("gpipe", 2000.0), ("1f1b", 1900.0)):
            config = P(pp=2, micro_batch_size=4, num_microbatches=2, pp_schedule=schedule)
            record_trial(s, study, config, Outcome(ok=True, tokens_per_s=tokens, step_time_s=1.0),
                         {"tokens_per_s": 5e3})  # fmt: skip
    with sessions() as s:
        (summary,) = views.summaries(s, store.list_studies(s))
    assert summary.payoff.baselines[0].speedup == 1.0
