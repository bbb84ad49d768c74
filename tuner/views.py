"""What users see of studies, trials and best layouts: one set of types (pydantic, the API's
response schemas and the CLI's --json) built in one place from stored rows. The API's routers and
the CLI's database backend call these builders; the CLI's HTTP backend parses the API's JSON into
the same types (tuner/backend.py)."""

from __future__ import annotations

import datetime as dt
import statistics
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, PlainSerializer, WithJsonSchema, create_model
from sqlalchemy.orm import Session

from trainer.contract.axes import AXES
from tuner import store
from tuner.cache import RevisionCache
from tuner.db import Study, Trial, aware, utcnow
from tuner.models import WithFamily
from tuner.outcome import FailureKind, StudyStatus, TrialState, words
from tuner.payoff import Payoff, payoff
from tuner.predict import CalibrationOut
from tuner.pricing import Pricing
from tuner.spec import StudySpec


def _in_words(cls: type[StudyStatus] | type[TrialState]) -> Any:
    """A state as the API shows it: its word (tuner/outcome.py: the one vocabulary). In Python the
    field holds the enum member; any accepted word (older words too, any case) parses into it."""
    return Annotated[cls, BeforeValidator(cls.parse), PlainSerializer(lambda m: m.word, return_type=str),
                     WithJsonSchema({"type": "string", "enum": list(words(cls).values())})]  # fmt: skip


StudyWord = _in_words(StudyStatus)
TrialWord = _in_words(TrialState)


class StudyCreated(BaseModel):
    id: int
    name: str
    status: StudyWord
    url: str


class Progress(BaseModel):
    finished: int
    budget: int
    by_state: dict[TrialWord, int]


class LeaseOut(BaseModel):
    owner: str
    host: str | None
    pid: int | None
    renewed_s_ago: float | None
    expires_in_s: float | None  # negative: expired (another worker may take the study)


class _TrialFields(BaseModel):
    number: int
    state: TrialWord
    layout: str
    config: dict[str, Any]
    dp: int  # dp_replicate x dp_shard
    world_size: int  # the devices the trial holds (ParallelConfig.world_size)
    tokens_per_s: float | None
    tflops_per_device: float | None
    mfu: float | None
    peak_memory_bytes: int | None
    step_time_median_s: float | None
    predicted_tokens_per_s: float | None
    predicted_memory_bytes: float | None
    # The stored prediction's step, term by term (they add up to it); None for trials stored
    # before the estimate had terms.
    predicted_step_time_s: float | None = None
    predicted_terms: dict[str, float] | None = None
    failure_kind: FailureKind | None  # failed, or pruned before it ran (predicted_oom)
    failure_message: str | None
    stop_reason: str | None = None  # pruned while running: why it stopped early (not a failure)
    job_id: str | None
    job_state: str | None
    attempts: int
    attempt_log: list[dict[str, Any]] | None = None  # every ended attempt: job, state, kind, times
    device_s: float = 0.0
    told: str | None = None  # what the sampler heard: score, infeasible, nothing
    log_path: str | None = None
    started_at: dt.datetime | None
    finished_at: dt.datetime | None


# A trial as the API shows it: its fields above plus one per parallel axis (trainer/contract/axes.py).
TrialOut = create_model(
    "TrialOut", __base__=_TrialFields, __module__=__name__, **{a.name: (a.type, ...) for a in AXES}
)


class StudySummary(WithFamily):
    id: int
    name: str
    status: StudyWord
    payoff: Payoff | None = None  # what tuning cost and what it bought (tuner/payoff.py)
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


class StudyDetail(StudySummary):
    spec: dict[str, Any]
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    best: TrialOut | None
    error: str | None = None  # = reason, kept for older clients


class StudyPage(BaseModel):
    items: list[StudySummary]
    total: int
    limit: int
    offset: int


class TrialPage(BaseModel):
    items: list[TrialOut]
    last_number: int  # pass as ?after= to get only newer trials


class BestOut(WithFamily):
    kind: Literal["measured"] = "measured"  # predicted rows: tuner/predict.py PredictedBest
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
    payoff: Payoff | None = None  # of the study the row comes from


# --- builders ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeaseTimes:
    """A lease as stored: its holder and times. Its age (LeaseOut) moves with the clock."""

    owner: str
    host: str | None
    pid: int | None
    renewed_at: dt.datetime | None
    expires_at: dt.datetime

    @classmethod
    def of(cls, study: Study) -> LeaseTimes | None:
        if study.lease_owner is None or study.lease_expires_at is None:
            return None
        return cls(study.lease_owner, study.lease_host, study.lease_pid, aware(study.lease_renewed_at),
                   aware(study.lease_expires_at))  # fmt: skip

    def at(self, now: dt.datetime) -> LeaseOut:
        return LeaseOut(owner=self.owner, host=self.host, pid=self.pid,
                        renewed_s_ago=(now - self.renewed_at).total_seconds() if self.renewed_at else None,
                        expires_in_s=(self.expires_at - now).total_seconds())  # fmt: skip


