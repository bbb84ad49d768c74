"""Public measurements of real GPU training runs (bench/data/), read into our config types.

The performance model is judged on these: per table, the Spearman rank correlation between its
predicted and the measured iteration time. One CSV is one table (one model, GPU count, global batch,
cluster and framework; one row per layout); bench/data/README.md says where each comes from.

    tables = load_tables()              # table_id -> [Measurement], rows in file order
    data = load_validation()            # the same, plus .skipped: rows left out and why

Rows are skipped, never silently: a row that breaks tp*pp*dp == num_gpus or
global_batch == micro_batch * grad_accum * dp, or whose shape cannot be told, lands in
`ValidationData.skipped` with the reason (`load_tables` drops that list; use `load_validation`).
Rows with status "oom" / "fail" are kept, with `iteration_time_s` None.

Torch-free: stdlib csv plus the trainer/contract/ dataclasses. `ParallelConfig` is stored as the source
ran it, even where our trainer would refuse it (ZeRO-1, an unpadded vocabulary): its constructor does
not validate, and `problems()` is the caller's call. Vocabularies are the source's number, unpadded
unless the source states the padded one; pad with `megatron_padded_vocab` as Megatron does.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.spec import padded_vocab

DATA_DIR = Path(__file__).resolve().parent / "data"

# Cluster keys: peak_tflops is dense fp16/bf16 tensor math per GPU (data sheets); intra_node_gbps is
# one GPU's unidirectional bandwidth to its node peers, inter_node_gbps one NODE's total network
# bandwidth, both GB/s. Latencies: ~5 us for an NVLink/PCIe hop, ~10 us for InfiniBand/Omni-Path
# (order of magnitude, not measured). gpus_per_node and num_nodes are filled in per row.
_A100_SXM = {"device": "A100", "peak_tflops": 312.0, "intra_node_gbps": 300.0, "intra_node_latency_us": 5.0}
# A100 data sheet: 312 TFLOP/s dense fp16/bf16; NVLink3: 12 links x 25 GB/s = 300 GB/s per direction.
_V100_SXM2 = {"device": "V100", "peak_tflops": 125.0, "intra_node_gbps": 150.0, "intra_node_latency_us": 5.0}
# V100 SXM2 data sheet: 125 TFLOP/s fp16 tensor; NVLink2: 6 links x 25 GB/s = 150 GB/s per direction
# (not every pair is directly linked in a hybrid cube mesh; 150 is the per-GPU average we take).

# gpu_type substring -> cluster. Exactly one must match each row's gpu_type.
CLUSTERS: dict[str, dict[str, Any]] = {
    # BLOOM model card: Jean Zay A100 nodes have 8 GPUs on NVLink and "4 OmniPath links" of
    # 100 Gb/s each: 4 * 100 / 8 = 50 GB/s per node.
    "A100-SXM 80GB (Jean Zay)": {
        "name": "jean-zay-a100-80gb", **_A100_SXM, "device_memory_gb": 80.0,
        "inter_node_gbps": 50.0, "inter_node_latency_us": 10.0,
    },
    # Selene is DGX A100 80GB: 8 HDR InfiniBand compute NICs of 200 Gb/s = 1600 Gb/s = 200 GB/s/node.
    "A100-SXM 80GB (Selene)": {
        "name": "selene-dgx-a100-80gb", **_A100_SXM, "device_memory_gb": 80.0,
        "inter_node_gbps": 200.0, "inter_node_latency_us": 10.0,
    },
    # vTrain: one 8-GPU A100 node (NVLink3). Memory size is not stated (DGX A100 ships 40 or 80 GB);
    # there are no OOM rows, so 80 only keeps a memory model from ruling measured layouts out.
    # Network: DGX A100's 200 GB/s, unused since every vTrain table fits in the one node.
    "A100 (single 8-GPU node": {
        "name": "vtrain-dgx-a100", **_A100_SXM, "device_memory_gb": 80.0,
        "inter_node_gbps": 200.0, "inter_node_latency_us": 10.0,
    },
    # Jean Zay V100 partitions: 4 V100 SXM2 per node on NVLink2; IDRIS's hardware page (from memory,
    # not in the data) gives GPU nodes 4 Omni-Path links of 100 Gb/s: 4 * 100 / 8 = 50 GB/s per node.
    "V100 16GB (Jean Zay v100-16g)": {
        "name": "jean-zay-v100-16gb", **_V100_SXM2, "device_memory_gb": 16.0,
        "inter_node_gbps": 50.0, "inter_node_latency_us": 10.0,
    },
    "V100 32GB (Jean Zay v100-32g)": {
        "name": "jean-zay-v100-32gb", **_V100_SXM2, "device_memory_gb": 32.0,
        "inter_node_gbps": 50.0, "inter_node_latency_us": 10.0,
    },
    # DLPerf: 8 V100-SXM2 16GB per node; the gpu_type column says 100 Gb/s IB = 12.5 GB/s per node.
    "V100-SXM2 16GB (100 Gb/s IB": {
        "name": "dlperf-v100-sxm2-16gb", **_V100_SXM2, "device_memory_gb": 16.0,
        "inter_node_gbps": 12.5, "inter_node_latency_us": 10.0,
    },
    # AWS g4dn.12xlarge: 4 T4 16GB (65 TFLOP/s fp16 tensor), no NVLink: PCIe 3.0 x16 (15.75 GB/s
    # raw, ~10 GB/s achieved); 50 Gb/s ENA = 6.25 GB/s per node, TCP (no EFA), hence ~30 us.
    "T4 16GB (4x AWS g4dn.12xlarge)": {
        "name": "aws-g4dn.12xlarge-t4", "device": "T4", "peak_tflops": 65.0, "device_memory_gb": 16.0,
        "intra_node_gbps": 10.0, "inter_node_gbps": 6.25,
        "intra_node_latency_us": 5.0, "inter_node_latency_us": 30.0,
    },
    # Our own tables (bench/measure_table.py): ranks on this project's 2-core dev VM, gloo over
    # loopback; the cpu-local preset's numbers (tuner/hardware.py).
    "CPU ranks, gloo (2-core VM)": {
        "name": "cpu-local", "device": "cpu", "peak_tflops": 0.05, "device_memory_gb": 12.0,
        "intra_node_gbps": 2.0, "inter_node_gbps": 2.0,
        "intra_node_latency_us": 50.0, "inter_node_latency_us": 50.0, "cores_per_node": 2,
    },
    # Our own 4-node tables (bench/measure_table.py --slurm --nodes 4): the local Slurm cluster of
    # tests/slurm_cluster.py, 4 network namespaces of 2 ranks each on one bridge, every rank on the
    # same 2-core VM: 8 ranks share 2 real cores, so 2 / 4 = 0.5 cores per node. Memory: 24 GB /
    # 8 ranks. Inside a node: the cpu-local preset's loopback-like 2.0 GB/s and 50 us (measured
    # 0.97-2.13 GB/s between two tasks on one node, docs/slurm.md "Shaped links").
    # Shaped: tbf at 200 Mbit/s on each node's bridge port, so a node receives 200 / 8 = 25 MB/s =
    # 0.025 GB/s (measured 24.0 MB/s with a 32 MiB socket transfer between two nodes).
    "4 nodes x 2 (2-core VM, 200 Mbit/s links)": {
        "name": "cpu-4node-200mbit", "device": "cpu", "peak_tflops": 0.05, "device_memory_gb": 3.0,
        "intra_node_gbps": 2.0, "inter_node_gbps": 0.025,
        "intra_node_latency_us": 50.0, "inter_node_latency_us": 50.0, "cores_per_node": 0.5,
    },
    # Unshaped: the same bridge without tc; between two nodes a socket transfer measured
    # UNSHAPED_MBS, round trip UNSHAPED_RTT.
    "4 nodes x 2 (2-core VM, unshaped links)": {
        "name": "cpu-4node-unshaped", "device": "cpu", "peak_tflops": 0.05, "device_memory_gb": 3.0,
        "intra_node_gbps": 2.0, "inter_node_gbps": 2.0,
        "intra_node_latency_us": 50.0, "inter_node_latency_us": 50.0, "cores_per_node": 0.5,
    },
}  # fmt: skip

# Shapes a source leaves empty. The BigScience BLOOM-prequel 02-20 runs (chronicles-prequel.md) do
# not restate NLAYERS/NHEADS. Layers: the notes say "chosen so PP divides it", and every prequel table
# that states its layers matches its name by 12*L*h^2 + V*h (177.0, 181.2, 182.0, 186.9, 196.1 B);
# we take the multiple of pp nearest the name (h 14400, V 250880; with or without the V*h term the
# pick is the same). Heads: the only config the doc states for h14400 is the 02-17 200B one, NHEADS=96
# (the notes add "doc later says all NHEADS=64"; tp=8 divides both, and heads move no FLOPs).
_HEADS_14400 = (
    96,
    "num_heads=96: not restated for the 02-20 runs; the doc's 02-17 200B config (h14400) used 96",
)
SHAPE_DEFAULTS: dict[str, dict[str, tuple[int, str]]] = {
    "bigscience_bloomprequel_183B_h14400_384gpu_gbs2048_mbs_sweep": {
        "num_layers": (72, "num_layers=72: not stated; multiple of pp=12 matching 183B (72 -> 182.8B)"),
        "num_heads": _HEADS_14400,
    },
    "bigscience_bloomprequel_194B_h14400_384gpu_gbs2048_mbs_sweep": {
        "num_layers": (78, "num_layers=78: not stated; multiples of pp=6 near 194B are 72 (182.8B, "
                           "the 183B model) and 78 (197.7B, 194.1B without V*h); size uncertain ~2%"),
        "num_heads": _HEADS_14400,
    },
    "bigscience_bloomprequel_195B_h14400_352gpu_gbs2048_mbs_sweep": {
        "num_layers": (77, "num_layers=77: not stated; multiple of pp=11 matching 195B (77 -> 195.2B)"),
        "num_heads": _HEADS_14400,
    },
    "bigscience_bloomprequel_200B_h14400_320gpu_gbs2048_mbs_sweep": {"num_heads": _HEADS_14400},
    "bigscience_bloomprequel_187B_h13824_L80_320gpu_gbs2048_mbs_sweep": {
        "num_heads": (64, "num_heads=64: not restated; the 196B table (same hidden 13824) states "
                          "NHEADS=64, and the doc later says all NHEADS=64"),
    },
}  # fmt: skip
# seq_len when a row leaves it empty: the validation README says "GBS 2048, seq 2048" for the
# BigScience prequel, and tr3m-1B3 trains at 2048 too (every row states it today).
SEQ_LEN_DEFAULTS = {"bigscience": 2048}


@dataclass(frozen=True)
class Measurement:
    table_id: str
    source: str
    model: ModelConfig
    parallel: ParallelConfig
    cluster: dict[str, Any]  # see CLUSTERS; a fresh dict per row
    precision: str  # "fp16" | "bf16" | "fp32"
    global_batch_size: int
    status: str  # "ok" | "oom" | "fail"
    iteration_time_s: float | None  # seconds per optimizer step; None unless status == "ok"
    notes: str  # the row's notes, verbatim
    # Context, not needed to predict a time:
    dataset: str = ""  # bench/data subfolder, e.g. "vtrain_single_node"
    framework: str = ""
    peak_memory_gb: float | None = None  # as reported, when the source reports it
    assumptions: tuple[str, ...] = ()  # every default this loader filled into this row


@dataclass(frozen=True)
class SkippedRow:
    path: str  # relative to the data dir
    line: int  # 1-based line in the CSV (header is line 1)
    table_id: str
    reason: str


@dataclass(frozen=True)
class ValidationData:
    tables: dict[str, list[Measurement]]  # table_id -> rows in file order; tables by (folder, file)
    skipped: list[SkippedRow] = field(default_factory=list)


def megatron_padded_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padding: up to a multiple of divisible_by * tp (50257 at tp 1 -> 50304). The
    tuner's own rule (tuner.spec.padded_vocab); tuner.perfmodel.estimate applies it itself."""
    return padded_vocab(vocab_size, tp, divisible_by)


