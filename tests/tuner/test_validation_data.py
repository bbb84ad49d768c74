"""bench/validation_data.py: the public GPU measurements in bench/data/, read into our config types."""

from __future__ import annotations

import csv
import filecmp
import math
from pathlib import Path

import pytest

from bench.validation_data import (
    DATA_DIR,
    SHAPE_DEFAULTS,
    Measurement,
    _checkpointing,
    _leading_int,
    _vocab_size,
    load_tables,
    load_validation,
    megatron_padded_vocab,
)
from tuner.spec import ClusterSpec

SHARED_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "validation"
HEADER = (
    "source,table_id,model_name,num_layers,hidden_size,num_heads,ffn_hidden_size,seq_len,vocab_size,"
    "global_batch_size,num_gpus,gpu_type,gpus_per_node,tp,pp,dp,micro_batch_size,grad_accum_steps,"
    "activation_checkpoint,zero_stage,framework,measured_metric_name,measured_value,status,"
    "alt_metric_name,alt_value,peak_memory_gb,notes"
)


@pytest.fixture(scope="module")
def tables() -> dict[str, list[Measurement]]:
    return load_tables()


def raw_rows(table_id: str, data_dir: Path = DATA_DIR) -> list[dict[str, str]]:
    (path,) = data_dir.glob(f"*/{table_id}.csv")
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_tables_and_rows_per_folder(tables: dict[str, list[Measurement]]) -> None:
    num_tables: dict[str, int] = {}
    num_rows: dict[str, int] = {}
    for rows in tables.values():
        num_tables[rows[0].dataset] = num_tables.get(rows[0].dataset, 0) + 1
        num_rows[rows[0].dataset] = num_rows.get(rows[0].dataset, 0) + len(rows)
    assert num_tables == {
        "vtrain_single_node": 144,
        "bigscience": 12,
        "amp": 1,
        "dlperf": 4,
        "korthikanti_tab5": 4,
    }
    assert num_rows == {
        "vtrain_single_node": 1440,
        "bigscience": 66,
        "amp": 52,
        "dlperf": 14,
        "korthikanti_tab5": 8,
    }
    assert load_validation().skipped == []  # every row of the shipped tables is consistent


def test_rows_match_the_csv(tables: dict[str, list[Measurement]]) -> None:
    """Row for row, in file order: the layout multiplies out to the GPU count and the global batch."""
    for table_id, rows in tables.items():
        raw = raw_rows(table_id)
        assert len(rows) == len(raw)
        for m, row in zip(rows, raw):
            num_gpus, gpus_per_node = int(row["num_gpus"]), int(row["gpus_per_node"])
            assert m.source == row["source"] and m.source
            assert m.parallel.world_size == m.parallel.tp * m.parallel.pp * m.parallel.dp == num_gpus
            assert m.parallel.dp == int(row["dp"])
            assert m.parallel.global_batch_size == m.global_batch_size == int(row["global_batch_size"])
            assert m.cluster["num_nodes"] == math.ceil(num_gpus / gpus_per_node)
            sharded = (1, m.parallel.dp) if m.parallel.zero_stage else (m.parallel.dp, 1)
            assert (m.parallel.dp_replicate, m.parallel.dp_shard) == sharded


def test_iteration_times(tables: dict[str, list[Measurement]]) -> None:
    statuses: dict[str, int] = {}
    for rows in tables.values():
        for m in rows:
            statuses[m.status] = statuses.get(m.status, 0) + 1
            if m.status == "ok":
                assert m.iteration_time_s is not None and m.iteration_time_s > 0
            else:
                assert m.iteration_time_s is None
    assert statuses == {"ok": 1571, "oom": 4, "fail": 5}


def test_one_model_cluster_and_batch_per_table(tables: dict[str, list[Measurement]]) -> None:
    """What a per-table rank correlation assumes: only the layout (and recompute) varies in a table."""
    for rows in tables.values():
        assert len({(m.model, m.global_batch_size, m.precision, m.cluster["name"]) for m in rows}) == 1
        assert len({m.cluster["num_nodes"] for m in rows}) == 1


