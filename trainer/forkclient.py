"""Asking a fork server for ranks (trainer.spawn's side: fork_rank) and starting and stopping one
(the tuner's side: ForkServer), torch-free: the local dispatcher imports it, and trainer.spawn,
which exists so that a trial's launch does not import torch. The server, which imports torch and
the trainer before it forks, and what a forked rank keeps of a started one: trainer/forkserver.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from trainer.contract.trial_dir import TAG_VAR
from trainer.launch import local_env

TAG_ROOM = 128  # bytes of the placeholder tag, the longest trial tag a forked rank can carry
BENCHMARK = ["-m", "trainer.benchmark"]
LOST = 255  # exit code of a rank whose server ended before it reported one


# --- trainer.spawn's side -------------------------------------------------------------------------


class ForkedRank:
    """A rank the server forked, with what trainer.spawn uses of a Popen."""

    def __init__(self, conn: socket.socket, pid: int):
        self.conn, self.pid = conn, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.conn], [], [], 0)[0]:
            reply = read_message(self.conn)
            self.returncode = reply["exit"] if reply and "exit" in reply else LOST
            self.conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def fork_rank(path: str, command: list[str], env: dict[str, str], store_fd: int | None = None,
              timeout_s: float = 30.0) -> ForkedRank | None:  # fmt: skip
    """The rank `command` forked by the server at `path`, with `env`, this process's stdout,
    stderr and working directory, and `store_fd` (rank 0's store socket); None when the command
    is not the server's to run or the server refuses or does not answer (why goes to stderr)."""
    if command[1:3] != BENCHMARK:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout_s)
    request = {"python": command[0], "argv": command[3:], "env": env, "cwd": os.getcwd()}
    fds = [1, 2] + ([store_fd] if store_fd is not None else [])
    try:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
        reply = read_message(conn)
    except OSError as e:
        reply = {"error": f"{type(e).__name__}: {e}"}
    if not reply or "pid" not in reply:
        print(f"trainer.forkserver: starting the rank as a process: {reply and reply.get('error')}",
              file=sys.stderr, flush=True)  # fmt: skip
        conn.close()
        return None
    conn.settimeout(None)
    return ForkedRank(conn, reply["pid"])


def read_message(conn: socket.socket, data: bytes = b"") -> dict | None:
    """One JSON line (`data`: its start, already read), None at the end of the stream."""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


# --- the tuner's side -----------------------------------------------------------------------------


class ForkServer:
    """A started server: its socket `path`, its process and its own (placeholder) tag."""

    def __init__(self, process: subprocess.Popen, path: str, tag: str):
        self.process, self.path, self.tag = process, path, tag

    @classmethod
    def start(cls, python: str = sys.executable, timeout_s: float = 120.0) -> ForkServer | None:
        """Start a server and wait until it listens; None (why on stderr) if it does not."""
        path = str(Path(tempfile.mkdtemp(prefix="pt-forkserver-")) / "socket")
        tag = f"forkserver-{uuid.uuid4().hex[:16]}-".ljust(TAG_ROOM, "_")
        argv = [python, "-m", "trainer.forkserver", f"--socket={path}", f"--parent={os.getpid()}"]
        process = subprocess.Popen(argv, env={**local_env(), TAG_VAR: tag}, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
        server = cls(process, path, tag)
        ready = select.select([process.stdout], [], [], timeout_s)[0]
        line = process.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            print(f"trainer.forkserver: not started ({line.decode(errors='replace').strip() or 'no answer'})",
                  file=sys.stderr, flush=True)  # fmt: skip
            server.close(wait_s=5.0)
            return None
        return server

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self, wait_s: float = 0.0) -> None:
        """Stop taking requests; the server exits once its ranks have ended. Waits up to `wait_s`
        for that (then kills it: its ranks are the trials' supervisors' to stop)."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            if wait_s:
                self.process.kill()
        if self.process.stdout:
            self.process.stdout.close()
        shutil.rmtree(Path(self.path).parent, ignore_errors=True)