def load_tables(data_dir: Path = DATA_DIR) -> dict[str, list[Measurement]]:
    return load_validation(data_dir).tables


def load_validation(data_dir: Path = DATA_DIR) -> ValidationData:
    tables: dict[str, list[Measurement]] = {}
    skipped: list[SkippedRow] = []
    for path in sorted(Path(data_dir).glob("*/*.csv")):
        rel = str(path.relative_to(data_dir))
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        table_ids = {row["table_id"] for row in rows}
        if table_ids != {path.stem}:
            raise ValueError(f"{rel}: expected table_id {path.stem!r} on every row, got {sorted(table_ids)}")
        measurements = tables.setdefault(path.stem, [])
        for line, row in enumerate(rows, start=2):
            try:
                measurements.append(_measurement(row, dataset=path.parent.name))
            except ValueError as e:
                skipped.append(SkippedRow(rel, line, path.stem, str(e)))
        if not measurements:
            del tables[path.stem]
    return ValidationData(tables, skipped)


def load_csv(path: Path) -> list[Measurement]:
    """One table file in the shared column format (rows that cannot be read raise ValueError)."""
    with Path(path).open(newline="") as f:
        return [_measurement(row, dataset=Path(path).parent.name) for row in csv.DictReader(f)]


def _measurement(row: dict[str, str], dataset: str) -> Measurement:
    assumptions: list[str] = []
    model = _model(row, dataset, assumptions)
    num_gpus, gbs = int(row["num_gpus"]), int(row["global_batch_size"])
    tp, pp, dp, mbs = (int(row[k]) for k in ("tp", "pp", "dp", "micro_batch_size"))
    tp_col = int(row.get("tp_col") or 1)  # our own tables' column degree (bench/measure_table.py)
    ep = int(row.get("ep") or 1)  # a mixture of experts' table: folded into dp x tp (not in num_gpus)
    cp = int(row.get("cp") or 1)  # a context-parallel table: in num_gpus, not in the batch
    if tp * tp_col * pp * dp * cp != num_gpus:
        col = f" * tp_col({tp_col})" if tp_col > 1 else ""
        ctx = f" * cp({cp})" if cp > 1 else ""
        raise ValueError(
            f"tp({tp}){col} * pp({pp}) * dp({dp}){ctx} = {tp * tp_col * pp * dp * cp} != num_gpus({num_gpus})"
        )
    if row["grad_accum_steps"].strip():
        grad_accum = int(row["grad_accum_steps"])
    else:
        grad_accum, rest = divmod(gbs, dp * mbs)
        if rest or grad_accum < 1:
            raise ValueError(f"global_batch({gbs}) is not a multiple of dp({dp}) * micro_batch({mbs})")
        assumptions.append(f"grad_accum_steps={grad_accum}: global_batch / (dp * micro_batch)")
    if mbs * grad_accum * dp != gbs:
        raise ValueError(
            f"micro_batch({mbs}) * grad_accum({grad_accum}) * dp({dp}) = {mbs * grad_accum * dp} "
            f"!= global_batch({gbs})"
        )
    zero_stage = _leading_int(row["zero_stage"]) if row["zero_stage"].strip() else 0
    checkpoint, sequence_parallel = _checkpointing(row["activation_checkpoint"])
    schedule, virtual_stages = _pp_schedule(row["framework"], pp)
    if (own := (row.get("pp_schedule") or "").strip()) and pp > 1:  # our own schedule tables' columns
        schedule, virtual_stages = own, int(row.get("virtual_stages") or 1)
    parallel = ParallelConfig(
        tp=tp, tp_col=tp_col, pp=pp, ep=ep, cp=cp,
        dp_replicate=dp if zero_stage == 0 else 1, dp_shard=1 if zero_stage == 0 else dp,
        micro_batch_size=mbs, num_microbatches=grad_accum, zero_stage=zero_stage,
        activation_checkpoint=checkpoint, sequence_parallel=sequence_parallel,
        pp_schedule=schedule, virtual_stages=virtual_stages,
    )  # fmt: skip
    status = row["status"].strip()
    if status not in ("ok", "oom", "fail"):
        raise ValueError(f"status {status!r} is not one of ok / oom / fail")
    time_s = _iteration_time_s(row, gbs) if status == "ok" else None
    return Measurement(
        table_id=row["table_id"],
        source=row["source"],
        model=model,
        parallel=parallel,
        cluster=_cluster(row, num_gpus),
        precision=_precision(row),
        global_batch_size=gbs,
        status=status,
        iteration_time_s=time_s,
        notes=row["notes"],
        dataset=dataset,
        framework=row["framework"],
        peak_memory_gb=float(row["peak_memory_gb"]) if row["peak_memory_gb"].strip() else None,
        assumptions=tuple(assumptions),
    )


