"""The service itself: a health check and Prometheus metrics (aggregates computed in SQL at each
scrape, never rows)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from api.deps import SessionDep
from tuner import __version__, store
from tuner.outcome import StudyStatus, TrialState

router = APIRouter(tags=["service"])
DURATION_BUCKETS_S = (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


@router.get("/healthz")
def healthz(session: SessionDep) -> dict[str, str]:
    store.ping(session)
    return {"status": "ok", "version": __version__}


class StoreCollector:
    """Studies by status, trials by state, trial durations: three aggregate queries per scrape."""

    def __init__(self, sessions):
        self.sessions = sessions

    def collect(self):
        with self.sessions() as s:
            studies, trials = store.state_counts(s)
            buckets, total_s, count = store.duration_histogram(s, DURATION_BUCKETS_S)
        g = GaugeMetricFamily("tuner_studies", "Studies by state.", labels=["state"])
        for status in StudyStatus:
            g.add_metric([status.word], studies.get(status, 0))
        yield g
        g = GaugeMetricFamily("tuner_trials", "Trials by state.", labels=["state"])
        for state in TrialState:
            g.add_metric([state.word], trials.get(state, 0))
        yield g
        yield HistogramMetricFamily(
            "tuner_trial_duration_seconds", "Wall time of finished trials.",
            buckets=[(str(le), n) for le, n in zip(DURATION_BUCKETS_S, buckets, strict=True)] + [("+Inf", count)],
            sum_value=total_s,
        )  # fmt: skip


def registry(sessions) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(sessions))
    return reg


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(request: Request) -> Response:
    """Prometheus text format."""
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)
