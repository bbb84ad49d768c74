"""Trials as one flat table (pandas): the API's CSV export and `tuner trials --csv`."""

from __future__ import annotations

from typing import Any

from trainer.contract.axes import AXES
from tuner import store

# The layout's columns are the axis table's (trainer/contract/axes.py), then dp and the device count.
CSV_COLUMNS = ["number", "state", "layout", *(a.name for a in AXES), "dp", "world_size", "tokens_per_s",
               "tflops_per_device", "mfu", "peak_memory_bytes", "step_time_median_s", "step_time_min_s",
               "step_time_max_s", "predicted_tokens_per_s", "predicted_memory_bytes", "failure_kind",
               "failure_message", "stop_reason", "job_id", "job_state", "attempts", "device_s", "told", "started_at",
               "finished_at"]  # fmt: skip


def trials_frame(trials) -> Any:
    """Every trial as one flat pandas DataFrame."""
    import pandas as pd

    rows = []
    for t in trials:
        row = {c: getattr(t, c, None) for c in CSV_COLUMNS}
        row |= {"layout": store.config_of(t).describe(), "state": t.state.word}  # the API's words
        rows.append(row)
    return pd.DataFrame(rows, columns=CSV_COLUMNS)
