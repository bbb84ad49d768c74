"""Studies and their trials: submit, list, read, cancel, delete. Routers are thin: queries are in
tuner/store, the shapes in tuner/views."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import yaml
from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, Response
from pydantic import BeforeValidator, TypeAdapter, WithJsonSchema

from api.deps import Read, SessionDep, Write, study_or_404
from api.errors import ApiError, parse_spec
from api.reads import cached_json, cached_model
from tuner import store, views
from tuner.frames import trials_frame
from tuner.outcome import StudyStatus, accepted_words, words
from tuner.space import SearchSpace
from tuner.spec import StudySpec

if TYPE_CHECKING:  # an annotation only: routers do not import SQLAlchemy (pyproject.toml)
    from sqlalchemy.orm import Session

router = APIRouter(prefix="/api/studies", tags=["studies"])
_PAGE_JSON = TypeAdapter(views.TrialPage)
_DETAIL_JSON = TypeAdapter(views.StudyDetail)

# Ids are 32-bit integers in every database we support: larger ones are refused (422), not sent.
StudyId = Annotated[int, PathParam(ge=1, le=2**31 - 1, description="the study's id")]
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")
# A study status filter: a word of the vocabulary, or an older word (docs/api.md), in any case; a
# 422 names the words otherwise.
StatusFilter = Annotated[
    StudyStatus | None,
    BeforeValidator(lambda v: None if v is None else StudyStatus.parse(v)),
    WithJsonSchema({"type": "string", "enum": list(accepted_words(StudyStatus))}),
    Query(description=f"one of {', '.join(words(StudyStatus).values())}; older words (done, the upper-case "
                      "states) are accepted too, in any case"),
]  # fmt: skip


async def _body(request: Request) -> Any:
    """The JSON or YAML body, refused past the size limit while it streams in."""
    limit = request.app.state.settings.max_body_bytes
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise ApiError(413, "body_too_large", f"request body over {limit} bytes")
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    try:
        if ctype in YAML_TYPES:
            return yaml.safe_load(bytes(raw).decode())
        if ctype in ("application/json", ""):
            return json.loads(raw)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ApiError(400, "malformed_yaml", f"the body is not valid YAML: {e}") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, "malformed_json", f"the body is not valid JSON: {e}") from None
    raise ApiError(415, "unsupported_media_type",
                   f"content type {ctype!r}: send application/json or application/yaml")  # fmt: skip


def _create(request: Request, spec: StudySpec) -> views.StudyCreated:
    """The space check and the insert, in the threadpool (CPU and database work)."""
    space = SearchSpace.from_spec(spec).enumerate()
    if not space.valid:
        detail = [
            {"rule": r, "layouts": n, "example": space.examples[r]} for r, n in space.rejected.most_common()
        ]
        raise ApiError(422, "no_valid_layout", f"the space has no valid layout ({space.num_rejected} rejected): "
                       + "; ".join(f"{d['example']} ({d['layouts']} layouts)" for d in detail[:3]), detail)  # fmt: skip
    with request.app.state.sessions.begin() as s:
        try:
            study = store.create_study(s, spec)
        except store.StudyExists as e:
            raise ApiError(409, "study_exists", str(e)) from None
        return views.StudyCreated(
            id=study.id, name=study.name, status=study.status, url=f"/api/studies/{study.id}"
        )


@router.post("", status_code=201, response_model=views.StudyCreated, dependencies=[Write],
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": {"type": "object"}},
                 "application/yaml": {"schema": {"type": "string"}}}}})  # fmt: skip
async def submit(request: Request) -> views.StudyCreated:
    """Submit a study (JSON, or a YAML study file as application/yaml). 201 with its id; a worker
    runs it. 422 names each bad field, or says why no layout is valid."""
    spec = parse_spec(await _body(request))
    return await run_in_threadpool(_create, request, spec)


@router.get("", response_model=views.StudyPage, dependencies=[Read])
def list_studies(
    session: SessionDep,
    status: StatusFilter = None,
    model: Annotated[str | None, Query(max_length=200)] = None,
    cluster: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> views.StudyPage:
    """A page of studies, newest first, in a constant number of queries."""
    rows, total = store.find_studies(session, status=status,
                                     model=model, cluster=cluster, limit=limit, offset=offset)  # fmt: skip
    return views.StudyPage(items=views.summaries(session, rows), total=total, limit=limit, offset=offset)


@router.get("/{study_id}", response_model=views.StudyDetail, dependencies=[Read])
async def get_study(request: Request, study_id: StudyId) -> Response:
    """The study: its spec, status and reason, who holds it (the lease's age as of this request),
    its progress, best trial and payoff."""
    return await cached_model(request, ("study", study_id), _DETAIL_JSON,
                              lambda s: views.detail_and_lease(s, study_or_404(s, study_id)), views.aged)  # fmt: skip


@router.get("/{study_id}/trials", response_model=views.TrialPage, dependencies=[Read])
async def get_trials(
    request: Request,
    study_id: StudyId,
    after: Annotated[int, Query(ge=-1, le=10**9, description="only trials numbered above this")] = -1,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Response:
    """Trials numbered above `after`, in order, and the number to ask after next time (polling)."""

    def page(session: Session) -> views.TrialPage:
        study = study_or_404(session, study_id)
        items = [views.trial(t) for t in store.trials_after(session, study, after, limit)]
        return views.TrialPage(items=items, last_number=items[-1].number if items else after)

    return await cached_json(request, ("trials", study_id, after, limit), _PAGE_JSON, page)


@router.get("/{study_id}/calibration", response_model=views.StudyCalibration, dependencies=[Read])
def get_calibration(study_id: StudyId, session: SessionDep) -> views.StudyCalibration:
    """Each completed trial as the model predicted it when proposed and as the study's calibration
    (fitted when the study ends) predicts it now: what the model learnt from the study."""
    return views.study_calibration(session, study_or_404(session, study_id))


@router.get("/{study_id}/trials.csv", dependencies=[Read], response_class=PlainTextResponse,
            responses={200: {"content": {"text/csv": {}}}})  # fmt: skip
def trials_csv(study_id: StudyId, session: SessionDep) -> Response:
    """Every trial as one flat table (for notebooks and spreadsheets)."""
    text = trials_frame(store.trials(session, study_or_404(session, study_id))).to_csv(index=False)
    return Response(text, media_type="text/csv",
                    headers={"Content-Disposition": f'attachment; filename="study-{study_id}-trials.csv"'})  # fmt: skip


@router.post("/{study_id}/cancel", response_model=views.StudySummary, dependencies=[Write])
def cancel(study_id: StudyId, session: SessionDep) -> views.StudySummary:
    """Cancel a pending or running study: a pending one with nothing running ends at once;
    otherwise it is `cancelling` until its worker has stopped its trials. Cancelling again
    changes nothing (the first reason is kept); a finished study is 409."""
    with session.begin():
        study_or_404(session, study_id)
        result = store.cancel(session, study_id, "cancelled through the API")
        if result.status.is_final and not result.took:
            raise ApiError(409, "already_finished", result.message)
    return views.summaries(session, [study_or_404(session, study_id)])[0]


@router.delete("/{study_id}", status_code=204, dependencies=[Write])
def delete(study_id: StudyId, session: SessionDep) -> Response:
    """Delete a finished study and its trials (409 while it is pending or running)."""
    with session.begin():
        study = study_or_404(session, study_id)
        if not store.status_of(study).is_final:
            raise ApiError(
                409, "not_finished", f"study {study_id} is {store.status_of(study).word}; cancel it first"
            )
        store.delete_study(session, study)
    return Response(status_code=204)
