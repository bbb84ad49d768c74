"""Results: the best layout per model size, plans from the performance model, launch configs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, Field, TypeAdapter

from api.deps import Read, SessionDep, SettingsDep, study_or_404
from api.errors import ApiError, parse_spec
from api.reads import cached_json
from api.routers.studies import StudyId
from trainer.contract.axes import axes_payload
from tuner import store, views
from tuner.plan import PlanError, parse_pins
from tuner.plan import plan as run_plan
from tuner.spec import StudySpec

router = APIRouter(tags=["results"])
BEST_ROWS = list[views.best_row_type()]
_BEST_JSON = TypeAdapter(BEST_ROWS)


class PlanRequest(BaseModel):
    spec: dict[str, Any] = Field(description="a study spec, as in studies/*.yaml")
    config: str | None = Field(None, description="pinned knobs, e.g. 'tp=8,pp=4'")
    top: int = Field(10, ge=1, le=1000)
    include_unfit: bool = False
    export: Literal["torchtitan", "megatron", "sbatch"] | None = Field(
        None,
        description="rank only the layouts this format can express; the plan's `export` holds the fastest "
        "fitting one's launch config (= `tuner plan --export`)",
    )


@router.get("/api/best", response_model=BEST_ROWS, dependencies=[Read])
async def best(
    request: Request,
    model: Annotated[str | None, Query(max_length=200)] = None,
    gpus: Annotated[int | None, Query(ge=1, le=10**7)] = None,
    cluster: Annotated[str | None, Query(max_length=200)] = None,
    global_batch: Annotated[int | None, Query(ge=1, le=10**9, description="for a prediction")] = None,
) -> list:
    """The fastest measured layout per (model, cluster, GPUs) across studies. For a model preset
    with no measurement, the planner's prediction on each calibrated cluster instead, marked
    `kind: predicted`, with the calibration used and a command that confirms it."""
    return await cached_json(
        request, ("best", model, gpus, cluster, global_batch), _BEST_JSON,
        lambda s: views.best_or_predicted(s, model=model, cluster=cluster, num_gpus=gpus, global_batch=global_batch),
    )  # fmt: skip


class AxisOut(BaseModel):
    name: str
    label: str
    heading: str  # its column's heading in a table of layouts: the label, or a shorter word
    help: str
    type: str  # int, bool or str
    default: Any
    choices: list[Any]  # the values the trainer accepts; empty for a degree (an int >= 1)
    multiplies_world: bool


@router.get("/api/axes", response_model=list[AxisOut], dependencies=[Read])
def axes() -> list[dict[str, Any]]:
    """The parallel axes of a layout, in order (trainer/contract/axes.py): every trial carries one
    field per axis; the dashboard draws its parallel coordinates from this list."""
    return axes_payload()


@router.post("/api/plan", dependencies=[Read])
def plan(body: PlanRequest, session: SessionDep, settings: SettingsDep) -> dict[str, Any]:
    """Rank every valid layout by the performance model, without running any (= `tuner plan --json`)."""
    from tuner.exports import export_site

    spec = parse_spec(body.spec)
    try:
        return run_plan(spec, pins=parse_pins(body.config), top=body.top, include_unfit=body.include_unfit,
                        constants=store.latest_constants(session, spec.cluster.name), export=body.export,
                        site=export_site(settings.slurm) if body.export == "sbatch" else None)  # fmt: skip
    except PlanError as e:
        raise ApiError(422, "invalid_plan", str(e)) from None


@router.get("/api/studies/{study_id}/export", dependencies=[Read], response_class=PlainTextResponse)
def export(
    study_id: StudyId,
    session: SessionDep,
    settings: SettingsDep,
    format: Annotated[str, Query(pattern="^(torchtitan|megatron|sbatch)$")],
) -> Response:
    """The study's best layout as a launch config: torchtitan, Megatron-LM arguments, or an sbatch
    script running the bundled trainer."""
    from tuner.exports import export_layout, export_site

    study = study_or_404(session, study_id)
    best = store.best_trial(session, study)
    if best is None:
        raise ApiError(409, "no_result", f"study {study_id} has no completed trial yet")
    try:
        text = export_layout(format, StudySpec.model_validate(study.spec), store.config_of(best),
                             site=export_site(settings.slurm) if format == "sbatch" else None)  # fmt: skip
    except ValueError as e:  # a layout the framework cannot run: the reason
        raise ApiError(422, "not_exportable", str(e)) from None
    media = {"torchtitan": "text/x-python", "megatron": "text/plain", "sbatch": "text/x-shellscript"}
    return Response(text, media_type=media[format])
