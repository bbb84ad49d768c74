"""Start one process per rank on this machine, as `torchrun --standalone` does, without torch.

    python -m trainer.spawn --nproc-per-node=N -- COMMAND...

runs N copies of COMMAND with the environment torch.distributed's env:// rendezvous reads (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT); rank 0
hosts the TCPStore on a socket this process bound and listens on (TRAINER_STORE_FD). torchrun's
agent imports torch and its elastic machinery before it starts a rank, a second or more of every
local trial's wall time, times its ranks in device-seconds (docs/benchmarks.md, "Trial cost"). A short benchmark trial needs none of what
that buys (restarts, membership changes), only what this does:

- every rank in this process's session, so the supervisor's SIGTERM to the group reaches them all;
- SIGTERM, SIGINT or SIGHUP to this process is passed on to every rank still running;
- the first rank to exit non-zero ends the others (SIGTERM, then SIGKILL after GRACE_S), as
  torchrun does: a rank left alone would wait in a collective until its timeout; so does rank 0's
  end, after GRACE_S (it wrote the result; a failed trial exits 0 on purpose);
- the exit code is that first failure's (128 + signal for a rank killed by one), else 0.

The supervisor (trainer/launch.py) still owns the time limit and the trial's process tag.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

GRACE_S = 5.0


STORE_FD_VAR = "TRAINER_STORE_FD"  # trainer/benchmark.py reads it: rank 0 the socket, others ""


def store_socket(host: str = "127.0.0.1") -> socket.socket:
    """A listening socket on a free port, handed to rank 0 for its store: no other process can
    take the port between its choice and rank 0's start (torchrun's agent holds its store itself)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    s.listen(128)
    return s


def rank_env(rank: int, world: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    return env


def _exit_code(code: int) -> int:
    return code if code >= 0 else 128 - code


def spawn(command: list[str], nproc: int) -> int:
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    with store_socket() as listener:
        port, fd = listener.getsockname()[1], listener.fileno()
        ranks = [
            subprocess.Popen(command, env={**rank_env(r, nproc, port), STORE_FD_VAR: str(fd) if r == 0 else ""},
                             stdin=subprocess.DEVNULL, pass_fds=(fd,) if r == 0 else ())
            for r in range(nproc)
        ]  # fmt: skip
    rank0_ended: float | None = None
    first: int | None = None  # the first rank that failed
    failed: int | None = None
    ending_since: float | None = None  # when the other ranks were told to end
    while None in [p.poll() for p in ranks]:  # poll every rank (any() would stop at the first)
        if failed is None and ending_since is None:  # not the ranks this process ended
            first = next((r for r, p in enumerate(ranks) if p.returncode not in (None, 0)), None)
            failed = None if first is None else _exit_code(ranks[first].returncode)
        if (failed is not None or stop) and ending_since is None:
            ending_since = time.monotonic()
            why = (
                f"signal {stop[0]}" if stop and failed is None else f"rank {first} exited with code {failed}"
            )
            print(f"trainer.spawn: {why}: ending the other ranks", file=sys.stderr, flush=True)
            _signal(ranks, stop[0] if stop and failed is None else signal.SIGTERM)
        if ending_since is not None and time.monotonic() - ending_since > GRACE_S:
            _signal(ranks, signal.SIGKILL)
        # Rank 0 writes the trial's result last: once it is gone the others have nothing left to
        # do but may be stuck (e.g. waiting for a store rank 0 failed to start, init_timeout_s).
        if rank0_ended is None and ranks[0].returncode is not None:
            rank0_ended = time.monotonic()
        if ending_since is None and rank0_ended is not None and time.monotonic() - rank0_ended > GRACE_S:
            ending_since = time.monotonic()
            print("trainer.spawn: rank 0 ended: ending the other ranks", file=sys.stderr, flush=True)
            _signal(ranks, signal.SIGTERM)
        time.sleep(0.05)
    if failed is None and ending_since is None:
        failed = next((_exit_code(p.returncode) for p in ranks if p.returncode != 0), None)
    if failed is None and stop:
        return 128 + stop[0]
    return failed if failed is not None else _exit_code(ranks[0].returncode)


def _signal(ranks: list[subprocess.Popen], sig: int) -> None:
    for p in ranks:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks to start (>= 1)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command of every rank")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (after --)")
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be >= 1, not {args.nproc_per_node}")
    return spawn(command, args.nproc_per_node)


if __name__ == "__main__":
    sys.exit(main())
