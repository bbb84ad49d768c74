"""Each finished study fits the performance model to its measured trials; the result is its
cluster's prior for the next study and for `tuner plan` (tuner.store: latest_constants)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from tuner import store
from tuner.fitting import calibrate, fit_memory_scale, rms_log_error
from tuner.outcome import TrialState
from tuner.pricing import Pricing

MIN_CALIBRATION_POINTS = 3


def calibrate_study(session: Session, study: store.Study, pricing: Pricing) -> None:
    """Fit from the constants the study began with (`pricing`'s); nothing with fewer than 3
    measurements."""
    measured = [t for t in store.trials(session, study, (TrialState.COMPLETE,)) if t.step_time_median_s]
    points = [pricing.measurement(store.config_of(t), t.step_time_median_s) for t in measured]
    if len(points) < MIN_CALIBRATION_POINTS:
        return
    fitted = calibrate(points, pricing.constants)
    peaks = [(m, t.peak_memory_bytes) for m, t in zip(points, measured, strict=True) if t.peak_memory_bytes]
    fitted = fit_memory_scale(peaks, fitted)
    store.save_calibration(
        session, pricing.hardware.name, fitted, len(points), rms_log_error(points, fitted), study
    )