def lease(study: Study, now: dt.datetime | None = None) -> LeaseOut | None:
    times = LeaseTimes.of(study)
    return times.at(now or utcnow()) if times else None


def trial(t: Trial) -> TrialOut:
    return TrialOut(
        number=t.number, state=t.state, layout=store.config_of(t).describe(), config=t.config,
        **{a.name: getattr(t, a.name) for a in AXES}, dp=t.dp, world_size=t.world_size,
        tokens_per_s=t.tokens_per_s, tflops_per_device=t.tflops_per_device, mfu=t.mfu,
        peak_memory_bytes=t.peak_memory_bytes, step_time_median_s=t.step_time_median_s,
        predicted_tokens_per_s=t.predicted_tokens_per_s, predicted_memory_bytes=t.predicted_memory_bytes,
        predicted_step_time_s=(t.predicted or {}).get("step_time_s"), predicted_terms=(t.predicted or {}).get("terms"),
        failure_kind=t.failure_kind, failure_message=t.failure_message, stop_reason=t.stop_reason,
        job_id=t.job_id, job_state=t.job_state,
        attempts=t.attempts, attempt_log=t.attempt_log, device_s=t.device_s or 0.0, told=t.told,
        log_path=t.log_path, started_at=t.started_at, finished_at=t.finished_at,
    )  # fmt: skip


@dataclass(frozen=True)
class _Facts:
    """What a study's summary needs beyond its own row: trial counts per state, its best trial,
    its payoff. They change only with a write, so they are kept per study and store revision."""

    counts: dict[TrialState, int]
    best: TrialOut | None
    payoff: Payoff


# Counting a 50k-trial study's states and reading its completed trials for the payoff (the median,
# the first guess) takes ~10 ms and ~100 ms: read again only after a write (tuner/cache.py).
_FACTS: RevisionCache[_Facts] = RevisionCache(max_entries=4096)


def _facts(session: Session, studies: list[Study]) -> dict[int, _Facts]:
    """Each study's facts at the store's current revision, read in a constant number of queries
    for the studies whose facts were not kept."""
    if not studies:
        return {}
    by_id = {s.id: s for s in studies}

    def build(ids: list[int]) -> dict[int, _Facts]:
        counts, bests = store.trial_counts(session, ids), store.best_trials(session, ids)
        spent, measured = store.payoff_inputs(session, ids)
        return {i: _Facts(counts[i], trial(bests[i]) if i in bests else None,
                          payoff(spent[i], measured[i], by_id[i].spec.get("training", {}).get("total_tokens")))
                for i in ids}  # fmt: skip

    return _FACTS.get_many(list(by_id), store.revision(session), build)


def payoffs(session: Session, studies: list[Study]) -> dict[int, Payoff]:
    """Each study's payoff (tuner/payoff.py)."""
    return {i: f.payoff for i, f in _facts(session, studies).items()}


def summaries(session: Session, studies: list[Study]) -> list[StudySummary]:
    """Summaries of a page of studies: their rows as read now (status, lease), their facts as of
    the store's revision."""
    facts = _facts(session, studies)
    return [_summary(s, facts[s.id]) for s in studies]


def _summary(study: Study, facts: _Facts) -> StudySummary:
    finished = sum(n for state, n in facts.counts.items() if state.is_finished())
    best = facts.best
    return StudySummary(
        id=study.id, name=study.name, status=study.status, reason=study.error, lease=lease(study),
        owner=study.lease_owner, model=study.model_key, cluster=study.cluster_key, gpus=study.num_gpus,
        sampler=study.sampler, created_at=study.created_at, payoff=facts.payoff,
        progress=Progress(finished=finished, budget=study.spec.get("budget", {}).get("max_trials", 0),
                          by_state=facts.counts),
        best_tokens_per_s=best.tokens_per_s if best else None, best_mfu=best.mfu if best else None,
    )  # fmt: skip


def detail_and_lease(session: Session, study: Study) -> tuple[StudyDetail, LeaseTimes | None]:
    """The study's detail and its lease's times: kept together (api/reads.py), the detail is
    brought to the present by `aged`."""
    return detail(session, study), LeaseTimes.of(study)