def _model(row: dict[str, str], dataset: str, assumptions: list[str]) -> ModelConfig:
    if (config := row.get("model_config") or "").strip():  # our own MoE and CP tables: the whole model
        return ModelConfig.from_dict(json.loads(config))
    defaults = SHAPE_DEFAULTS.get(row["table_id"], {})
    shape: dict[str, int] = {}
    for name in ("num_layers", "num_heads"):
        if row[name].strip():
            shape[name] = int(row[name])
        elif name in defaults:
            shape[name], why = defaults[name]
            assumptions.append(why)
        else:
            raise ValueError(f"{name} is not stated and no default is known for this table")
    if row["seq_len"].strip():
        seq_len = int(row["seq_len"])
    elif dataset in SEQ_LEN_DEFAULTS:
        seq_len = SEQ_LEN_DEFAULTS[dataset]
        assumptions.append(f"seq_len={seq_len}: not stated; the {dataset} default")
    else:
        raise ValueError("seq_len is not stated and no default is known for this table")
    ffn = row["ffn_hidden_size"].strip()
    return ModelConfig(
        num_layers=shape["num_layers"],
        hidden_size=int(row["hidden_size"]),
        num_heads=shape["num_heads"],
        vocab_size=_vocab_size(row["vocab_size"]),
        seq_len=seq_len,
        ffn_hidden_size=int(ffn) if ffn else None,
    )


