"""A real PostgreSQL server for the tests: a throwaway cluster in a temp dir on 127.0.0.1."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PostgresServer:
    url: str
    data: Path
    as_user: tuple[str, ...]
    opts: str
    log: Path

    def pg_ctl(self, *args: str) -> None:
        subprocess.run([*self.as_user, str(pg_bin() / "pg_ctl"), "-D", str(self.data), *args], check=True,
                       capture_output=True, timeout=120)  # fmt: skip

    def stop(self) -> None:
        """Fast shutdown: every connection is dropped, as in a database server's restart."""
        self.pg_ctl("-m", "fast", "-w", "stop")

    def start(self) -> None:
        self.pg_ctl("-o", self.opts, "-l", str(self.log), "-w", "start")

    def restart(self, down_s: float = 0.0) -> None:
        """Stop, stay down `down_s`, start again on the same data."""
        self.stop()
        time.sleep(down_s)
        self.start()


@contextmanager
def postgres_instance() -> Iterator[PostgresServer]:
    """A throwaway cluster on 127.0.0.1. PostgreSQL refuses to run as root: as root, run it as
    the `postgres` user that Debian's package creates."""
    bin_dir = pg_bin()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL server binaries not found (make test installs them)")
    root = Path(tempfile.mkdtemp(prefix="tuner-pg-"))
    data, port = root / "data", _free_port()
    as_user: tuple[str, ...] = ()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        as_user = ("runuser", "-u", "postgres", "--")
    subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "-U", "tuner", "--auth=trust", "-E", "UTF8"],
                   check=True, capture_output=True)  # fmt: skip
    server = PostgresServer(f"postgresql+psycopg://tuner@127.0.0.1:{port}/postgres", data, as_user,
                            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", root / "log")  # fmt: skip
    server.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield server
    finally:
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True, check=False)  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def postgres_server() -> Iterator[str]:
    """Yields a SQLAlchemy URL of a throwaway server."""
    with postgres_instance() as server:
        yield server.url
