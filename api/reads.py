"""Reads as fast as the data allows: GET responses built once per store revision (tuner/db.py:
every committed write bumps it; tuner/cache.py), and one trip to the thread pool per request.

- A request reads the revision (one primary-key row, on a pooled connection: no session); while
  nothing was written since the same question was answered, it gets the same bytes, never older
  than the database it read (what is built after that read is at least as new). Bodies over
  MAX_KEPT_BYTES (a page of many trials) are built every time.
- A response that is a function of the database is kept as bytes (`cached_json`); a study's
  detail is kept as a model with its lease's times, and its lease's age, which moves with the
  clock, is computed per request before it is written out (`cached_model`).
- The endpoints that use these are `async` and do their database work in one trip to a thread
  that opens and closes its own session: with the `SessionDep` of a plain `def` endpoint a
  request makes three trips to the thread pool (the session's enter and exit, the endpoint),
  each a hand-off that cost more than the cached read itself. The trip is asyncio's own
  `run_in_executor` on the app's reader threads (~0.05-0.08 ms here), not Starlette's
  `run_in_threadpool` (~0.15-0.28 ms: anyio's capacity limiter and cancel scope); as many threads
  as that pool's limit (40), so as many reads may wait on a slow database as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import TypeAdapter
from sqlalchemy.orm import Session

from tuner import store
from tuner.cache import RevisionCache

MAX_KEPT_BYTES = 64 * 1024
MAX_ENTRIES = 512  # at most 32 MB of bodies
READER_THREADS = 40  # anyio's default thread limit, which these reads used before


def response_cache() -> RevisionCache[bytes]:
    return RevisionCache(max_entries=MAX_ENTRIES)


def model_cache() -> RevisionCache[Any]:
    return RevisionCache(max_entries=MAX_ENTRIES)


def close_reader_threads(app: FastAPI) -> None:
    """At the app's shutdown (its lifespan); a later request (an app started again) makes new ones."""
    pool = getattr(app.state, "reader_threads", None)
    app.state.reader_threads = None
    if pool is not None:
        pool.shutdown(wait=True)


async def cached_json(
    request: Request, key: Hashable, adapter: TypeAdapter, build: Callable[[Session], Any]
) -> Response:
    """`build(session)` as JSON (by `adapter`: the endpoint's response model), kept per revision."""
    state = request.app.state

    def fresh() -> bytes:
        with state.sessions() as session:
            return adapter.dump_json(build(session))

    def read() -> bytes:
        with state.sessions.kw["bind"].connect() as conn:
            revision = store.revision(conn)
        return state.reads.get(key, revision, fresh, keep_if=lambda body: len(body) <= MAX_KEPT_BYTES)

    return Response(await _in_thread(request, read), media_type="application/json")


async def cached_model(
    request: Request,
    key: Hashable,
    adapter: TypeAdapter,
    build: Callable[[Session], Any],
    now: Callable[[Any], Any],
) -> Response:
    """`build(session)`, kept per revision, brought to the present by `now(kept)` and written out
    as JSON (by `adapter`) on every request."""
    state = request.app.state

    def fresh() -> Any:
        with state.sessions() as session:
            return build(session)

    def read() -> bytes:
        with state.sessions.kw["bind"].connect() as conn:
            revision = store.revision(conn)
        return adapter.dump_json(now(state.models.get(key, revision, fresh)))

    return Response(await _in_thread(request, read), media_type="application/json")


def _in_thread(request: Request, fn: Callable[[], bytes]) -> asyncio.Future[bytes]:
    """fn() on one of the app's reader threads (made on first use, on the event loop's thread, one
    thread per read in flight up to the limit): the database never blocks the event loop."""
    state = request.app.state
    if getattr(state, "reader_threads", None) is None:
        state.reader_threads = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="tuner-read")
    return asyncio.get_running_loop().run_in_executor(state.reader_threads, fn)
