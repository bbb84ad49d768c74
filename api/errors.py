"""One error body for every failure: {"error": {"status", "code", "message", "detail": [...]}};
422s list {"field", "message"} per problem, formatted like a spec file's errors
(tuner/spec.py: validation_problems)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tuner.spec import StudySpec, validation_problems

log = logging.getLogger("tuner.api")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, detail: list | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.detail = status, code, message, detail or []


def error_response(status: int, code: str, message: str, detail: list | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    body = {"error": {"status": status, "code": code, "message": message, "detail": detail or []}}
    return JSONResponse(body, status_code=status, headers=headers)


def _joined(problems: list[dict[str, str]]) -> str:
    return "; ".join(f"{p['field']}: {p['message']}" if p["field"] else p["message"] for p in problems)


def parse_spec(data: Any) -> StudySpec:
    """A study spec from a request body, or 422 naming each bad field."""
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_spec", "a study spec is a mapping (JSON object / YAML mapping)")
    try:
        return StudySpec.model_validate(data)
    except ValidationError as e:
        problems = [{**p, "field": p["field"] or "spec"} for p in validation_problems(e.errors())]
        raise ApiError(422, "invalid_spec", "invalid study spec: " + _joined(problems), problems) from None


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return error_response(e.status, e.code, e.message, e.detail, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return error_response(e.status_code, code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        problems = validation_problems(e.errors())
        return error_response(422, "invalid_request", _joined(problems), problems)

    @app.exception_handler(OperationalError)
    async def _db_error(_: Request, e: OperationalError) -> JSONResponse:
        log.error("database error: %s", str(e.orig).splitlines()[0])
        return error_response(503, "database_unavailable", "the database is unavailable; try again")