def test_clusters_have_every_key(tables: dict[str, list[Measurement]]) -> None:
    keys = {"name", "device", "gpus_per_node", "num_nodes", "device_memory_gb", "peak_tflops", "intra_node_gbps",
            "inter_node_gbps", "intra_node_latency_us", "inter_node_latency_us"}  # fmt: skip
    for rows in tables.values():
        for m in rows:
            assert set(m.cluster) == keys
            assert all(v > 0 for k, v in m.cluster.items() if k not in ("name", "device"))
            assert ClusterSpec(**m.cluster).device_row is not None  # a row of trainer/contract/devices.py
    first = tables["bigscience_bloomprequel_177B_h12288_L96_384gpu_gbs2048"]
    assert first[0].cluster is not first[1].cluster  # callers may edit one row's copy


def test_bigscience_177b_first_row(tables: dict[str, list[Measurement]]) -> None:
    m = tables["bigscience_bloomprequel_177B_h12288_L96_384gpu_gbs2048"][0]
    p = m.parallel
    assert (p.tp, p.pp, p.dp, p.micro_batch_size, p.num_microbatches) == (8, 6, 8, 2, 128)
    assert (p.zero_stage, p.dp_replicate, p.dp_shard) == (1, 1, 8)  # ZeRO-1: dp goes to dp_shard
    assert (p.activation_checkpoint, p.pp_schedule, p.sequence_parallel) == ("full", "1f1b", False)
    assert m.iteration_time_s == 136.73
    assert (m.model.num_layers, m.model.hidden_size, m.model.num_heads) == (96, 12288, 64)
    assert (m.model.vocab_size, m.model.seq_len, m.model.ffn_size) == (250880, 2048, 49152)
    assert m.cluster["name"] == "jean-zay-a100-80gb" and m.cluster["num_nodes"] == 48
    assert m.cluster["peak_tflops"] == 312.0 and m.cluster["inter_node_gbps"] == 50.0
    assert m.assumptions == ()


def test_bigscience_zero_stage_0_row_replicates(tables: dict[str, list[Measurement]]) -> None:
    (m,) = [
        m
        for m in tables["bigscience_bloomprequel_181B_h14336_L72_384gpu_gbs2048"]
        if m.parallel.zero_stage == 0
    ]
    assert (m.parallel.dp_replicate, m.parallel.dp_shard, m.iteration_time_s) == (4, 1, 137.34)


def test_bigscience_filled_shapes(tables: dict[str, list[Measurement]]) -> None:
    for table_id, defaults in SHAPE_DEFAULTS.items():
        for m in tables[table_id]:
            for name, (value, why) in defaults.items():
                assert getattr(m.model, name) == value and why in m.assumptions
            assert m.model.num_layers % m.parallel.pp == 0  # "chosen so PP divides it"
    m = tables["bigscience_bloomprequel_183B_h14400_384gpu_gbs2048_mbs_sweep"][0]
    assert (m.model.num_layers, m.model.num_heads) == (72, 96)
    assert tables["bigscience_bloomprequel_200B_h14400_320gpu_gbs2048_mbs_sweep"][0].model.num_layers == 80


def test_bigscience_tr3m_oom_rows(tables: dict[str, list[Measurement]]) -> None:
    rows = tables["bigscience_tr3m_1B3_8xV100-16GB_gbs512_ckpt"]
    oom = [m for m in rows if m.status == "oom"]
    assert [m.parallel.micro_batch_size for m in oom] == [8, 8, 8]
    assert rows[0].cluster["name"] == "jean-zay-v100-16gb" and rows[0].cluster["gpus_per_node"] == 4
    assert rows[0].model.vocab_size == 50257  # unpadded: the caller pads
    nockpt = tables["bigscience_tr3m_1B3_8xV100-32GB_gbs512_nockpt"]
    assert {m.parallel.activation_checkpoint for m in nockpt} == {"none"}


