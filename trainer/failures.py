"""Failures are results, never hangs.

Each rank that fails writes `<out>.rank<r>.fail.json` before it exits. Rank 0 turns the root cause
(the earliest failure that is not just a broken collective) into the result file. A watcher thread
in every rank polls for those files, so a rank blocked in a collective with a dead peer does not
wait for the process-group timeout: rank 0 writes the result and every rank exits 0 (torchrun
would kill rank 0 before it wrote anything if a worker exited non-zero). This needs `out` on a
file system every rank sees (the trial's work dir); without one, the shortened process-group
timeout is the fallback.

A collective that timed out, with no rank reporting a failure of its own, means some rank stopped
making progress (a hang): status 'timeout'. A peer that went away (connection closed or reset)
means it crashed: status 'error'.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import traceback
from pathlib import Path

from trainer.contract.result import BenchmarkResult
from trainer.contract.trial_dir import atomic_write, rank_failure_file, rank_failure_files, write_result

# Messages of a collective that failed because a peer went away or timed out: the consequence
# of a failure elsewhere, so never the root cause when another rank reported something else.
_SECONDARY = re.compile(
    r"connection (closed|reset)|broken pipe|timed out|timeout|communicator was aborted|"
    r"peer|socket|ECONNRESET|recv|send",
    re.IGNORECASE,
)
# Of those, the ones that say the collective waited too long, not that the peer is gone.
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_GONE = re.compile(r"connection (closed|reset)|broken pipe|ECONNRESET", re.IGNORECASE)
_POLL_S = 0.25
_SETTLE_S = 0.75  # after the first failure file, wait this long for an earlier-rooted one


class InvalidLayout(Exception):
    """The layout cannot run this model or world size (status 'invalid')."""


class MemoryCapExceeded(Exception):
    """Measured peak memory over BenchmarkConfig.max_memory_bytes (status 'oom')."""


def run_id() -> str:
    """Same on every rank of one launch, different between launches."""
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if key in os.environ:
            return (
                f"{os.environ[key]}.{os.environ.get('SLURM_STEP_ID', '')}.{os.environ.get('MASTER_PORT', '')}"
            )
    return f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"


def classify(exc: BaseException) -> str:
    if isinstance(exc, MemoryCapExceeded):
        return "oom"
    if isinstance(exc, InvalidLayout):
        return "invalid"
    name = type(exc).__name__
    if name == "OutOfMemoryError" or "out of memory" in str(exc).lower():
        return "oom"
    return "error"


def error_tail(exc: BaseException, limit: int = 4000) -> str:
    """The message alone for the failures we raise on purpose, the traceback tail otherwise."""
    if isinstance(exc, (InvalidLayout, MemoryCapExceeded)):
        return str(exc)
    text = "".join(traceback.format_exception(exc))
    return text[-limit:]


class FailureBoard:
    """Where ranks post their failures and rank 0 writes the one result."""

    def __init__(self, out: Path | None, rank: int, world_size: int, base: dict):
        self.out, self.rank, self.world_size = out, rank, world_size
        self.base = base  # fields every result carries (world_size, parallel, model, ...)
        self.run_id = run_id()
        self._lock = threading.Lock()
        self._written = False
        if out is not None:
            self._fail_path(rank).unlink(missing_ok=True)

    def _fail_path(self, rank: int) -> Path:
        assert self.out is not None
        return rank_failure_file(self.out, rank)

    def post(self, exc: BaseException) -> dict:
        """Record this rank's failure; returns the record."""
        message, secondary = str(exc), bool(_SECONDARY.search(str(exc))) and classify(exc) == "error"
        record = {
            "status": classify(exc),
            "error": error_tail(exc),
            "rank": self.rank,
            "time": time.time(),
            "secondary": secondary,
            "timed_out": secondary and bool(_TIMED_OUT.search(message)) and not _PEER_GONE.search(message),
            "run_id": self.run_id,
        }
        if self.out is not None and self.world_size > 1:
            atomic_write(self._fail_path(self.rank), json.dumps(record))
        return record

    def _posted(self) -> list[dict]:
        if self.out is None:
            return []
        records = []
        for path in rank_failure_files(self.out):
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being written
            if rec.get("run_id") == self.run_id:
                records.append(rec)
        return records

    def finish(self, own: dict | None = None) -> BenchmarkResult:
        """On rank 0 after a failure anywhere: write the root cause as the result."""
        time.sleep(_SETTLE_S if self.world_size > 1 else 0)
        records = self._posted() + ([own] if own else [])
        root = min(records, key=lambda r: (r["secondary"], r["time"]))
        if root["timed_out"]:  # no primary failure anywhere: a hang; which rank hung is unknown
            status, failed_rank = "timeout", None
            error = f"a collective timed out on rank {root['rank']}: some rank stopped making progress\n"
        else:
            status, failed_rank, error = root["status"], root["rank"], ""
        result = BenchmarkResult(
            status=status,
            error=error + root["error"],
            failed_rank=None if status == "invalid" else failed_rank,
            **self.base,
        )
        self.write(result)
        return result

    def write(self, result: BenchmarkResult) -> bool:
        with self._lock:
            if self._written or self.out is None or self.rank != 0:
                return False
            write_result(self.out, result)
            self._written = True
            return True

    def watch(self) -> None:
        """Start the watcher thread (multi-rank runs with an out path)."""
        if self.out is None or self.world_size == 1:
            return
        threading.Thread(target=self._watch, name="failure-watcher", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(_POLL_S)
            others = [r for r in self._posted() if r["rank"] != self.rank]
            if others:
                if self.rank == 0:
                    self.finish()
                os._exit(0)
