"""A held study lease and its heartbeat: a thread renews the expiry every third of the lease
while the runner works, so a runner busy in a long poll or a slow `sbatch` keeps its study.
If a renewal finds the lease taken (it expired while this process was stopped or cut off from
the database), `lost` is set and the runner stops without touching the study again."""

from __future__ import annotations

import logging
import threading

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import sessionmaker

from tuner import store

log = logging.getLogger("tuner.lease")


class Lease:
    def __init__(self, sessions: sessionmaker, study_id: int, owner: store.Owner,
                 lease_s: float = store.DEFAULT_LEASE_S):  # fmt: skip
        self.sessions, self.study_id, self.owner, self.lease_s = sessions, study_id, owner, lease_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def renew(self) -> bool:
        """One heartbeat; False once the lease is gone. A database that does not answer is not
        a lost lease: the next beat tries again (nobody else can take it without the database)."""
        try:
            with self.sessions.begin() as s:
                held = store.renew(s, self.study_id, self.owner, lease_s=self.lease_s)
        except SQLAlchemyError as e:
            log.warning("lease of study %d not renewed (database: %s)", self.study_id, str(e).splitlines()[0])
            return True
        if not held:
            self.lost.set()
        return held

    def start(self) -> Lease:
        self._thread = threading.Thread(target=self._beat, name=f"lease-{self.study_id}", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            if not self.renew():
                log.warning("lease of study %d lost to another worker", self.study_id)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Lease:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
