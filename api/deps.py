"""FastAPI dependencies: the settings, a database session per request, and auth."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from api.errors import ApiError
from tuner import store
from tuner.settings import Settings


# The settings and auth dependencies do no I/O: `async`, so they run on the event loop, not a trip
# to the thread pool each (tens of microseconds, per request: api/reads.py).
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    """One session per request; endpoints are plain `def`s, so it runs in the threadpool and a
    slow or locked database never blocks the event loop."""
    with request.app.state.sessions() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]


def token_hashes(settings: Settings) -> list[str]:
    hashes = []
    if settings.api_token:
        hashes.append(hashlib.sha256(settings.api_token.strip().encode()).hexdigest())
    if settings.api_tokens_file:
        for line in settings.api_tokens_file.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                hashes.append(line.rpartition(":")[2].strip().lower())
    return hashes


def _check(request: Request, settings: Settings) -> None:
    hashed = request.app.state.token_hashes
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if not hashed:
        if settings.allow_anonymous_writes:
            return
        raise ApiError(503, "auth_not_configured", "no API token is configured on the server "
                       "(TUNER_API_TOKEN or TUNER_API_TOKENS_FILE)")  # fmt: skip
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "unauthorized", "missing bearer token (Authorization: Bearer <token>)")
    digest = hashlib.sha256(token.strip().encode()).hexdigest()
    if not any(hmac.compare_digest(digest, h) for h in hashed):  # every hash compared: constant time
        raise ApiError(401, "unauthorized", "invalid token")


async def require_write(request: Request, settings: SettingsDep) -> None:
    _check(request, settings)


async def require_read(request: Request, settings: SettingsDep) -> None:
    if settings.read_auth:
        _check(request, settings)


Read, Write = Depends(require_read), Depends(require_write)


def study_or_404(session: Session, study_id: int) -> store.Study:
    study = store.study_by_id(session, study_id)
    if study is None:
        raise ApiError(404, "not_found", f"no study with id {study_id}")
    return study