def test_vtrain_row(tables: dict[str, list[Measurement]]) -> None:
    m = tables["vtrain_single_h1024_L12_2gpu_gbs16"][0]
    p = m.parallel
    assert (p.tp, p.pp, p.dp_replicate, p.dp_shard, p.micro_batch_size, p.num_microbatches) == (
        2,
        1,
        1,
        1,
        8,
        2,
    )
    assert m.iteration_time_s == pytest.approx(0.159456505)
    assert (m.model.num_layers, m.model.hidden_size, m.model.num_heads, m.model.seq_len) == (
        12,
        1024,
        16,
        1024,
    )
    assert m.model.vocab_size == 50257 and p.activation_checkpoint == "full"
    assert m.cluster["name"] == "vtrain-dgx-a100" and m.cluster["num_nodes"] == 1
    assert m.precision == "fp16"


def test_dlperf_ms_to_seconds(tables: dict[str, list[Measurement]]) -> None:
    m = tables["dlperf_megatron_gpt_h1536_L16_8xV100_gbs16"][0]
    assert (m.parallel.tp, m.parallel.dp, m.parallel.micro_batch_size) == (1, 8, 2)
    assert m.iteration_time_s == pytest.approx(0.48022)
    assert m.model.vocab_size == 51200 and m.cluster["inter_node_gbps"] == 12.5
    # Cross-check the unit against the source's samples/s: 16 / 33.32 = 0.4802 s.
    for table_id, rows in tables.items():
        for m, row in zip(rows, raw_rows(table_id)):
            if row["alt_metric_name"] == "samples_per_s":
                assert m.global_batch_size / float(row["alt_value"]) == pytest.approx(
                    m.iteration_time_s, rel=1e-3
                )


def test_korthikanti_recompute_modes(tables: dict[str, list[Measurement]]) -> None:
    full, selective = tables["korthikanti_tab5_gpt3-175B_64gpu"]
    assert (full.parallel.activation_checkpoint, full.parallel.sequence_parallel) == ("full", False)
    assert (selective.parallel.activation_checkpoint, selective.parallel.sequence_parallel) == (
        "selective",
        True,
    )
    assert (full.parallel.pp_schedule, full.parallel.virtual_stages) == ("interleaved_1f1b", 3)
    assert (full.iteration_time_s, selective.iteration_time_s) == (18.13, 13.75)
    one_t = tables["korthikanti_tab5_megatron-1T_512gpu"][0].parallel
    assert (one_t.pp_schedule, one_t.virtual_stages) == ("1f1b", 1)  # chunks=1: plain 1F1B
    assert tables["korthikanti_tab5_megatron-22B_8gpu"][0].cluster["name"] == "selene-dgx-a100-80gb"


def test_amp_failed_trials(tables: dict[str, list[Measurement]]) -> None:
    (table_id,) = [t for t in tables if t.startswith("amp_")]
    assert table_id == "amp_homogeneous_gpt2-345M_16gpu_gbs32"
    rows = tables[table_id]
    assert sum(m.status == "fail" for m in rows) == 5
    assert rows[0].cluster["name"] == "aws-g4dn.12xlarge-t4" and rows[0].cluster["num_nodes"] == 4
    assert rows[0].parallel.activation_checkpoint == "none" and rows[0].parallel.zero_stage == 0


@pytest.mark.skipif(not SHARED_DIR.is_dir(), reason="the shared validation data is not on this machine")
def test_copies_are_verbatim() -> None:
    copied = sorted(p.relative_to(DATA_DIR) for p in DATA_DIR.glob("*/*.csv"))
    assert copied and all(filecmp.cmp(DATA_DIR / p, SHARED_DIR / p, shallow=False) for p in copied)
    assert not [p for p in copied if "deepspeed_autotuning" in str(p) or "hetcluster" in str(p)]


