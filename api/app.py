"""The REST API: studies in, best layouts out. `create_app(settings)`; served by `tuner serve`.

The API never runs a trial in a request: it writes PENDING studies that workers (`tuner worker`,
or the one `tuner serve` embeds) claim. Writes need `Authorization: Bearer <token>` (settings:
TUNER_API_TOKEN, or TUNER_API_TOKENS_FILE of sha256 hashes for several users), compared in
constant time; reads too when TUNER_READ_AUTH is on. Every error has one body shape:
{"error": {"status": 422, "code": "invalid_spec", "message": "...", "detail": [...]}}.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import io
import json
import logging
from typing import Annotated, Any

import yaml
from fastapi import Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.frames import trials_frame
from tuner import __version__, store
from tuner.db import Study, aware, connect, utcnow
from tuner.outcome import STATUS_FROM_WORD, STATUS_WORDS, StudyStatus, TrialState
from tuner.plan import PlanError, parse_pins
from tuner.plan import plan as run_plan
from tuner.settings import Settings
from tuner.space import SearchSpace
from tuner.spec import StudySpec

log = logging.getLogger("tuner.api")

STATUS_IN = {word: status.value for word, status in STATUS_FROM_WORD.items()}
# Ids are 32-bit integers in every database we support: larger ones are refused (422), not sent.
StudyId = Annotated[int, PathParam(ge=1, le=2**31 - 1, description="the study's id")]
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, detail: list | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.detail = status, code, message, detail or []


def _error(status: int, code: str, message: str, detail: list | None = None, headers=None) -> JSONResponse:
    body = {"error": {"status": status, "code": code, "message": message, "detail": detail or []}}
    return JSONResponse(body, status_code=status, headers=headers)


# --- response models (the OpenAPI schema) ------------------------------------------------------


class StudyCreated(BaseModel):
    id: int
    name: str
    status: str
    url: str


class Progress(BaseModel):
    finished: int
    budget: int
    by_state: dict[str, int]


class LeaseOut(BaseModel):
    owner: str
    host: str | None
    pid: int | None
    renewed_s_ago: float | None
    expires_in_s: float | None  # negative: expired (another worker may take the study)


class StudySummary(BaseModel):
    id: int
    name: str
    status: str
    reason: str | None = None  # why it is in its status: a failure, the cancel request, a pause
    lease: LeaseOut | None = None  # who runs it now
    owner: str | None = None  # who holds it, or last held it
    model: str
    cluster: str
    gpus: int
    sampler: str
    created_at: dt.datetime
    progress: Progress
    best_tokens_per_s: float | None = None
    best_mfu: float | None = None


class StudyPage(BaseModel):
    items: list[StudySummary]
    total: int
    limit: int
    offset: int


class TrialOut(BaseModel):
    number: int
    state: str
    layout: str
    config: dict[str, Any]
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    zero_stage: int
    activation_checkpoint: str
    sequence_parallel: bool
    tokens_per_s: float | None
    tflops_per_device: float | None
    mfu: float | None
    peak_memory_bytes: int | None
    step_time_median_s: float | None
    predicted_tokens_per_s: float | None
    predicted_memory_bytes: float | None
    failure_kind: str | None
    failure_message: str | None
    job_id: str | None
    job_state: str | None
    attempts: int
    attempt_log: list[dict[str, Any]] | None = None  # every ended attempt: job, state, kind, times
    device_s: float = 0.0
    told: str | None = None  # what the sampler heard: score, infeasible, nothing
    started_at: dt.datetime | None
    finished_at: dt.datetime | None


class StudyDetail(StudySummary):
    spec: dict[str, Any]
    error: str | None
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    best: TrialOut | None


class TrialPage(BaseModel):
    items: list[TrialOut]
    last_number: int  # pass as ?after= to get only newer trials


class BestOut(BaseModel):
    study_id: int
    study: str
    model: str
    num_params: int
    cluster: str
    gpus: int
    trial_number: int
    layout: str
    config: dict[str, Any]
    tokens_per_s: float
    tflops_per_device: float | None
    mfu: float | None
    peak_memory_bytes: int | None
    predicted_tokens_per_s: float | None


class PlanRequest(BaseModel):
    spec: dict[str, Any] = Field(description="a study spec, as in studies/*.yaml")
    config: str | None = Field(None, description="pinned knobs, e.g. 'tp=8,pp=4'")
    top: int = Field(10, ge=1, le=1000)
    include_unfit: bool = False


# --- the app ------------------------------------------------------------------------------------


def create_app(settings: Settings | None = None, sessions: sessionmaker | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    sessions = sessions or connect(settings.database_url)
    hashed = _load_token_hashes(settings)
    app = FastAPI(title="parallel-tuner", version=__version__,
                  description="Finds the fastest parallel layout to train a GPT on a cluster.")  # fmt: skip
    app.state.settings, app.state.sessions = settings, sessions

    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["Authorization", "Content-Type"])  # fmt: skip

    # --- errors: one shape ---

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return _error(e.status, e.code, e.message, e.detail, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return _error(e.status_code, code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        detail = [
            {"field": ".".join(str(p) for p in err["loc"]), "message": err["msg"]} for err in e.errors()
        ]
        return _error(
            422, "invalid_request", "; ".join(f"{d['field']}: {d['message']}" for d in detail), detail
        )

    @app.exception_handler(OperationalError)
    async def _db_error(_: Request, e: OperationalError) -> JSONResponse:
        log.error("database error: %s", str(e.orig).splitlines()[0])
        return _error(503, "database_unavailable", "the database is unavailable; try again")

    # --- auth ---

    def _check(request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
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

    def require_write(request: Request) -> None:
        _check(request)

    def require_read(request: Request) -> None:
        if settings.read_auth:
            _check(request)

    Read, Write = Depends(require_read), Depends(require_write)

    # --- body size: refuse > max_body_bytes before reading it all ---

    @app.middleware("http")
    async def _limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
            return _error(413, "body_too_large", f"request body over {settings.max_body_bytes} bytes")
        return await call_next(request)

    async def _body(request: Request) -> Any:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > settings.max_body_bytes:
                raise ApiError(413, "body_too_large", f"request body over {settings.max_body_bytes} bytes")
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

    def _spec(data: Any) -> StudySpec:
        if not isinstance(data, dict):
            raise ApiError(422, "invalid_spec", "a study spec is a mapping (JSON object / YAML mapping)")
        try:
            return StudySpec.model_validate(data)
        except ValidationError as e:
            detail = [{"field": ".".join(str(p) for p in err["loc"]) or "spec",
                       "message": err["msg"].removeprefix("Value error, ")} for err in e.errors()]  # fmt: skip
            raise ApiError(422, "invalid_spec", "invalid study spec: " + "; ".join(
                f"{d['field']}: {d['message']}" for d in detail), detail) from None  # fmt: skip

    def _study(s, study_id: int) -> Study:
        study = s.get(Study, study_id)
        if study is None:
            raise ApiError(404, "not_found", f"no study with id {study_id}")
        return study

    # --- endpoints ---

    @app.get("/healthz", tags=["service"])
    def healthz() -> dict[str, str]:
        with sessions() as s:
            s.execute(Study.__table__.select().limit(1))
        return {"status": "ok", "version": __version__}

    @app.post("/api/studies", status_code=201, response_model=StudyCreated, tags=["studies"],
              dependencies=[Write],
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": {"type": "object"}},
                  "application/yaml": {"schema": {"type": "string"}}}}})  # fmt: skip
    async def submit(request: Request) -> StudyCreated:
        """Submit a study (JSON, or a YAML study file as application/yaml). 201 with its id; a
        worker runs it. 422 names each bad field, or says why no layout is valid."""
        spec = _spec(await _body(request))
        space = SearchSpace.from_spec(spec).enumerate()
        if not space.valid:
            detail = [
                {"rule": r, "layouts": n, "example": space.examples[r]}
                for r, n in space.rejected.most_common()
            ]
            raise ApiError(422, "no_valid_layout", f"the space has no valid layout ({space.num_rejected} rejected): "
                           + "; ".join(f"{d['example']} ({d['layouts']} layouts)" for d in detail[:3]), detail)  # fmt: skip
        with sessions.begin() as s:
            try:
                study = store.create_study(s, spec)
            except store.StudyExists as e:
                raise ApiError(409, "study_exists", str(e)) from None
            created = StudyCreated(id=study.id, name=study.name, status=store.status_of(study).word,
                                   url=f"/api/studies/{study.id}")  # fmt: skip
        return created

    @app.get("/api/studies", response_model=StudyPage, tags=["studies"], dependencies=[Read])
    def list_studies(
        status: Annotated[
            str | None, Query(pattern="^(pending|running|cancelling|done|cancelled|failed)$")
        ] = None,
        model: Annotated[str | None, Query(max_length=200)] = None,
        cluster: Annotated[str | None, Query(max_length=200)] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
    ) -> StudyPage:
        with sessions() as s:
            rows, total = store.find_studies(s, status=STATUS_IN.get(status or ""), model=model, cluster=cluster,
                                             limit=limit, offset=offset)  # fmt: skip
            counts = store.trial_counts(s, [r.id for r in rows])
            items = [_summary(s, r, counts[r.id]) for r in rows]
        return StudyPage(items=items, total=total, limit=limit, offset=offset)

    @app.get("/api/studies/{study_id}", response_model=StudyDetail, tags=["studies"], dependencies=[Read])
    def get_study(study_id: StudyId) -> StudyDetail:
        with sessions() as s:
            study = _study(s, study_id)
            summary = _summary(s, study, store.trial_counts(s, [study.id])[study.id])
            best = store.best_trial(s, study)
            return StudyDetail(**summary.model_dump(), spec=study.spec, error=study.error,
                               started_at=study.started_at, finished_at=study.finished_at,
                               best=_trial(best) if best else None)  # fmt: skip

    @app.get(
        "/api/studies/{study_id}/trials", response_model=TrialPage, tags=["studies"], dependencies=[Read]
    )
    def get_trials(
        study_id: StudyId,
        after: Annotated[int, Query(ge=-1, le=10**9, description="only trials numbered above this")] = -1,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> TrialPage:
        with sessions() as s:
            rows = store.trials_after(s, _study(s, study_id), after, limit)
            items = [_trial(t) for t in rows]
        return TrialPage(items=items, last_number=items[-1].number if items else after)

    @app.get("/api/studies/{study_id}/trials.csv", tags=["studies"], dependencies=[Read],
             response_class=PlainTextResponse, responses={200: {"content": {"text/csv": {}}}})  # fmt: skip
    def trials_csv(study_id: StudyId) -> Response:
        """Every trial as one flat table (for notebooks and spreadsheets)."""
        with sessions() as s:
            study = _study(s, study_id)
            text = trials_frame(store.trials(s, study)).to_csv(index=False)
        return Response(text, media_type="text/csv",
                        headers={"Content-Disposition": f'attachment; filename="study-{study_id}-trials.csv"'})  # fmt: skip

    @app.post(
        "/api/studies/{study_id}/cancel", response_model=StudySummary, tags=["studies"], dependencies=[Write]
    )
    def cancel(study_id: StudyId) -> StudySummary:
        """Cancel a pending or running study: a pending one with nothing running ends at once;
        otherwise it is `cancelling` until its worker has stopped its trials. Cancelling again
        changes nothing (the first reason is kept); a finished study is 409."""
        with sessions.begin() as s:
            study = _study(s, study_id)
            result = store.cancel(s, study.id, "cancelled through the API")
            if result.status.is_final and not result.took:
                raise ApiError(409, "already_finished", result.message)
            study = _study(s, study_id)
            return _summary(s, study, store.trial_counts(s, [study.id])[study.id])

    @app.delete("/api/studies/{study_id}", status_code=204, tags=["studies"], dependencies=[Write])
    def delete(study_id: StudyId) -> Response:
        """Delete a finished study and its trials (409 while it is pending or running)."""
        with sessions.begin() as s:
            study = _study(s, study_id)
            if not store.status_of(study).is_final:
                raise ApiError(
                    409, "not_finished", f"study {study_id} is {store.status_of(study).word}; cancel it first"
                )
            s.delete(study)
        return Response(status_code=204)

    @app.get("/api/best", response_model=list[BestOut], tags=["results"], dependencies=[Read])
    def best(
        model: Annotated[str | None, Query(max_length=200)] = None,
        gpus: Annotated[int | None, Query(ge=1, le=10**7)] = None,
        cluster: Annotated[str | None, Query(max_length=200)] = None,
    ) -> list[BestOut]:
        """The fastest measured layout per (model, cluster, GPUs) across studies."""
        with sessions() as s:
            return [BestOut(**row) for row in store.best_rows(s, model=model, cluster=cluster, num_gpus=gpus)]

    @app.post("/api/plan", tags=["results"], dependencies=[Read])
    def plan(body: PlanRequest) -> dict[str, Any]:
        """Rank every valid layout by the performance model, without running any (= `tuner plan --json`)."""
        spec = _spec(body.spec)
        try:
            constants = None
            with sessions() as s:
                constants = store.latest_constants(s, spec.cluster.name)
            return run_plan(spec, pins=parse_pins(body.config), top=body.top, include_unfit=body.include_unfit,
                            constants=constants)  # fmt: skip
        except PlanError as e:
            raise ApiError(422, "invalid_plan", str(e)) from None

    @app.get("/api/studies/{study_id}/export", tags=["results"], dependencies=[Read],
             response_class=PlainTextResponse)  # fmt: skip
    def export(
        study_id: StudyId, format: Annotated[str, Query(pattern="^(torchtitan|megatron|sbatch)$")]
    ) -> Response:
        """The study's best layout as a launch config: torchtitan TOML, Megatron-LM arguments, or an
        sbatch script running the bundled trainer."""
        from tuner.export import export_layout

        with sessions() as s:
            study = _study(s, study_id)
            best = store.best_trial(s, study)
            if best is None:
                raise ApiError(409, "no_result", f"study {study_id} has no completed trial yet")
            text = export_layout(format, StudySpec.model_validate(study.spec), store.config_of(best))
        media = {"torchtitan": "application/toml", "megatron": "text/plain", "sbatch": "text/x-shellscript"}
        return Response(text, media_type=media[format])

    @app.get("/metrics", tags=["service"], response_class=PlainTextResponse)
    def metrics() -> Response:
        """Prometheus text format: studies by state, trials by state, trial durations."""
        with sessions() as s:
            studies, trials = store.state_counts(s)
            durations = store.finished_durations(s)
        return Response(prometheus_text(studies, trials, durations), media_type="text/plain; version=0.0.4")

    from api.dashboard import mount_dashboard

    mount_dashboard(app)  # the dashboard at /: static files over the endpoints above
    return app


def _load_token_hashes(settings: Settings) -> list[str]:
    hashes = []
    if settings.api_token:
        hashes.append(hashlib.sha256(settings.api_token.strip().encode()).hexdigest())
    if settings.api_tokens_file:
        for line in settings.api_tokens_file.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                hashes.append(line.rpartition(":")[2].strip().lower())
    return hashes


def _summary(s, study: Study, counts: dict[str, int]) -> StudySummary:
    best = store.best_trial(s, study)
    finished = sum(n for state, n in counts.items() if TrialState(state).is_finished())
    return StudySummary(
        id=study.id, name=study.name, status=store.status_of(study).word, reason=study.error,
        lease=_lease(study), owner=study.lease_owner, model=study.model_key,
        cluster=study.cluster_key, gpus=study.num_gpus, sampler=study.sampler, created_at=study.created_at,
        progress=Progress(finished=finished, budget=study.spec.get("budget", {}).get("max_trials", 0), by_state=counts),
        best_tokens_per_s=best.tokens_per_s if best else None, best_mfu=best.mfu if best else None,
    )  # fmt: skip


def _lease(study: Study) -> LeaseOut | None:
    if study.lease_owner is None or study.lease_expires_at is None:
        return None
    now = utcnow()
    renewed = aware(study.lease_renewed_at)
    return LeaseOut(owner=study.lease_owner, host=study.lease_host, pid=study.lease_pid,
                    renewed_s_ago=(now - renewed).total_seconds() if renewed else None,
                    expires_in_s=(aware(study.lease_expires_at) - now).total_seconds())  # fmt: skip


def _trial(t) -> TrialOut:
    return TrialOut(
        number=t.number, state=t.state, layout=store.config_of(t).describe(), config=t.config, tp=t.tp, pp=t.pp,
        dp=t.dp, micro_batch_size=t.micro_batch_size, num_microbatches=t.num_microbatches, zero_stage=t.zero_stage,
        activation_checkpoint=t.activation_checkpoint, sequence_parallel=t.sequence_parallel,
        tokens_per_s=t.tokens_per_s, tflops_per_device=t.tflops_per_device, mfu=t.mfu,
        peak_memory_bytes=t.peak_memory_bytes, step_time_median_s=t.step_time_median_s,
        predicted_tokens_per_s=t.predicted_tokens_per_s, predicted_memory_bytes=t.predicted_memory_bytes,
        failure_kind=t.failure_kind, failure_message=t.failure_message, job_id=t.job_id, job_state=t.job_state,
        attempts=t.attempts, attempt_log=t.attempt_log, device_s=t.device_s or 0.0, told=t.told,
        started_at=t.started_at, finished_at=t.finished_at,
    )  # fmt: skip


def prometheus_text(studies: dict[str, int], trials: dict[str, int], durations: list[float]) -> str:
    out = io.StringIO()
    out.write("# HELP tuner_studies Studies by state.\n# TYPE tuner_studies gauge\n")
    for status in StudyStatus:
        out.write(f'tuner_studies{{state="{STATUS_WORDS[status]}"}} {studies.get(status.value, 0)}\n')
    out.write("# HELP tuner_trials Trials by state.\n# TYPE tuner_trials gauge\n")
    for state in TrialState:
        out.write(f'tuner_trials{{state="{state.value.lower()}"}} {trials.get(state.value, 0)}\n')
    out.write("# HELP tuner_trial_duration_seconds Wall time of finished trials.\n"
              "# TYPE tuner_trial_duration_seconds histogram\n")  # fmt: skip
    for le in (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600):
        out.write(f'tuner_trial_duration_seconds_bucket{{le="{le}"}} {sum(d <= le for d in durations)}\n')
    out.write(f'tuner_trial_duration_seconds_bucket{{le="+Inf"}} {len(durations)}\n')
    out.write(f"tuner_trial_duration_seconds_sum {sum(durations):.3f}\n")
    out.write(f"tuner_trial_duration_seconds_count {len(durations)}\n")
    return out.getvalue()
