"""A fork server for local CPU trials: one process that has imported torch and the trainer forks
each rank of a trial, instead of every rank starting a Python that imports them (~1.6 s of each
rank's start on the 2-core VM: torch, torch.distributed.tensor, torch._dynamo; docs/benchmarks.md,
"Trial cost").

    server = ForkServer.start()     # the tuner's side (trainer/forkclient.py, torch-free)
    env[SOCKET_VAR] = server.path   # trainer/contract/trial_dir.py: the trials started with it fork their ranks
    server.close()

    python -m trainer.forkserver --socket PATH --parent PID      (what start() runs)

This module is the server: it imports torch and the trainer, so nothing torch-free imports it.
trainer.spawn asks it for a rank (trainer/forkclient.py: fork_rank) when the trial's environment
names a server and the rank's command is `<the server's python> -m trainer.benchmark ...`;
otherwise, or when the server does not answer, it starts the rank as a process of its own.

What a forked rank keeps of a started one:
- the trial's tag in /proc/PID/environ, by which every process of a trial is found and killed
  (trainer/launch.py). A forked process shows its parent's initial environment there, so the server
  starts with a placeholder tag of TAG_ROOM bytes (trainer/forkclient.py) and each child writes
  its trial's tag over the placeholder in its own copy of that block before the server answers; a
  longer tag, or a block that cannot be written, is refused (the rank is then started as a
  process), and so is a trial whose environment differs from the server's in a variable read at
  start-up (READ_AT_IMPORT);
- its environment (os.environ is the trial's; OMP_NUM_THREADS, which OpenMP read when the
  server imported torch, is applied with torch.set_num_threads), working directory, stdout and stderr (passed over
  the socket: the trial's log) and rank 0's store socket;
- its exit code: the server, its parent, sends it over the request's connection; signals go to
  the pid directly.
A rank does not outlive its trial: when the request's connection closes before the rank ended
(trainer.spawn died), the server kills the rank; when the server dies, trainer.spawn sees the
connection close, counts the rank as failed and ends the trial, and the supervisor kills what is
left by tag. The server stops taking requests on SIGTERM, when the process that started it ends
or after IDLE_S without a rank, and exits once its ranks have ended: a trial in flight finishes
even when the worker that started it stopped (another worker may adopt it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import select
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

from trainer.contract.trial_dir import STORE_FD_VAR, TAG_VAR
from trainer.forkclient import read_message
from trainer.launch import proc_stat

IDLE_S = 120.0
# Prefixes of environment variables read when Python starts or torch is imported: a trial whose
# values differ from the server's has its ranks started as processes.
READ_AT_IMPORT = ("PYTHON", "LD_", "TORCH_", "PYTORCH_", "OMP_", "KMP_", "GOMP_", "MKL_", "CUDA_")


# --- the server -----------------------------------------------------------------------------------


def preload() -> None:
    """What every rank would import: the trainer, and what it imports late (FSDP2 and replicate
    import torch._dynamo on first use; pipelining only for pp > 1)."""
    import torch._dynamo
    import torch.distributed.pipelining  # noqa: F401

    import trainer.benchmark
    import trainer.pipeline  # noqa: F401


def serve(path: str, parent: int, idle_s: float = IDLE_S) -> int:
    preload()
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    ranks: dict[int, socket.socket | None] = {}  # pid -> the connection that asked for it
    idle_since = time.monotonic()
    while listener or ranks:
        if listener and (
            stop or os.getppid() != parent or (not ranks and time.monotonic() - idle_since > idle_s)
        ):
            listener.close()  # no more requests; the ranks in flight are still reaped and reported
            listener = None
            with contextlib.suppress(OSError):
                os.unlink(path)
                os.rmdir(Path(path).parent)  # made for it by ForkServer.start
        readable = select.select([s for s in (listener, *ranks.values()) if s], [], [], 0.2)[0]
        for s in readable:
            if s is listener:
                _accept(listener, ranks)
            else:  # the asker closed its end before its rank ended: the trial is gone
                pid = next(p for p, c in ranks.items() if c is s)
                s.close()
                ranks[pid] = None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        _reap(ranks)
        if ranks:
            idle_since = time.monotonic()
    return 0


def _accept(listener: socket.socket, ranks: dict[int, socket.socket | None]) -> None:
    try:
        conn, _ = listener.accept()
    except OSError:  # e.g. out of file descriptors: the asker starts its rank as a process
        return
    conn.settimeout(10.0)
    fds: list[int] = []
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
        if (request := read_message(conn, data)) is None:
            raise OSError("the request ended early")
        pid = _fork(request, fds, [listener, conn, *(c for c in ranks.values() if c)])
    except (OSError, ValueError, KeyError) as e:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        conn.close()
        return
    finally:
        for fd in fds:  # the child has its copies
            os.close(fd)
    conn.settimeout(None)
    ranks[pid] = conn  # an asker gone before the answer: its rank is killed as the loop sees it go
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _read_at_import(env: dict[str, str]) -> dict[str, str]:
    """The variables Python, the loader, torch or OpenMP may read when the server started, which a
    forked rank cannot take from its trial (OMP_NUM_THREADS is applied after the fork)."""
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT) and k != "OMP_NUM_THREADS"}


def _fork(request: dict, fds: list[int], inherited: list[socket.socket]) -> int:
    if os.path.abspath(request["python"]) != os.path.abspath(sys.executable):
        raise ValueError(f"the rank's python {request['python']} is not the server's {sys.executable}")
    theirs, ours = _read_at_import(request["env"]), _read_at_import(dict(os.environ))
    if differ := sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k)):
        raise ValueError(
            f"the trial's environment differs from the server's in {', '.join(differ)}, read at start-up"
        )
    if len(fds) < 2:
        raise ValueError("stdout and stderr were not passed")
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the rank: never returns
        code = 70
        try:
            os.close(ready_r)
            _become_rank(request, fds, inherited, ready_w)
            import trainer.benchmark

            code = trainer.benchmark.main(request["argv"]) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    os.close(ready_w)
    ready = select.select([ready_r], [], [], 30.0)[0] and os.read(ready_r, 1)
    os.close(ready_r)
    if ready != b"1":  # it could not become the rank (why is in the trial's log)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise ValueError("the forked rank could not take the trial's tag, output or environment")
    return pid


def _reap(ranks: dict[int, socket.socket | None]) -> None:
    """Collect the ranks that ended and send each one's exit code (as Popen.returncode: -N for a
    signal) to its asker."""
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if conn := ranks.pop(pid, None):
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            conn.close()


def _become_rank(request: dict, fds: list[int], conns: list[socket.socket], ready_w: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    for c in conns:
        c.close()
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds[:2]:
        if fd > 2:
            os.close(fd)
    retag(request["env"].get(TAG_VAR, ""))
    env = dict(request["env"])
    if len(fds) > 2:  # rank 0's store socket, under its number here
        env[STORE_FD_VAR] = str(fds[2])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    if (
        threads := env.get("OMP_NUM_THREADS", "")
    ).isdigit():  # OpenMP read the server's environment at its start
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [sys.executable, *request["argv"]]
    os.write(ready_w, b"1")
    os.close(ready_w)


def retag(tag: str) -> None:
    """Write TAG_VAR=`tag` over this process's TAG_VAR entry in its initial environment block (what
    /proc/PID/environ shows), padding with NULs up to the next entry (so it can be written again).
    Raises if the entry is missing or too short."""
    fields = proc_stat("self")  # env_start and env_end: fields 50 and 51
    start, end = int(fields[47]), int(fields[48])
    block = ctypes.string_at(start, end - start)
    key = f"{TAG_VAR}=".encode()
    at = 0 if block.startswith(key) else block.find(b"\0" + key) + 1
    if at == 0 and not block.startswith(key):
        raise ValueError(f"no {TAG_VAR} in this process's environment block")
    size = re.compile(rb"[^\0]*\0+").match(block, at).end() - at - 1  # the entry and the NULs after it
    entry = key + tag.encode()
    if len(entry) > size or b"\0" in entry:
        raise ValueError(f"the tag {tag!r} does not fit the {size - len(key)} bytes kept for it")
    ctypes.memmove(start + at, entry + b"\0" * (size - len(entry)), size)
    if entry not in Path("/proc/self/environ").read_bytes().split(b"\0"):
        raise ValueError("the environment block did not take the tag")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fork the ranks of local trials (see trainer/forkserver.py)."
    )
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on")
    parser.add_argument("--parent", required=True, type=int, help="stop taking requests once this pid ends")
    parser.add_argument("--idle-s", type=float, default=IDLE_S)
    args = parser.parse_args(argv)
    return serve(args.socket, args.parent, args.idle_s)


if __name__ == "__main__":
    sys.exit(main())