def test_text_cleaning() -> None:
    assert _vocab_size("250k (BLOOM tokenizer, ~250880)") == 250880
    assert _vocab_size("50257 (GPT-2 BPE, Megatron-padded)") == 50257
    assert _vocab_size("50257 padded (report FLOP formula uses 51200)") == 51200
    assert _vocab_size("51200 (Megatron)") == 51200 and _vocab_size("52256") == 52256
    assert _leading_int("1 (ZERO_STAGE=1 in the referenced slurm script)") == 1
    assert _checkpointing("likely yes (tr11 scripts use --checkpoint-activations)") == ("full", False)
    assert _checkpointing("no (not enabled in AMP launch script)") == ("none", False)
    assert _checkpointing("selective (+ sequence parallelism)") == ("selective", True)
    assert megatron_padded_vocab(50257, tp=1) == 50304 and megatron_padded_vocab(50257, tp=8) == 51200
    with pytest.raises(ValueError):
        _vocab_size("about fifty thousand")


def test_inconsistent_rows_are_skipped_with_a_reason(tmp_path: Path) -> None:
    (row,) = raw_rows("dlperf_megatron_gpt_h1536_L16_8xV100_gbs16")[:1]
    variants = {
        "good": {},
        "derived_accum": {"grad_accum_steps": ""},  # 16 / (8 * 2) = 1
        "bad_gpus": {"dp": "4"},  # 1 * 1 * 4 != 8
        "bad_batch": {"grad_accum_steps": "2"},  # 2 * 2 * 8 != 16
        "no_layers": {"num_layers": ""},
        "no_time": {"measured_value": ""},
    }
    folder = tmp_path / "dlperf"
    folder.mkdir()
    path = folder / "t.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=HEADER.split(","))
        writer.writeheader()
        for changes in variants.values():
            writer.writerow({**row, "table_id": "t", **changes})
    data = load_validation(tmp_path)
    assert [m.parallel.num_microbatches for m in data.tables["t"]] == [1, 1]
    assert data.tables["t"][1].assumptions == ("grad_accum_steps=1: global_batch / (dp * micro_batch)",)
    reasons = {s.line: s.reason for s in data.skipped}
    assert set(reasons) == {4, 5, 6, 7} and all(s.path == "dlperf/t.csv" for s in data.skipped)
    assert "!= num_gpus(8)" in reasons[4] and "!= global_batch(16)" in reasons[5]
    assert "num_layers is not stated" in reasons[6] and "no iteration_time_ms value" in reasons[7]


def test_a_cp_row_counts_cp_in_the_ranks_not_in_the_batch(tmp_path: Path) -> None:
    """Our context-parallel tables (bench/measure_table.py --space cp): num_gpus = tp x pp x dp x cp,
    global batch = micro-batch x grad_accum x dp; a row whose cp does not make up its ranks is
    skipped with the cp in the reason, and one without the column reads as cp 1."""
    rows = raw_rows("own_llama-tiny_8rank_cp_gbs8", DATA_DIR.parent)  # bench/own_tables/
    row = next(r for r in rows if r["cp"] == "2")
    folder = tmp_path / "own"
    folder.mkdir()
    with (folder / "t.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        for changes in ({}, {"cp": "4"}, {"cp": ""}):
            writer.writerow({**row, "table_id": "t", **changes})
    data = load_validation(tmp_path)
    (m,) = data.tables["t"]
    assert (m.parallel.cp, m.parallel.dp, m.parallel.world_size, m.global_batch_size) == (2, 4, 8, 8)
    assert m.parallel.num_microbatches == 2 and m.model.seq_len == 2048 and m.model.num_kv_heads == 2
    reasons = [s.reason for s in data.skipped]
    assert reasons == [
        "tp(1) * pp(1) * dp(4) * cp(4) = 16 != num_gpus(8)",
        "tp(1) * pp(1) * dp(4) = 4 != num_gpus(8)",
    ]
