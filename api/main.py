"""The REST API: studies in, best layouts out. `create_app(settings)`; served by `tuner serve`.

The API never runs a trial in a request: it writes PENDING studies that workers (`tuner worker`,
or the one `tuner serve` embeds) claim. Writes need `Authorization: Bearer <token>` (settings:
TUNER_API_TOKEN, or TUNER_API_TOKENS_FILE of sha256 hashes for several users), compared in
constant time; reads too when TUNER_READ_AUTH is on. Every error has one body shape
(api/errors.py). One router per resource (api/routers/); queries in tuner/store, shapes in
tuner/views; database work runs in the threadpool (plain `def` endpoints).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy.orm import sessionmaker
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from api import errors
from api.dashboard import mount_dashboard
from api.deps import token_hashes
from api.reads import close_reader_threads, model_cache, response_cache
from api.routers import results, service, studies
from tuner import __version__
from tuner.db import connect
from tuner.settings import Settings


def create_app(settings: Settings | None = None, sessions: sessionmaker | None = None) -> FastAPI:
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        close_reader_threads(app)
        app.state.sessions.kw["bind"].dispose()  # close the pool's connections on shutdown

    app = FastAPI(title="parallel-tuner", version=__version__, lifespan=lifespan,
                  description="Finds the fastest parallel layout to train a GPT on a cluster.")  # fmt: skip
    app.state.settings = settings
    app.state.sessions = sessions or connect(settings.database_url)
    app.state.token_hashes = token_hashes(settings)
    app.state.metrics = service.registry(app.state.sessions)
    app.state.reads = response_cache()  # GET responses per store revision (api/reads.py)
    app.state.models = model_cache()
    errors.install(app)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["Authorization", "Content-Type"])  # fmt: skip

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    for module in (studies, results, service):
        app.include_router(module.router)
    mount_dashboard(app)  # the dashboard at /: static files over the endpoints above
    return app


class BodyLimit:
    """Refuse a body over the limit from its Content-Length before reading any of it (a chunked
    body is cut off while it streams in: api/routers/studies.py). A plain ASGI middleware: the
    `@app.middleware("http")` kind runs every request through a task and a stream of its own."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = Headers(scope=scope).get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
                response = errors.error_response(
                    413, "body_too_large", f"request body over {self.max_bytes} bytes"
                )
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