def aged(kept: tuple[StudyDetail, LeaseTimes | None], now: dt.datetime | None = None) -> StudyDetail:
    """A kept detail with its lease's age as of now."""
    out, times = kept
    return out.model_copy(update={"lease": times.at(now or utcnow()) if times else None})


def detail(session: Session, study: Study) -> StudyDetail:
    facts = _facts(session, [study])[study.id]
    return StudyDetail(**dict(_summary(study, facts)), spec=study.spec, error=study.error, started_at=study.started_at,
                       finished_at=study.finished_at, best=facts.best)  # fmt: skip


def best_rows(session: Session, *, model: str | None = None, cluster: str | None = None,
              num_gpus: int | None = None) -> list[BestOut]:  # fmt: skip
    rows = store.best_rows(session, model=model, cluster=cluster, num_gpus=num_gpus)
    paid = payoffs(session, store.studies_by_id(session, (r["study_id"] for r in rows)))
    return [BestOut(**row, payoff=paid.get(row["study_id"])) for row in rows]


def best_or_predicted(session: Session, *, model: str | None = None, cluster: str | None = None,
                      num_gpus: int | None = None, global_batch: int | None = None) -> list[BestOut | Any]:  # fmt: skip
    """The measured best rows; for a model size with none, the planner's predictions on the
    clusters that have calibrations (tuner/predict.py), marked `kind: predicted`."""
    from tuner.predict import predicted_best

    rows = best_rows(session, model=model, cluster=cluster, num_gpus=num_gpus)
    if rows or not model:
        return rows
    try:
        return predicted_best(session, model, cluster=cluster, gpus=num_gpus, global_batch=global_batch)
    except ValueError:  # not a preset: nothing to predict for a shape key nobody measured
        return []


def best_row_type():
    """BestOut | PredictedBest, told apart by `kind` (the API's response model)."""
    from tuner.predict import PredictedBest

    return Annotated[BestOut | PredictedBest, Field(discriminator="kind")]


# --- the model learning: predictions at proposal time against the study's calibrated model ---------


class CalibratedTrial(BaseModel):
    number: int
    layout: str
    tokens_per_s: float  # measured
    proposed_tokens_per_s: float | None  # predicted when proposed, with the constants in use then
    calibrated_tokens_per_s: float  # predicted now, with the study's calibration
    calibrated_memory_bytes: float


class StudyCalibration(BaseModel):
    """A study's completed trials as the model predicted them when it proposed them and as the
    study's own calibration predicts them now. The calibration is fitted to these same trials, so
    its error here is in-sample: it shows what the model learnt, not how well it predicts."""

    calibration: CalibrationOut | None  # None until the study ends with 3 measured trials
    trials: list[CalibratedTrial]
    median_error_proposed: float | None  # median of |predicted / measured - 1| over `trials`
    median_error_calibrated: float | None


def _median_error(pairs: list[tuple[float | None, float]]) -> float | None:
    errors = [abs(p / m - 1) for p, m in pairs if p]
    return statistics.median(errors) if errors else None


def study_calibration(session: Session, study: Study) -> StudyCalibration:
    """Every completed trial priced by the study's latest calibration (tuner/calibration.py fits
    one when the study ends), beside the prediction stored when it was proposed."""
    row = store.latest_calibration(session, study_id=study.id)
    if row is None:
        return StudyCalibration(
            calibration=None, trials=[], median_error_proposed=None, median_error_calibrated=None
        )
    pricing = Pricing.for_study(StudySpec.model_validate(study.spec), store.constants_of(row))
    out = []
    for t in store.trials(session, study, (TrialState.COMPLETE,)):
        if not t.tokens_per_s:
            continue
        config = store.config_of(t)
        est = pricing.estimate(config)
        out.append(CalibratedTrial(number=t.number, layout=config.describe(), tokens_per_s=t.tokens_per_s,
                                   proposed_tokens_per_s=t.predicted_tokens_per_s,
                                   calibrated_tokens_per_s=est.tokens_per_s, calibrated_memory_bytes=est.memory_bytes))  # fmt: skip
    return StudyCalibration(
        calibration=CalibrationOut(cluster=row.cluster_key, study_id=row.study_id, num_points=row.num_points,
                                   rms_log_error=row.rms_log_error, created_at=aware(row.created_at).isoformat()),
        trials=out,
        median_error_proposed=_median_error([(t.proposed_tokens_per_s, t.tokens_per_s) for t in out]),
        median_error_calibrated=_median_error([(t.calibrated_tokens_per_s, t.tokens_per_s) for t in out]),
    )  # fmt: skip
