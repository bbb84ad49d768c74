"""The axis table (trainer/contract/axes.py) and what is derived from it: the layout's fields, the
store's columns and device count, the space, the samplers' knobs, the plan, the CSV and the API.
The store once counted a trial's devices as tp x tp_col x pp x dp and left cp out."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
from sqlalchemy import func, select

from tests.records import record_trial
from trainer.contract.axes import AXES, AXIS, MESH_AXES, SAMPLER_AXES, WORLD_AXES, axes_payload
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from tuner import store
from tuner.cli.plan import layout_columns
from tuner.db import Trial, connect
from tuner.frames import CSV_COLUMNS
from tuner.outcome import Feedback, Outcome, TrialState
from tuner.plan import PIN_KEYS, SPACE_PINS, layout_row
from tuner.samplers.external import KNOBS, SCHEDULE, _knob_names
from tuner.space import SearchSpace
from tuner.spec import SpaceSpec, parse_spec
from tuner.views import TrialOut

NAMES = [a.name for a in AXES]
NOW = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.UTC)


def _every_axis_layouts() -> list[ParallelConfig]:
    """Layouts of two small spaces that between them vary every axis: a dense Llama with 2D tensor
    and context parallelism, a mixture of experts with expert and context parallelism."""
    rich = dict(tp=[1, 2], pp=[1, 2], micro_batch_size=[1, 2], zero_stage=[0, 3], activation_checkpoint=["none", "full"],
                sequence_parallel=[False, True], pp_schedule=["1f1b", "interleaved_1f1b"], virtual_stages=[2], cp=[1, 2])  # fmt: skip
    dense = SearchSpace(
        MODEL_PRESETS["llama-tiny"], 8, 8, 16, SpaceSpec(tp_col=[1, 2], num_gpus=[4, 8], **rich)
    )
    moe = SearchSpace(MODEL_PRESETS["moe-tiny"], 8, 8, 16, SpaceSpec(ep=[1, 2, 4], **rich))
    return list(dict.fromkeys(dense.enumerate().valid + moe.enumerate().valid))  # the two share layouts


def test_every_derived_list_has_every_axis() -> None:
    assert [f.name for f in dataclasses.fields(ParallelConfig)] == NAMES
    assert [f.default for f in dataclasses.fields(ParallelConfig)] == [a.default for a in AXES]
    assert set(MESH_AXES) == set(WORLD_AXES) and len({AXIS[n].mesh_order for n in MESH_AXES}) == len(
        MESH_AXES
    )
    assert [n for n in SpaceSpec.model_fields if n in AXIS] == [a.name for a in AXES if a.searched]
    assert {c.name for c in Trial.__table__.columns} >= {*NAMES, "dp", "world_size"}
    assert [c for c in CSV_COLUMNS if c in AXIS] == NAMES
    assert set(TrialOut.model_fields) >= set(NAMES) and {a["name"] for a in axes_payload()} == set(NAMES)
    assert set(PIN_KEYS) == {*NAMES, "dp"} and {a.name for a in AXES if a.searched} == SPACE_PINS
    # Every sampler axis is a knob once a candidate uses it; the schedule is one knob of two axes.
    every = ParallelConfig(tp_col=2, ep=2, cp=2)
    assert _knob_names([every]) == (*SAMPLER_AXES, SCHEDULE)
    assert set(KNOBS) <= {*SAMPLER_AXES, SCHEDULE}
    row = layout_row(every)
    assert set(row) == {*NAMES, "dp"} - {"dp_replicate", "dp_shard"}


def test_the_plan_tables_columns_follow_the_table() -> None:
    """`tuner plan`'s layout columns: every axis of the rows (dp whole; tp_col, virtual_stages and
    the ZeRO stage shown in tp's, the schedule's and dp's cells), the world's first, then ep, then the rest, each in the
    table's order, under the axis's heading."""
    columns = layout_columns([layout_row(ParallelConfig(tp_col=2, ep=2, cp=2))])
    assert columns == ["tp", "pp", "dp", "cp", "ep", "micro_batch_size", "num_microbatches",
                       "activation_checkpoint", "sequence_parallel", "pp_schedule"]  # fmt: skip
    assert {*columns, "tp_col", "virtual_stages", "dp_replicate", "dp_shard", "zero_stage"} - {"dp"} == set(
        NAMES
    )
    assert [AXIS[n].heading for n in columns if n != "dp"] == [
        "tp", "pp", "cp", "ep", "mbs", "nmb", "ckpt", "sp", "schedule"
    ]  # fmt: skip
    assert "cp" not in layout_columns([layout_row(ParallelConfig())])  # searched or used: a column
    assert {a["name"]: a["heading"] for a in axes_payload()} == {a.name: a.heading for a in AXES}


@pytest.mark.parametrize("knobs", [
    dict(dp_shard=64, zero_stage=3), dict(dp_replicate=8), dict(dp_replicate=2, dp_shard=32, zero_stage=3),
    dict(dp_shard=4, zero_stage=2, cp=4), dict(tp=8),
])  # fmt: skip
def test_the_plan_writes_data_parallelism_as_the_layouts_label(knobs: dict) -> None:
    """The plan's dp cell is the label's dp tokens (ParallelConfig.describe, the exports' headers):
    "dps64(z3)", not a dp column beside a zero column."""
    from tuner.cli.plan import _cell

    p = ParallelConfig(**knobs)
    label = [t for t in p.describe().split() if t.startswith("dp")]
    assert _cell("dp", layout_row(p, searched=("dp_replicate",))) == (" ".join(label) or "1")


def test_world_size_is_the_product_of_the_world_axes() -> None:
    for name in WORLD_AXES:
        assert ParallelConfig(**{name: 3}).world_size == 3, name
    assert ParallelConfig(ep=4).world_size == 1  # ep folds into dp x cp x tp
    assert ParallelConfig(tp=2, dp_shard=2, cp=2, zero_stage=2).world_size == 8


def test_the_space_varies_every_axis() -> None:
    """The layouts the store test below writes cover every axis at more than one value (else that
    test could not catch an axis the store leaves out)."""
    layouts = _every_axis_layouts()
    assert all(len({getattr(c, n) for c in layouts}) > 1 for n in NAMES), [
        n for n in NAMES if len({getattr(c, n) for c in layouts}) == 1
    ]


def test_the_stores_device_count_is_the_layouts_for_every_axis(database_url: str) -> None:
    layouts = _every_axis_layouts()
    spec = parse_spec({"name": "axes", "model": "llama-tiny", "cluster": "h100-80gb", "num_gpus": 8,
                       "training": {"global_batch_size": 16, "precision": "fp32"}})  # fmt: skip
    sessions = connect(database_url)
    with sessions.begin() as s:
        study = store.create_study(s, spec)
        for c in layouts:
            store.add_trial(s, study, c, None, TrialState.WAITING)
    with sessions() as s:
        stored = {t.layout_key: t for t in store.trials(s, store.get_study(s, "axes"))}
        assert len(stored) == len(layouts)
        for c in layouts:
            t = stored[store.layout_key(c)]
            assert (store.world_size(t), t.dp) == (c.world_size, c.dp), c.describe()
            assert {n: getattr(t, n) for n in NAMES} == {n: getattr(c, n) for n in NAMES}, c.describe()
            assert store.config_of(t) == c
        # ... and SQL's count, which bests and budgets group by
        by_world = dict(s.execute(select(store.TRIAL_WORLD, func.count()).group_by(store.TRIAL_WORLD)).all())
        expected: dict[int, int] = {}
        for c in layouts:
            expected[c.world_size] = expected.get(c.world_size, 0) + 1
        assert by_world == expected


def _ok(tokens_per_s: float) -> Outcome:
    return Outcome(ok=True, tokens_per_s=tokens_per_s, tflops_per_device=0.01, mfu=0.1, peak_memory_bytes=10,
                   step_time_s=0.5, result={"step_times_s": [0.5]})  # fmt: skip


def test_a_cp_trial_counts_cp_in_the_device_hours_and_in_its_bests(database_url: str) -> None:
    """A trial of cp 2 x dp 2 holds 4 devices: 100 s of it spend 400 device-seconds of the
    study's budget, and its result is the best at 4 devices (the store said 2: 200 s, and filed
    it beside the dp 2 layouts)."""
    spec = parse_spec({"name": "cp", "model": "llama-tiny", "cluster": "h100-80gb", "num_gpus": 4,
                       "training": {"global_batch_size": 8, "precision": "fp32"}, "space": {"cp": [1, 2]},
                       "budget": {"max_device_hours": 1.0}})  # fmt: skip
    cp2 = ParallelConfig(dp_shard=2, cp=2, zero_stage=2, micro_batch_size=4)
    sessions = connect(database_url)
    with sessions.begin() as s:
        study = store.create_study(s, spec)
        trial = store.add_trial(s, study, cp2, None, TrialState.WAITING)
        assert store.begin_attempt(s, trial, now=NOW) and store.attach_job(s, trial, "local:1@/tmp/t", None)
        running = store.usage(s, study, now=NOW + dt.timedelta(seconds=50))
        assert running.device_s == pytest.approx(200.0)  # 50 s on 4 devices, still running
        later = NOW + dt.timedelta(seconds=100)
        assert store.end_attempt(s, trial, _ok(1000.0), requeue=False, told=Feedback.SCORE, now=later)
    with sessions() as s:
        study = store.get_study(s, "cp")
        (trial,) = store.trials(s, study)
        assert trial.device_s == pytest.approx(400.0)
        assert store.usage(s, study, now=NOW + dt.timedelta(hours=1)).device_s == pytest.approx(400.0)
        assert store.best_at(s, study.id, 4) == 1000.0 and store.best_at(s, study.id, 2) is None
        spent, measured = store.payoff_inputs(s, [study.id])
        assert spent[study.id] == pytest.approx(400.0) and measured[study.id][0].world_size == 4
    with sessions.begin() as s:
        store.rebuild_bests(s)  # the bulk rebuild files it at 4 devices too
    with sessions() as s:
        assert store.best_at(s, store.get_study(s, "cp").id, 4) == 1000.0


def test_a_recorded_cp_trial_reads_back_with_its_axes(database_url: str) -> None:
    sessions = connect(database_url)
    spec = parse_spec({"name": "r", "model": "llama-tiny", "cluster": "h100-80gb", "num_gpus": 8,
                       "training": {"global_batch_size": 8, "precision": "fp32"}})  # fmt: skip
    c = ParallelConfig(tp=2, dp_shard=2, cp=2, zero_stage=3, micro_batch_size=4)
    with sessions.begin() as s:
        record_trial(s, store.create_study(s, spec), c, _ok(10.0))
    with sessions() as s:
        (t,) = store.trials(s, store.get_study(s, "r"))
        assert (t.cp, t.dp_shard, t.world_size, t.ep) == (2, 2, 8, 1)
