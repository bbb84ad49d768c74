"""One back-off rule (tuner/backoff.py) for every loop that waits between tries: the delays each
loop had before, and how `retrying` gives up."""

from __future__ import annotations

import threading

import pytest

from tuner import loop, worker
from tuner.backoff import Backoff, retrying
from tuner.dispatch.slurm import SlurmDispatcher


def test_each_loop_keeps_its_delays() -> None:
    # The runner while the database is away: 1 s doubling, at most 30 s.
    assert [d for d, _ in zip(loop.DB_BACKOFF.delays(), range(8), strict=False)] == [
        1,
        2,
        4,
        8,
        16,
        30,
        30,
        30,
    ]
    # A failed submission: dispatch_backoff_s x 2^(n-1), at most 300 s (the old formula).
    for first in (2.0, 0.5, 400.0):
        assert [Backoff(first, loop.MAX_BACKOFF_S).delay(n) for n in range(1, 12)] == [
            min(first * 2 ** (n - 1), 300.0) for n in range(1, 12)
        ]
    # The Slurm watcher's interval: x1.5 per quiet poll from min_interval_s to max_interval_s.
    d, old, seen = SlurmDispatcher(min_interval_s=0.5, max_interval_s=2.0), 0.5, []
    for quiet in range(6):
        seen.append(d.backoff.delay(quiet + 1))
        assert seen[-1] == old
        old = min(old * 1.5, 2.0)
    assert seen == [0.5, 0.75, 1.125, 1.6875, 2.0, 2.0]
    assert {worker.ALLOCATION_RETRY.delay(n) for n in range(1, 5)} == {30.0}


def test_retrying_retries_what_it_is_told_then_gives_up_with_the_last_failure() -> None:
    calls, waits, logged = [], [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError(f"try {len(calls)}")
        return "ok"

    assert retrying(flaky, on=ConnectionError, delays=[1, 2, 4], wait=waits.append,
                    log=lambda e, d: logged.append((str(e), d))) == "ok"  # fmt: skip
    assert (len(calls), waits, logged) == (3, [1, 2], [("try 1", 1), ("try 2", 2)])

    calls.clear()
    with pytest.raises(ConnectionError, match="try 2"):  # the delays are spent: the last failure
        retrying(flaky, on=ConnectionError, delays=[5], wait=lambda s: None)
    with pytest.raises(KeyError):  # not one to retry: at once
        retrying(lambda: {}["x"], on=ConnectionError, delays=[1], wait=pytest.fail)
    with pytest.raises(ValueError, match="odd"):  # a predicate decides
        retrying(lambda: (_ for _ in ()).throw(ValueError("odd")), on=lambda e: "even" in str(e), delays=[1])


def test_a_wait_that_says_stop_ends_the_retries() -> None:
    stop, tries = threading.Event(), []

    def wait(delay: float) -> bool:
        stop.set()  # told to stop while waiting out the first delay
        return stop.wait(delay)

    with pytest.raises(ConnectionError):
        retrying(lambda: tries.append(1) or (_ for _ in ()).throw(ConnectionError()), on=ConnectionError,
                 delays=Backoff(1, 30).delays(), wait=wait)  # fmt: skip
    assert tries == [1]


def test_a_worker_waits_for_an_unreachable_database_with_back_off_until_told_to_stop() -> None:
    """tuner/worker.py: a real connection refused (nothing listens on port 1), retried after
    min(poll_s, 1) s doubling; stopping ends the wait and the worker gets no sessions."""

    class Stop(threading.Event):
        def __init__(self) -> None:
            super().__init__()
            self.waits: list[float] = []

        def wait(self, timeout=None):
            self.waits.append(timeout)
            if len(self.waits) == 4:
                self.set()
            return self.is_set()

    stop = Stop()
    assert worker._connect("postgresql+psycopg://nobody@127.0.0.1:1/db", stop, poll_s=0.5) is None
    assert stop.waits == [0.5, 1.0, 2.0, 4.0]
    with pytest.raises(worker.DatabaseError, match="not valid"):  # a malformed URL: at once
        worker._connect("notadb://x", threading.Event(), poll_s=0.5)


def test_bad_back_off_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=r"first_s \(0\) > 0"):
        Backoff(0, 30)
    with pytest.raises(ValueError, match="failures must be 1 or more, not 0"):
        Backoff(1, 30).delay(0)
