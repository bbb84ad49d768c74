"""One fork server for the trainer tests that run many trials (parity, the oracle against real runs):
their ranks are forked from a process that imported torch and the trainer once, as the tuner's
local workers fork them (tuner/dispatch/local.py), instead of each rank starting a Python that
imports torch (~1.8 s of CPU a rank: 4 ranks on 2 cores, ~3.5 s of every 4-rank trial).

The launcher's own tests (test_launch, test_spawn, test_forkserver, test_benchmark) start their
ranks as processes: that path stays covered, and test_forkserver checks a forked trial equals a
started one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from trainer.contract.trial_dir import SOCKET_VAR
from trainer.forkclient import ForkServer
from trainer.launch import trial_processes


class _Servers:
    """The session's server, started again if it ended (it exits after IDLE_S without a rank,
    e.g. while other groups run)."""

    def __init__(self) -> None:
        self.server: ForkServer | None = None
        self.tags: list[str] = []

    def path(self) -> str:
        if self.server is None or not self.server.alive():
            if self.server is not None:
                self.server.close(wait_s=10)
            self.server = ForkServer.start()
            assert self.server is not None, "the fork server did not start (stderr says why)"
            self.tags.append(self.server.tag)
        return self.server.path


@pytest.fixture(scope="session")
def _fork_servers() -> Iterator[_Servers]:
    servers = _Servers()
    yield servers
    if servers.server is not None:
        servers.server.close(wait_s=10)
    assert all(trial_processes(tag) == [] for tag in servers.tags), (
        "a fork server or its ranks outlived the session"
    )


@pytest.fixture
def forked_ranks(_fork_servers: _Servers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trials started during the test fork their ranks from the session's server."""
    monkeypatch.setenv(SOCKET_VAR, _fork_servers.path())