def _vocab_size(text: str) -> int:
    """The vocabulary as the source states it: the padded size where the source names one
    ("50257 padded (report FLOP formula uses 51200)" -> 51200), the exact size behind a rounded one
    ("250k (BLOOM tokenizer, ~250880)" -> 250880), else the leading number
    ("50257 (GPT-2 BPE, Megatron-padded)" -> 50257; the caller pads, see megatron_padded_vocab)."""
    text = text.strip()
    if m := re.search(r"uses (\d+)", text) or re.search(r"~(\d+)", text):
        return int(m[1])
    if m := re.fullmatch(r"(\d+)(\s.*)?", text):
        return int(m[1])
    raise ValueError(f"cannot read vocab_size from {text!r}")


def _leading_int(text: str) -> int:
    """ "1 (ZERO_STAGE=1 in the referenced slurm script)" -> 1."""
    if m := re.match(r"\s*(\d+)\b", text):
        return int(m[1])
    raise ValueError(f"expected a leading integer in {text!r}")


def _checkpointing(text: str) -> tuple[str, bool]:
    """(activation_checkpoint, sequence_parallel) from the free-text column."""
    t = text.strip().lower()
    if t.startswith("selective") and "sequence parallel" in t:  # Korthikanti et al. table 5
        return "selective", True
    sp = t.endswith(", sequence parallel")  # our own tables (bench/measure_table.py)
    if t.startswith(("yes", "likely yes", "full")):  # "likely yes": tr11 scripts pass the flag
        return "full", sp
    if t.startswith(("no ", "no,", "not enabled")) or t == "no":
        return "none", sp
    raise ValueError(f"cannot read activation_checkpoint from {text!r}")


