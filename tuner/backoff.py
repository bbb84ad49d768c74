"""Waiting between tries: one rule for every loop that retries or backs off.

- `Backoff(first_s, cap_s, factor)`: the wait after the n-th failure (or quiet poll) in a row is
  first_s x factor^(n-1), capped at cap_s. `delay(n)` for a loop that keeps its own count (a count
  stored in the database survives a restart), `delays()` for one that does not.
- `retrying(fn, on=..., delays=...)`: call fn until it returns, waiting the next delay after each
  failure it is told to retry; with the delays spent, or the wait told to stop, the failure
  propagates.

Who uses it (each with the delays it had before this module): the study runner's database outages
(tuner/loop.py: 1, 2, 4, ... 30 s; at start-up 1, 2, 4, 8, 15, 30 s, then give up), a failed
submission's re-queue (dispatch_backoff_s x 2^(n-1), at most 300 s), a worker connecting to its
database (tuner/worker.py: from min(poll_s, 1) s doubling to 30 s), a failed allocation (every
30 s), and the Slurm watcher's sacct interval (tuner/dispatch/slurm.py: x1.5 per quiet poll,
1 s to 30 s).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    first_s: float
    cap_s: float
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not (self.first_s > 0 and self.cap_s > 0 and self.factor >= 1):
            raise ValueError(
                f"back-off needs first_s ({self.first_s}) > 0, cap_s ({self.cap_s}) > 0 and factor ({self.factor}) >= 1"
            )

    def delay(self, failures: int) -> float:
        """The wait after `failures` (1, 2, ...) failures in a row."""
        if failures < 1:
            raise ValueError(f"failures must be 1 or more, not {failures}")
        return min(self.first_s * self.factor ** (failures - 1), self.cap_s)

    def delays(self) -> Iterator[float]:
        """delay(1), delay(2), ... without end."""
        failures = 0
        while True:
            failures += 1
            yield self.delay(failures)


def retrying(
    fn: Callable[[], T],
    *,
    on: type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool],
    delays: Iterable[float],
    wait: Callable[[float], object] = time.sleep,
    log: Callable[[BaseException, float], None] | None = None,
) -> T:
    """fn() until it returns. A failure `on` accepts (exception types, or a predicate on the
    exception) is logged (`log(error, delay)`), waited out (`wait(delay)`) and tried again; any other
    failure propagates at once, and so does the last one when `delays` is spent or `wait` returns
    True (threading.Event.wait does once its event is set: a process told to stop stops waiting)."""
    accepts = on if callable(on) and not isinstance(on, type) else (lambda e: isinstance(e, on))  # type: ignore[arg-type]
    pending = iter(delays)
    while True:
        try:
            return fn()
        except Exception as e:
            if not accepts(e):
                raise
            delay = next(pending, None)
            if delay is None:
                raise
            if log is not None:
                log(e, delay)
            if wait(delay) is True:
                raise
