"""API latency with 100k trials in the database, and p99 under 200 requests/s on loopback.

    .venv/bin/python -m bench.api_speed [--trials 100000] [--rate 200] [--seconds 10] [--workers 1 2]
        [--database-url URL]

A database (SQLite file by default; --database-url for PostgreSQL) gets 10 studies and `--trials`
trials in all (bulk inserted, 60 % completed, measured figures made up by a seeded RNG); `tuner serve
--no-worker --workers N` serves it on 127.0.0.1 (uvicorn, N API processes), for each N of
--workers in turn on the same database, so the figures stand side by side. Then, from this process
over HTTP:
- GET /api/best: 200 sequential requests, p50/p99 (target p99 < 50 ms);
- GET /api/studies/{id}/trials?after=N&limit=1000 for the largest study: 100 requests at random
  offsets, p50/p99; and the polling case (after = the last number): p50/p99;
- an open loop at --rate requests/s for --seconds (best, study detail, the polling request, in
  turn), each request's latency from its scheduled start: p50/p99 (target p99 < 100 ms).
Client and server share the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from sqlalchemy import insert

from trainer.contract.parallel import ParallelConfig
from tuner import store
from tuner.db import Study, Trial, connect
from tuner.outcome import FailureKind, TrialState
from tuner.spec import parse_spec

TUNER = str(Path(sys.executable).parent / "tuner")
MODELS = ["gpt-125m", "gpt-350m", "gpt-1.3b", "gpt-2.7b", "gpt-22b"]


def populate(url: str, num_trials: int) -> int:
    """10 studies (2 per model), trials spread over them; returns the largest study's id."""
    sessions = connect(url)
    rng = random.Random(0)
    layouts = [ParallelConfig(tp=t, pp=p, dp_replicate=64 // (t * p), micro_batch_size=m,
                              num_microbatches=512 // (64 // (t * p) * m))
               for t in (1, 2, 4, 8) for p in (1, 2, 4, 8) for m in (1, 2, 4, 8)]  # fmt: skip
    ids = []
    with sessions.begin() as s:
        for i in range(10):
            spec = parse_spec({"name": f"bench-{i}", "model": MODELS[i % 5], "cluster": "a100-80gb",
                               "num_gpus": 8, "training": {"global_batch_size": 512}, "space": {"tp": [1, 2, 4]}})  # fmt: skip
            ids.append(store.create_study(s, spec).id)
            s.get(Study, ids[-1]).num_gpus = 64
    now = dt.datetime.now(dt.UTC)
    per_study = [num_trials // 2] + [num_trials // 18] * 9  # one large study
    rows = []
    with sessions.begin() as s:
        for study_id, n in zip(ids, per_study, strict=True):
            for number in range(n):
                c = layouts[number % len(layouts)]
                ok = rng.random() < 0.6
                tps = rng.uniform(1e4, 1e6) if ok else None
                rows.append({
                    "study_id": study_id, "number": number, "state": TrialState.COMPLETE if ok else TrialState.FAIL,
                    "layout_key": f"{number}", "config": c.to_dict(), **store.axis_columns(c),
                    "tokens_per_s": tps, "mfu": 0.3 if ok else None,
                    "tflops_per_device": 100.0 if ok else None, "failure_kind": None if ok else FailureKind.OOM,
                    "attempts": 1, "created_at": now, "started_at": now, "finished_at": now,
                })  # fmt: skip
                if len(rows) == 10_000:
                    s.execute(insert(Trial), rows)
                    rows = []
        if rows:
            s.execute(insert(Trial), rows)
        store.rebuild_bests(s)  # bulk inserts bypass finish_trial, which keeps study_bests
    return ids[0]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def timed(client: httpx.Client, path: str) -> float:
    t = time.perf_counter()
    r = client.get(path)
    r.raise_for_status()
    return (time.perf_counter() - t) * 1000


async def open_loop(base: str, paths: list[str], n: int, rate: float) -> list[float]:
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as client:
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.5

        async def one(i: int) -> float:
            due = start + i / rate
            await asyncio.sleep(max(0.0, due - loop.time()))
            (await client.get(paths[i % len(paths)])).raise_for_status()
            return (loop.time() - due) * 1000

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--database-url")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="API processes, each in turn")
    args = parser.parse_args()
    # The SQLite file of 100k trials is ~54 MB: removed with its folder when the run ends.
    with tempfile.TemporaryDirectory(prefix="tuner-api-bench-") as folder:
        tmp = Path(folder)
        url = args.database_url or f"sqlite:///{tmp / 'bench.db'}"
        t = time.perf_counter()
        big = populate(url, args.trials)
        print(
            f"populated {args.trials} trials in {time.perf_counter() - t:.1f} s ({url.split(':')[0]})",
            flush=True,
        )
        for workers in args.workers:
            print(f"\n--- tuner serve --no-worker --workers {workers} ---", flush=True)
            measure(url, tmp, big, workers, args.rate, args.seconds)


def measure(url: str, tmp: Path, big: int, workers: int, rate: float, seconds: float) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "TUNER_DATABASE_URL": url, "TUNER_WORK_DIR": str(tmp / "runs")}
    server = subprocess.Popen([TUNER, "serve", "--no-worker", "--workers", str(workers), "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            for _ in range(300):
                try:
                    client.get("/healthz")
                    break
                except httpx.HTTPError:
                    time.sleep(0.2)
            time.sleep(2.0 if workers > 1 else 0.0)  # every worker process up, not only the first
            last = client.get(f"/api/studies/{big}").json()["progress"]["finished"] - 1
            for _ in range(5):  # warm up
                timed(client, "/api/best")
            best = [timed(client, "/api/best") for _ in range(200)]
            rng = random.Random(1)
            pages = [timed(client, f"/api/studies/{big}/trials?after={rng.randrange(last)}&limit=1000")
                     for _ in range(100)]  # fmt: skip
            polls = [timed(client, f"/api/studies/{big}/trials?after={last}") for _ in range(200)]
        print(f"GET /api/best: p50 {pct(best, 0.5):.1f} ms, p99 {pct(best, 0.99):.1f} ms (200 requests)")
        print(f"GET /api/studies/{{id}}/trials?after=N&limit=1000 ({last + 1} trials in the study): "
              f"p50 {pct(pages, 0.5):.1f} ms, p99 {pct(pages, 0.99):.1f} ms (100 requests)")  # fmt: skip
        print(f"GET /api/studies/{{id}}/trials?after=<last> (polling): p50 {pct(polls, 0.5):.1f} ms, "
              f"p99 {pct(polls, 0.99):.1f} ms (200 requests)")  # fmt: skip
        # Open loop: requests start on schedule whether or not earlier ones finished (asyncio: one
        # client thread, so the client costs the shared cores as little as it can).
        paths = ["/api/best", f"/api/studies/{big}", f"/api/studies/{big}/trials?after={last}"]
        n = int(rate * seconds)
        latencies = asyncio.run(open_loop(base, paths, n, rate))
        achieved = n / (max(latencies) / 1000 + seconds)
        print(f"open loop {rate:.0f} requests/s for {seconds:.0f} s ({n} requests, ~{achieved:.0f}/s "
              f"served): p50 {pct(latencies, 0.5):.1f} ms, p99 {pct(latencies, 0.99):.1f} ms, "
              f"max {max(latencies):.1f} ms")  # fmt: skip
        print(f"median of the sequential /api/best: {statistics.median(best):.1f} ms")
    finally:
        server.terminate()  # uvicorn's supervisor stops its worker processes
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
