"""Best layouts for model sizes not measured yet: the planner's prediction with a cluster's
calibrated constants, clearly marked as predicted, with the calibration it used and a one-line
command that confirms it with a short study.

The study it would be is the cluster's latest study with the model replaced (its devices, global
batch, precision and space; `gpus`/`global_batch` override them): the planner ranks that study's
valid layouts with the cluster's latest calibration (tuner.store.latest_constants) and takes the
fastest one predicted to fit. A cluster without a calibration predicts nothing: its constants
would be guesses, not fits."""

from __future__ import annotations

import shlex
from typing import Any, Literal

from pydantic import BaseModel
from sqlalchemy.orm import Session

from trainer.contract.presets import MODEL_PRESETS
from tuner import store
from tuner.models import WithFamily
from tuner.pricing import Pricing
from tuner.space import SearchSpace
from tuner.spec import SpecError, StudySpec, parse_spec

CONFIRM_TRIALS = 3  # a confirming study runs the top predicted layouts (grid sampler, model order)


class CalibrationOut(BaseModel):
    cluster: str
    study_id: int | None  # the study it was fitted to
    num_points: int
    rms_log_error: float  # of the fit on its own points
    created_at: str


class PredictedBest(WithFamily):
    kind: Literal["predicted"] = "predicted"
    model: str
    num_params: int
    cluster: str
    gpus: int
    global_batch_size: int
    layout: str
    config: dict[str, Any]
    vocab_size: int  # padded as Megatron pads it for this layout's tp
    predicted_tokens_per_s: float
    predicted_mfu: float
    predicted_memory_bytes: int
    predicted_step_time_s: float
    predicted_terms: dict[str, float]  # every second of the step by term (tuner.cost.terms.StepTerms)
    calibration: CalibrationOut
    template_study: str  # the measured study whose settings the prediction reuses
    confirm: str  # one line that runs a short study of the top predicted layouts
    study_spec: dict[str, Any]  # that short study (`tuner best ... --write-study FILE` writes it)


def confirm_spec(template: StudySpec, model: str, gpus: int | None, global_batch: int | None) -> StudySpec:
    """The study a prediction is for: the template with the model (and devices, batch) replaced."""
    data = template.model_dump(mode="json", exclude={"name", "model"})
    data["model"] = model
    data["name"] = f"confirm-{model}-on-{template.cluster.name}"
    if gpus:
        data["num_gpus"] = gpus
        data["space"] = {**data["space"], "num_gpus": None}
        per = template.cluster.gpus_per_node
        data["cluster"] = {**data["cluster"], "num_nodes": max(data["cluster"]["num_nodes"], -(-gpus // per))}
    if global_batch:
        data["training"] = {**data["training"], "global_batch_size": global_batch}
    data["sampler"], data["budget"] = "grid", {**data["budget"], "max_trials": CONFIRM_TRIALS, "max_wall_time_s": None,
                                               "max_device_hours": None, "early_stop_trials": None}  # fmt: skip
    heads = MODEL_PRESETS[model].num_heads  # the template's tp values this model's heads allow
    data["space"] = {**data["space"], "tp": [t for t in data["space"]["tp"] if heads % t == 0] or [1]}
    return parse_spec(data, "confirm study")


def predicted_best(session: Session, model: str, *, cluster: str | None = None, gpus: int | None = None,
                   global_batch: int | None = None) -> list[PredictedBest]:  # fmt: skip
    """The predicted best layout of `model` (a preset) on each calibrated cluster (or `cluster`)."""
    if model not in MODEL_PRESETS:
        raise ValueError(f"predictions need a model preset; {model!r} is not one of {sorted(MODEL_PRESETS)}")
    clusters = [c for c in store.calibrated_clusters(session) if cluster is None or c == cluster]
    out = []
    for name in clusters:
        template = store.latest_study_on(session, name)
        if template is None:  # an imported calibration with no study of this cluster: no settings to reuse
            continue
        try:
            spec = confirm_spec(StudySpec.model_validate(template.spec), model, gpus, global_batch)
        except SpecError:  # the template's space cannot hold this model (e.g. tp values the heads refuse)
            continue
        row = store.latest_calibration(session, cluster_key=name)
        pricing = Pricing.for_study(spec, store.constants_of(row))
        best = pricing.fastest_fitting(SearchSpace.from_spec(spec).enumerate().valid)
        if best is None:
            continue
        config, est = best
        gpt = pricing.model
        out.append(PredictedBest(
            model=model, num_params=gpt.num_params, cluster=name, gpus=spec.devices,
            global_batch_size=spec.training.global_batch_size, layout=config.describe(), config=config.to_dict(),
            vocab_size=est.vocab_size, predicted_tokens_per_s=est.tokens_per_s, predicted_mfu=est.mfu,
            predicted_memory_bytes=int(est.memory_bytes), predicted_step_time_s=est.step_time_s,
            predicted_terms=est.terms.as_dict(),
            calibration=CalibrationOut(cluster=name, study_id=row.study_id, num_points=row.num_points,
                                       rms_log_error=row.rms_log_error, created_at=row.created_at.isoformat()),
            template_study=template.name, confirm=confirm_command(model, name, gpus, global_batch),
            study_spec=spec.model_dump(mode="json"),
        ))  # fmt: skip
    return out


def confirm_command(model: str, cluster: str, gpus: int | None, global_batch: int | None) -> str:
    flags = [f"--model {shlex.quote(model)}", f"--cluster {shlex.quote(cluster)}"]
    flags += [f"--gpus {gpus}"] if gpus else []
    flags += [f"--global-batch {global_batch}"] if global_batch else []
    path = f"confirm-{model}.yaml"
    return f"tuner best {' '.join(flags)} --write-study {path} && tuner run {path}"