def _pp_schedule(framework: str, pp: int) -> tuple[str, int]:
    """Megatron-LM / Megatron-DeepSpeed / DeepSpeed pipelines run 1F1B unless the framework column
    names interleaved chunks ("interleaved pipeline chunks=3" -> interleaved 1F1B, 3 stages per rank)."""
    m = re.search(r"interleaved pipeline chunks=(\d+)", framework)
    if m and int(m[1]) > 1 and pp > 1:
        return "interleaved_1f1b", int(m[1])
    return "1f1b", 1


def _iteration_time_s(row: dict[str, str], global_batch: int) -> float:
    name, text = row["measured_metric_name"].strip(), row["measured_value"].strip()
    if not text:
        raise ValueError(f"status ok but no {name} value")
    value = float(text)
    if value <= 0:
        raise ValueError(f"{name} {value} is not positive")
    if name == "iteration_time_s":
        return value
    if name == "iteration_time_ms":
        return value / 1000
    if name.startswith("samples_per_s"):
        return global_batch / value
    raise ValueError(f"unknown measured_metric_name {name!r}")


def _cluster(row: dict[str, str], num_gpus: int) -> dict[str, Any]:
    gpu_type = row["gpu_type"]
    matches = [cluster for key, cluster in CLUSTERS.items() if key in gpu_type]
    if len(matches) != 1:
        raise ValueError(f"gpu_type {gpu_type!r} matches {len(matches)} known clusters, not 1")
    gpus_per_node = int(row["gpus_per_node"])
    return {**matches[0], "gpus_per_node": gpus_per_node, "num_nodes": math.ceil(num_gpus / gpus_per_node)}


def _precision(row: dict[str, str]) -> str:
    """bf16 / fp32 only where the source says so; else fp16 (every V100/T4 table, and the A100
    sources that name a precision name fp16; on A100 the peak is the same for both)."""
    text = f"{row['framework']} {row['notes']}".lower()
    for precision in ("bf16", "fp32"):
        if precision in text:
            return precision
    return "fp16"
