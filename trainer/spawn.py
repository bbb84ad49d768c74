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
- OMP_NUM_THREADS=1 unless set, with more than one rank, as torchrun sets it (without it, 2
  ranks of 2 threads each on 2 cores ran a pipelined gpt-small 6x slower);
- the exit code is that first failure's (128 + signal for a rank killed by one), else 0.

When the environment names a fork server (TRAINER_FORKSERVER, trainer/forkserver.py), the ranks are
forked from it, which has imported torch and the trainer already; they are watched and signalled
the same way.

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

from trainer.contract.trial_dir import SOCKET_VAR, STORE_FD_VAR
from trainer.forkclient import ForkedRank, fork_rank

GRACE_S = 5.0


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
    if world > 1:  # as torchrun: N ranks of as many threads as cores each would oversubscribe them
        env.setdefault("OMP_NUM_THREADS", "1")
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
        ranks = [_start(command, rank_env(r, nproc, port), fd if r == 0 else None) for r in range(nproc)]
    failed: tuple[int, int] | None = None  # (rank, exit code) of the first rank to fail
    rank0_ended: float | None = None
    ending_since: float | None = None  # when the other ranks were told to end
    while None in [p.poll() for p in ranks]:  # poll every rank (any() would stop at the first)
        now = time.monotonic()
        if ending_since is None:  # a failure is a rank's own, not one this process ended
            failed = failed or _first_failure(ranks)
            if rank0_ended is None and ranks[0].returncode is not None:
                rank0_ended = now
            # Rank 0 writes the trial's result last: once it is gone the others have nothing left
            # to do but may be stuck (e.g. waiting for a store rank 0 failed to start).
            late = rank0_ended is not None and now - rank0_ended > GRACE_S
            why = (f"rank {failed[0]} exited with code {failed[1]}" if failed else
                   f"signal {stop[0]}" if stop else "rank 0 ended" if late else None)  # fmt: skip
            if why:
                ending_since = now
                print(f"trainer.spawn: {why}: ending the other ranks", file=sys.stderr, flush=True)
                _signal(ranks, stop[0] if stop and not failed else signal.SIGTERM)
        elif now - ending_since > GRACE_S:
            _signal(ranks, signal.SIGKILL)
        time.sleep(0.05)
    failed = failed or (None if ending_since is not None else _first_failure(ranks))
    if failed:
        return failed[1]
    return 128 + stop[0] if stop else _exit_code(ranks[0].returncode)


def _start(command: list[str], env: dict[str, str], store_fd: int | None) -> subprocess.Popen | ForkedRank:
    """One rank: forked by the trial's fork server if it names one and takes the command
    (trainer/forkserver.py), else a process of its own. `store_fd`: rank 0's store socket."""
    server = env.get(SOCKET_VAR)
    if server and (rank := fork_rank(server, command, {**env, STORE_FD_VAR: ""}, store_fd)):
        return rank
    fds = () if store_fd is None else (store_fd,)
    return subprocess.Popen(command, env={**env, STORE_FD_VAR: "" if store_fd is None else str(store_fd)},
                            stdin=subprocess.DEVNULL, pass_fds=fds)  # fmt: skip


def _first_failure(ranks: list[subprocess.Popen | ForkedRank]) -> tuple[int, int] | None:
    return next(
        ((r, _exit_code(p.returncode)) for r, p in enumerate(ranks) if p.returncode not in (None, 0)), None
    )


def _signal(ranks: list[subprocess.Popen | ForkedRank], sig: int) -> None:
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
