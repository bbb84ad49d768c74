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

from fastapi import FastAPI, Request
from sqlalchemy.orm import sessionmaker

from api import errors
from api.dashboard import mount_dashboard
from api.deps import token_hashes
from api.routers import results, service, studies
from tuner import __version__
from tuner.db import connect
from tuner.settings import Settings


def create_app(settings: Settings | None = None, sessions: sessionmaker | None = None) -> FastAPI:
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.sessions.kw["bind"].dispose()  # close the pool's connections on shutdown

    app = FastAPI(title="parallel-tuner", version=__version__, lifespan=lifespan,
                  description="Finds the fastest parallel layout to train a GPT on a cluster.")  # fmt: skip
    app.state.settings = settings
    app.state.sessions = sessions or connect(settings.database_url)
    app.state.token_hashes = token_hashes(settings)
    app.state.metrics = service.registry(app.state.sessions)
    errors.install(app)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["Authorization", "Content-Type"])  # fmt: skip

    @app.middleware("http")
    async def _limit_body(request: Request, call_next):
        """Refuse a body over the limit from its Content-Length before reading any of it (a
        chunked body is cut off while it streams in: api/routers/studies.py)."""
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
            return errors.error_response(
                413, "body_too_large", f"request body over {settings.max_body_bytes} bytes"
            )
        return await call_next(request)

    for module in (studies, results, service):
        app.include_router(module.router)
    mount_dashboard(app)  # the dashboard at /: static files over the endpoints above
    return app
