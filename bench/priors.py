"""Priors for the performance model in the benchmarks: what a cluster's database would hold.

A study on a cluster starts from the constants its earlier studies fitted (tuner.store.
latest_constants). The benchmarks replay one table at a time; `cold` starts from the defaults
(nothing known about the cluster), `warm` from constants fitted to every OTHER table measured on
the same cluster (same `gpu_type`), never to the table being judged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bench.validation_data import Measurement, load_csv, megatron_padded_vocab
from tuner import perfmodel
from tuner.spec import ClusterSpec

PRIORS = ("cold", "warm")


def inputs(row: Measurement) -> perfmodel.Measurement:
    """A table row as calibrate() input (Megatron pads the vocabulary to 128 * tp)."""
    model = dataclasses.replace(
        row.model, vocab_size=megatron_padded_vocab(row.model.vocab_size, row.parallel.tp)
    )
    return perfmodel.Measurement(
        model, row.parallel, ClusterSpec(**row.cluster), row.iteration_time_s or 0.0, row.precision
    )


def prior(kind: str, path: Path, tables: list[Path]) -> perfmodel.ModelConstants:
    """The constants a study of the table at `path` would start from."""
    if kind == "cold":
        return perfmodel.ModelConstants()
    if kind != "warm":
        raise ValueError(f"unknown prior {kind!r}; valid: {list(PRIORS)}")
    cluster = load_csv(path)[0].cluster
    others = [
        inputs(r)
        for p in tables
        if p.resolve() != path.resolve()
        for r in load_csv(p)
        if r.status == "ok" and r.iteration_time_s and r.cluster == cluster
    ]
    return perfmodel.calibrate(others) if others else perfmodel.ModelConstants()
