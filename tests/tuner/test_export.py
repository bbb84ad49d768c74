"""Exported launch configs (torchtitan config module, Megatron-LM arguments, sbatch): golden files,
each parsed the way its stack parses it (torchtitan's own ConfigManager; Megatron-LM's flag list and
validate_args rules), and what each format must say for a few layouts. UPDATE_GOLDEN=1 rewrites the
golden files."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer.config import BenchmarkConfig, ParallelConfig
from trainer.pipeline import stage_layer_ranges
from tuner.dispatch.sbatch import ROOT, SiteSettings
from tuner.export import FORMATS, MEGATRON_SOURCE, TORCHTITAN_CONFIG_FN, TORCHTITAN_VERSION, export_layout
from tuner.spec import StudySpec, padded_model, parse_spec, slug

GOLDEN = Path(__file__).parent / "golden"
SITE = SiteSettings(account="abc123", partition="batch", setup=("source /opt/site/env.sh",),
                    python="/opt/site/venv/bin/python")  # fmt: skip


def _spec(model: str | dict, cluster: dict | str, num_gpus: int, global_batch: int, precision: str,
          **extra) -> StudySpec:  # fmt: skip
    name = model if isinstance(model, str) else model["preset"]
    return parse_spec({"name": f"{name}-export", "model": model, "cluster": cluster, "num_gpus": num_gpus,
                       "training": {"global_batch_size": global_batch, "precision": precision},
                       "space": {"tp": [1, 2, 4]}, **extra})  # fmt: skip


# name -> (spec, layout, site). Each layout's global batch (mbs x num_microbatches x dp) is the spec's.
CASES = {
    # 16 x H100: tp4 x pp2 (interleaved, 2 stages per rank) x dp_shard 2, ZeRO-3, full AC, SP.
    "gpt13b_h100": (
        _spec(
            "gpt-1.3b",
            {"preset": "h100-80gb", "num_nodes": 2},
            16,
            16,
            "bf16",
            trial={"device": "cuda"},
            slurm={
                "qos": "high",
                "constraint": "gpu&nvme",
                "modules": ["cuda/12.4", "nccl"],
                "env": {"NCCL_IB_HCA": "mlx5", "NOTE": "it's $(not) `run`"},
                "cpus_per_task": 12,
            },
        ),
        ParallelConfig(
            tp=4,
            pp=2,
            dp_shard=2,
            micro_batch_size=1,
            num_microbatches=8,
            zero_stage=3,
            activation_checkpoint="full",
            sequence_parallel=True,
            pp_schedule="interleaved_1f1b",
            virtual_stages=2,
        ),
        SITE,
    ),
    # The CPU test model on 2 local "devices" (gpus_per_node fixed: cpu-local counts this machine's cores).
    "tiny_cpu": (
        _spec(
            "gpt-tiny",
            {"preset": "cpu-local", "gpus_per_node": 4, "device_memory_gb": 4.0, "cores_per_node": 4},
            2,
            8,
            "fp32",
        ),
        ParallelConfig(dp_replicate=2, micro_batch_size=2, num_microbatches=2),
        None,
    ),
    # One DGX A100: tp2 x dp_shard 4 ZeRO-3 without pipeline (Megatron's torch-FSDP2 path), selective AC.
    "gpt350m_a100": (
        _spec("gpt-350m", "a100-80gb", 8, 32, "bf16"),
        ParallelConfig(
            tp=2,
            dp_shard=4,
            micro_batch_size=2,
            num_microbatches=4,
            zero_stage=3,
            activation_checkpoint="selective",
        ),
        SITE,
    ),
    # 2 Perlmutter nodes: GPipe pp2 x HSDP (2 replicas of 2 shards) ZeRO-2, fp16.
    "gpt125m_perlmutter": (
        _spec("gpt-125m", {"preset": "perlmutter-a100-40gb", "num_nodes": 2}, 8, 64, "fp16"),
        ParallelConfig(
            pp=2,
            dp_replicate=2,
            dp_shard=2,
            micro_batch_size=4,
            num_microbatches=4,
            zero_stage=2,
            pp_schedule="gpipe",
        ),
        SITE,
    ),
}


def _export(fmt: str, case: str) -> str:
    spec, config, site = CASES[case]
    assert config.global_batch_size == spec.training.global_batch_size and config.world_size == spec.devices
    return export_layout(fmt, spec, config, site=site)


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    text = text.replace(str(ROOT), "<ROOT>")
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; UPDATE_GOLDEN=1 rewrites it after a deliberate change"


def _megatron_args(text: str) -> tuple[list[str], dict[str, str | None]]:
    """(the launcher words before pretrain_gpt.py, {flag: value or None}) of the exported command."""
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    script = words.index("pretrain_gpt.py")
    flags: dict[str, str | None] = {}
    for word in words[script + 1 :]:
        if word.startswith("--"):
            flags[word] = None
            last = word
        else:
            assert flags[last] is None, f"{last} has two values"
            flags[last] = word
    return words[:script], flags


def _heredoc_config(script: str) -> BenchmarkConfig:
    body = script.split("<<'CONFIG_JSON'\n", 1)[1].split("\nCONFIG_JSON\n", 1)[0]
    return BenchmarkConfig.from_json(body)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_export_matches_golden_file(fmt: str, case: str) -> None:
    _golden(f"export_{fmt}_{case}.txt", _export(fmt, case))


# --- torchtitan: every golden file through torchtitan's own ConfigManager ---

# Layouts beyond the golden cases: more than 2 virtual stages per rank (pipeline_parallel_layers_per_stage)
# and an uneven layer split.
MORE_TORCHTITAN = {
    "virtual3": (_spec({"preset": "gpt-tiny", "num_layers": 12}, "h100-80gb", 4, 8, "bf16"),
                 ParallelConfig(pp=2, dp_shard=2, zero_stage=2, num_microbatches=4,
                                pp_schedule="interleaved_1f1b", virtual_stages=3)),
    "uneven": (_spec({"preset": "gpt-tiny", "num_layers": 5}, "h100-80gb", 8, 8, "bf16"),
               ParallelConfig(pp=2, dp_replicate=4, num_microbatches=2)),
}  # fmt: skip


@pytest.fixture(scope="module")
def torchtitan_parsed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """{name: what torchtitan parsed} for every golden torchtitan export, the MORE_TORCHTITAN
    layouts, and `no_cuda_graphs_rule`: the pipeline golden without its disable_cuda_graphs line.
    One process (tests/tuner/torchtitan_parse.py) keeps torchtitan's imports out of this one."""
    folder = tmp_path_factory.mktemp("torchtitan")
    modules = {}
    for case, (spec, *_) in CASES.items():
        modules[case] = ((GOLDEN / f"export_torchtitan_{case}.txt").read_text(), spec.gpt().num_layers)
    for name, (spec, config) in MORE_TORCHTITAN.items():
        modules[name] = (export_layout("torchtitan", spec, config), spec.gpt().num_layers)
    pipelined = modules["gpt13b_h100"][0]
    modules["no_cuda_graphs_rule"] = ("".join(line for line in pipelined.splitlines(keepends=True)
                                              if "disable_cuda_graphs" not in line), 24)  # fmt: skip
    for name, (text, _) in modules.items():
        (folder / f"titan_{name}.py").write_text(text)
    argv = [f"titan_{name}:{layers}" for name, (_, layers) in modules.items()]
    helper = Path(__file__).parent / "torchtitan_parse.py"
    run = subprocess.run([sys.executable, str(helper), str(folder), TORCHTITAN_CONFIG_FN, *argv],
                         capture_output=True, text=True, cwd=folder)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return {name.removeprefix("titan_"): parsed for name, parsed in json.loads(run.stdout).items()}


TORCHTITAN_CASES = {**{case: CASES[case][:2] for case in CASES}, **MORE_TORCHTITAN}


@pytest.mark.parametrize("case", TORCHTITAN_CASES)
def test_torchtitan_parses_the_export_into_the_measured_layout(case: str, torchtitan_parsed: dict) -> None:
    spec, c = TORCHTITAN_CASES[case]
    parsed = torchtitan_parsed[case]
    assert parsed["torchtitan"] == TORCHTITAN_VERSION and "error" not in parsed, parsed
    par, train = parsed["parallelism"], parsed["training"]
    assert {k: par[k] for k in ("tensor_parallel_degree", "pipeline_parallel_degree", "data_parallel_replicate_degree",
                                "data_parallel_shard_degree", "context_parallel_degree")} == {
        "tensor_parallel_degree": c.tp, "pipeline_parallel_degree": c.pp, "data_parallel_replicate_degree": c.dp_replicate,
        "data_parallel_shard_degree": c.dp_shard, "context_parallel_degree": 1}  # fmt: skip
    assert par["enable_sequence_parallel"] is c.sequence_parallel
    assert par["fsdp_reshard_after_forward"] == {0: "default", 2: "never", 3: "always"}[c.zero_stage]
    assert parsed["compile"]["enable_async_tensor_parallel"] is False
    assert parsed["activation_checkpoint"] == {"none": "NoneType", "full": "FullAC.Config",
                                               "selective": "SelectiveAC.Config"}[c.activation_checkpoint]  # fmt: skip
    assert (train["global_batch_size"], train["seq_len"]) == (c.global_batch_size, spec.seq_len)
    assert train["mixed_precision_param"] == ("float32" if spec.training.precision == "fp32" else "bfloat16")
    # The same sequences per step: with pp the local batch is one flush of pipeline micro-batches,
    # without it num_microbatches is gradient accumulation.
    if c.pp > 1:
        assert parsed["gradient_accumulation_steps"] == 1
        assert train["local_batch_size"] == par["pipeline_parallel_microbatch_size"] * c.num_microbatches
        assert par["pipeline_parallel_microbatch_size"] == c.micro_batch_size
        assert par["pipeline_parallel_schedule"] == {"gpipe": "GPipe", "1f1b": "1F1B",
                                                     "interleaved_1f1b": "Interleaved1F1B"}[c.pp_schedule]  # fmt: skip
        assert train["disable_cuda_graphs"] is True
        # torchtitan's own pipeline split gives every stage the layers our trainer gave it.
        ranges = stage_layer_ranges(spec.gpt().num_layers, c.num_stages)
        assert parsed["stage_layers"] == [list(r) for r in ranges]
    else:
        assert (parsed["gradient_accumulation_steps"], train["local_batch_size"]) == (c.num_microbatches,
                                                                                        c.micro_batch_size)  # fmt: skip


@pytest.mark.parametrize("case", TORCHTITAN_CASES)
def test_torchtitan_export_says_where_its_base_reads_tokenizer_and_data(
    case: str, torchtitan_parsed: dict
) -> None:
    """The debug config the export starts from reads a tokenizer and a dataset by paths relative to a
    torchtitan source checkout, which are not found elsewhere: the run note names them, as torchtitan
    parsed them."""
    parsed = torchtitan_parsed[case]
    assert parsed["assets_found"] is False  # the parse ran outside a checkout
    spec, config = TORCHTITAN_CASES[case]
    text = export_layout("torchtitan", spec, config)
    note = " ".join(line.removeprefix("# ") for line in text.splitlines() if line.startswith("#"))
    assert f"then run from the root of a torchtitan {TORCHTITAN_VERSION} source checkout:" in note
    assert f"tokenizer from {parsed['hf_assets_path']} and the {parsed['dataset']} dataset from " \
           f"{parsed['dataset_path']}, relative to the working directory" in note  # fmt: skip


def test_torchtitan_refuses_pipeline_parallelism_with_cuda_graphs(torchtitan_parsed: dict) -> None:
    """Why the export sets disable_cuda_graphs with pp > 1: torchtitan's own check."""
    error = torchtitan_parsed["no_cuda_graphs_rule"]["error"]
    assert "CUDA graphs do not support pipeline parallelism" in error


def test_torchtitan_refuses_a_stage_count_it_cannot_derive() -> None:
    spec = _spec({"preset": "gpt-tiny", "num_layers": 9}, "h100-80gb", 2, 2, "bf16")
    config = ParallelConfig(pp=2, num_microbatches=2, pp_schedule="interleaved_1f1b", virtual_stages=3)
    assert export_layout("sbatch", spec, config)  # our trainer runs it: 2 layers on the first 3 stages
    with pytest.raises(
        ValueError, match=r"no pipeline_parallel_layers_per_stage splits 9 layers into 6 stages"
    ):
        export_layout("torchtitan", spec, config)


# --- Megatron-LM: flags of its parser, and validate_args' rules ---


def _megatron_flags() -> tuple[str, set[str]]:
    """(the header naming the source, every flag) of Megatron-LM's parser, as written by
    scripts/check-megatron-export.py --flags-out (no Megatron package installs on Python 3.11)."""
    header, *flags = (Path(__file__).parent / "megatron_flags.txt").read_text().splitlines()
    return header, set(flags)


@pytest.mark.parametrize("case", CASES)
def test_megatron_export_uses_only_flags_of_megatrons_parser(case: str) -> None:
    header, known = _megatron_flags()
    assert header.startswith(f"# {MEGATRON_SOURCE.split(',')[0]}:")
    _, flags = _megatron_args((GOLDEN / f"export_megatron_{case}.txt").read_text())
    assert set(flags) <= known, set(flags) - known


def _connections(launcher: list[str]) -> str | None:
    """CUDA_DEVICE_MAX_CONNECTIONS as the exported command sets it: a value, "unset", or None
    when the command leaves the caller's environment as it is."""
    if launcher[:3] == ["env", "-u", "CUDA_DEVICE_MAX_CONNECTIONS"]:
        return "unset"
    prefix = "CUDA_DEVICE_MAX_CONNECTIONS="
    return next((word.removeprefix(prefix) for word in launcher if word.startswith(prefix)), None)


@pytest.mark.parametrize("case", CASES)
def test_megatron_export_passes_validate_args_rules(case: str) -> None:
    """The rules of Megatron's validate_args (megatron-core 0.19.2, megatron/training/arguments.py)
    that these layouts meet; scripts/check-megatron-export.py runs the real one (docs/exports.md)."""
    launcher, flags = _megatron_args((GOLDEN / f"export_megatron_{case}.txt").read_text())
    connections = _connections(launcher)
    tp, pp = int(flags["--tensor-model-parallel-size"]), int(flags["--pipeline-model-parallel-size"])
    if "--use-torch-fsdp2" in flags:
        assert connections == "unset" or ((connections or "").isdigit() and int(connections) > 1)
        assert pp == 1 and "--use-distributed-optimizer" not in flags and "--fp16" not in flags
        assert {"--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights"} <= set(flags)
    elif tp > 1:  # before Blackwell (every GPU the presets name)
        assert connections == "1"
    else:
        assert connections is None
    if "--num-layers-per-virtual-pipeline-stage" in flags:
        per_rank, rest = divmod(int(flags["--num-layers"]), pp)
        assert rest == 0 and per_rank % int(flags["--num-layers-per-virtual-pipeline-stage"]) == 0
        assert pp > 2 or "--no-overlap-p2p-communication" not in flags
    if "--sequence-parallel" in flags:
        assert tp > 1


def test_megatron_interleaved_zero3_pipeline_layout() -> None:
    launcher, flags = _megatron_args(_export("megatron", "gpt13b_h100"))
    assert launcher == ["CUDA_DEVICE_MAX_CONNECTIONS=1", "torchrun", "--nproc-per-node=8", "--nnodes=2"]
    expected = {
        "--tensor-model-parallel-size": "4", "--pipeline-model-parallel-size": "2",
        "--num-layers-per-virtual-pipeline-stage": "6",  # 24 layers / (pp 2 x 2 virtual stages)
        "--sequence-parallel": None, "--micro-batch-size": "1", "--global-batch-size": "16",
        "--num-layers": "24", "--hidden-size": "2048", "--num-attention-heads": "16",
        "--ffn-hidden-size": "8192", "--seq-length": "2048", "--max-position-embeddings": "2048",
        "--bf16": None, "--recompute-granularity": "full", "--recompute-method": "uniform",
        "--recompute-num-layers": "1", "--untie-embeddings-and-output-weights": None,
        # Megatron's torch-FSDP2 path has no pipeline parallelism: ZeRO-3 falls back to the
        # distributed optimizer (a comment says so).
        "--use-distributed-optimizer": None,
    }  # fmt: skip
    assert {k: flags.get(k, "<missing>") for k in expected} == expected
    assert "--use-torch-fsdp2" not in flags and "--fp16" not in flags


def test_megatron_other_layouts() -> None:
    launcher, tiny = _megatron_args(_export("megatron", "tiny_cpu"))
    assert launcher == ["torchrun", "--nproc-per-node=2", "--nnodes=1"]  # tp 1, no FSDP2: no setting
    assert (tiny["--tensor-model-parallel-size"], tiny["--pipeline-model-parallel-size"]) == ("1", "1")
    assert (tiny["--micro-batch-size"], tiny["--global-batch-size"]) == ("2", "8")
    assert not {"--bf16", "--fp16", "--recompute-granularity", "--use-distributed-optimizer",
                "--sequence-parallel", "--num-layers-per-virtual-pipeline-stage"} & set(tiny)  # fmt: skip
    launcher, fsdp = _megatron_args(_export("megatron", "gpt350m_a100"))
    # tp 2 would want CUDA_DEVICE_MAX_CONNECTIONS=1, but FSDP2's assertion wins: unset.
    assert launcher[:4] == ["env", "-u", "CUDA_DEVICE_MAX_CONNECTIONS", "torchrun"]
    assert "--use-torch-fsdp2" in fsdp and "--use-distributed-optimizer" not in fsdp
    assert fsdp["--recompute-granularity"] == "selective" and "--recompute-method" not in fsdp
    launcher, hsdp = _megatron_args(_export("megatron", "gpt125m_perlmutter"))
    assert launcher == ["torchrun", "--nproc-per-node=4", "--nnodes=2"]
    assert "--fp16" in hsdp and "--use-distributed-optimizer" in hsdp
    assert "--num-layers-per-virtual-pipeline-stage" not in hsdp


def test_megatron_fsdp2_of_an_fp16_study_runs_bf16() -> None:
    """validate_args: --use-torch-fsdp2 is not supported with fp16; the trainer measured bf16."""
    spec, _, _ = CASES["gpt125m_perlmutter"]
    text = export_layout("megatron", spec, ParallelConfig(dp_shard=8, micro_batch_size=8, zero_stage=3))
    _, flags = _megatron_args(text)
    assert "--use-torch-fsdp2" in flags and "--bf16" in flags and "--fp16" not in flags
    assert "--use-torch-fsdp2 does not support fp16" in text


# Interleaved layouts beyond the golden cases: micro-batch counts that are not a multiple of pp (6 and 10
# on pp 4: torch's Interleaved1F1B runs them in rounds of 6 and 5), and one below pp, which
# `tuner plan --model gpt-1.3b --cluster h100-80gb --gpus 8 --global-batch 6` ranked first (pp4 v2, 3
# micro-batches).
def _interleaved(num_microbatches: int, global_batch: int) -> tuple[StudySpec, ParallelConfig]:
    return _spec("gpt-1.3b", "h100-80gb", 8, global_batch, "bf16"), ParallelConfig(
        pp=4,
        dp_replicate=2,
        num_microbatches=num_microbatches,
        pp_schedule="interleaved_1f1b",
        virtual_stages=2,
    )


MORE_MEGATRON = {"m6_pp4": _interleaved(6, 12), "m10_pp4": _interleaved(10, 20)}
FEWER_MICROBATCHES_THAN_PP = _interleaved(3, 6)


def _megatron_schedule_layout(text: str) -> list[int | None]:
    """[pp, virtual stages, micro-batches, group or None] as Megatron derives them from the command:
    micro-batches = global batch / (micro-batch x dp), dp = world / (tp x pp)."""
    launcher, flags = _megatron_args(text)
    options = dict(word.split("=", 1) for word in launcher if word.startswith("--"))
    world = int(options["--nproc-per-node"]) * int(options["--nnodes"])
    tp, pp = int(flags["--tensor-model-parallel-size"]), int(flags["--pipeline-model-parallel-size"])
    layers_per_rank = int(flags["--num-layers"]) // pp
    virtual = layers_per_rank // int(flags["--num-layers-per-virtual-pipeline-stage"])
    microbatches = int(flags["--global-batch-size"]) // (
        int(flags["--micro-batch-size"]) * world // (tp * pp)
    )
    group = flags.get("--microbatch-group-size-per-virtual-pipeline-stage")
    return [pp, virtual, microbatches, None if group is None else int(group)]


INTERLEAVED_CASES = ["gpt13b_h100", *MORE_MEGATRON]


def _megatron_text(case: str) -> str:
    if case in MORE_MEGATRON:
        return export_layout("megatron", *MORE_MEGATRON[case])
    return (GOLDEN / f"export_megatron_{case}.txt").read_text()


@pytest.fixture(scope="module")
def megatron_schedules() -> dict[str, dict]:
    """{name: what Megatron's own interleaved schedule decided} for every interleaved export, the same
    commands without a micro-batch group flag (`<case>:default`), and the layout below pp with every
    group (`fewer:<group>`). One process (tests/tuner/megatron_schedule.py) keeps megatron.core's
    imports out of this one."""
    layouts = {}
    for case in INTERLEAVED_CASES:
        layouts[case] = _megatron_schedule_layout(_megatron_text(case))
        layouts[f"{case}:default"] = [*layouts[case][:3], None]
    config = FEWER_MICROBATCHES_THAN_PP[1]
    for group in [None, *range(1, 2 * config.pp + 1)]:
        layouts[f"fewer:{group}"] = [config.pp, config.virtual_stages, config.num_microbatches, group]
    helper = Path(__file__).parent / "megatron_schedule.py"
    run = subprocess.run([sys.executable, str(helper), json.dumps(layouts)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def _trainer_forward_order(config: ParallelConfig, rank: int) -> list[list[int]]:
    """(micro-batch, model chunk) of each forward pass of `rank`, in the order the trainer's schedule
    (torch's ScheduleInterleaved1F1B, trainer/pipeline.py) runs them."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    stages = [SimpleNamespace(group_size=config.pp, group_rank=rank, stage_index=rank + k * config.pp,
                              num_stages=config.num_stages, is_first=False, is_last=False)
              for k in range(config.virtual_stages)]  # fmt: skip
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=config.num_microbatches)
    return [[a.microbatch_index, a.stage_index // config.pp] for a in schedule.pipeline_order[rank]
            if a is not None and a.computation_type == _ComputationType.FORWARD]  # fmt: skip


@pytest.mark.parametrize("case", INTERLEAVED_CASES)
def test_megatrons_interleaved_schedule_runs_the_export_in_the_measured_order(
    case: str, megatron_schedules: dict
) -> None:
    """Megatron's schedule accepts the exported micro-batch count and group (validate_args does not
    check them: only forward_backward_pipelining_with_interleaving does, at the first step), and runs
    each rank's forward passes in the order our trainer measured."""
    decided = megatron_schedules[case]
    assert decided["megatron_core"] == "0.16.1" and decided["error"] is None, decided
    config = MORE_MEGATRON[case][1] if case in MORE_MEGATRON else CASES[case][1]
    for rank in range(config.pp):
        assert decided["table"] == _trainer_forward_order(config, rank)


def test_megatron_refuses_the_default_group_when_microbatches_are_not_a_multiple_of_pp(
    megatron_schedules: dict,
) -> None:
    """Why the export writes --microbatch-group-size-per-virtual-pipeline-stage: without it
    Megatron's schedule refuses 6 and 10 micro-batches on pp 4 (and accepts 8 on pp 2)."""
    assert megatron_schedules["gpt13b_h100:default"]["error"] is None
    for case in MORE_MEGATRON:
        assert "The remainder of M" in megatron_schedules[f"{case}:default"]["error"]
    assert _megatron_schedule_layout(_megatron_text("m6_pp4"))[3] == 6
    assert _megatron_schedule_layout(_megatron_text("m10_pp4"))[3] == 5
    assert "group (pp); this group is the one measured" in _megatron_text("m10_pp4")


def test_megatron_refuses_fewer_microbatches_than_pp(megatron_schedules: dict) -> None:
    """3 micro-batches on pp 4: Megatron's schedule refuses every group (it must lie in [pp, 3]), so
    the export is refused with the reason; our trainer runs it (sbatch)."""
    spec, config = FEWER_MICROBATCHES_THAN_PP
    for group in [None, *range(1, 2 * config.pp + 1)]:
        assert megatron_schedules[f"fewer:{group}"]["error"], group
    assert export_layout("sbatch", spec, config)
    with pytest.raises(
        ValueError, match=r"megatron: .*num_microbatches \(3\) < pp \(4\): Megatron-LM's interleaved"
    ):
        export_layout("megatron", spec, config)


def test_megatron_refuses_an_uneven_layer_split() -> None:
    spec, config = MORE_TORCHTITAN["uneven"]
    assert export_layout("torchtitan", spec, config)  # torchtitan splits unevenly (parsed above)
    with pytest.raises(ValueError, match=r"megatron: .*num_layers \(5\) is not a multiple of pp \(2\)"):
        export_layout("megatron", spec, config)


@pytest.mark.parametrize("case", CASES)
def test_sbatch_is_valid_bash_with_directives_first_and_the_config_inline(case: str) -> None:
    spec, config, _ = CASES[case]
    script = _export("sbatch", case)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    lines = script.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(not line.startswith("#SBATCH") for line in lines[first_command:])  # sbatch stops reading there
    assert (
        f"#SBATCH --job-name={slug(spec.name)}" in lines and f"#SBATCH --ntasks={config.world_size}" in lines
    )
    cfg = _heredoc_config(script)
    assert (cfg.parallel, cfg.model) == (config, padded_model(spec.gpt(), config.tp))
    assert lines[-1].endswith("-m trainer.benchmark --config config.json --out result.json")
    # A benchmark on nodes of its own, stopped by the first failing line, and no path of the machine
    # that exported it: the trainer comes from the site's python.
    assert "#SBATCH --exclusive" in lines and lines[first_command] == "set -euo pipefail"
    assert str(ROOT) not in script and sys.executable not in script
    assert not [line for line in lines if line.startswith("export PYTHONPATH")]


def test_sbatch_resources_and_precision() -> None:
    big = _export("sbatch", "gpt13b_h100")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=10", "#SBATCH --account=abc123", "#SBATCH --qos=high",
                 "#SBATCH --constraint=gpu&nvme", "module load cuda/12.4"):  # fmt: skip
        assert line in big.splitlines(), line
    assert "export NOTE='it'\"'\"'s $(not) `run`'" in big
    assert (_heredoc_config(big).device, _heredoc_config(big).dtype) == ("cuda", "bf16")
    assert _heredoc_config(_export("sbatch", "gpt125m_perlmutter")).dtype == "bf16"  # fp16 runs as bf16
    tiny = _export("sbatch", "tiny_cpu")
    assert (_heredoc_config(tiny).device, _heredoc_config(tiny).dtype) == ("cpu", "fp32")
    assert "--gpus-per-node" not in tiny and "--account" not in tiny  # no site: no site options


def test_unknown_format_names_the_valid_ones() -> None:
    spec, config, _ = CASES["tiny_cpu"]
    with pytest.raises(
        ValueError, match=r"unknown format 'yaml'; valid: \['torchtitan', 'megatron', 'sbatch'\]"
    ):
        export_layout("yaml", spec, config)


def test_a_layout_the_model_cannot_run_is_refused() -> None:
    spec, _, _ = CASES["tiny_cpu"]
    with pytest.raises(ValueError, match=r"tp \(3\) must divide num_heads \(4\)"):
        export_layout("torchtitan", spec, ParallelConfig(tp=3))


def test_site_names_are_checked_like_a_specs() -> None:
    spec, config, _ = CASES["tiny_cpu"]
    with pytest.raises(ValueError, match="partition"):
        export_layout("sbatch", spec, config, site=SiteSettings(partition="debug\nrm -rf /"))


HOSTILE = 'x; rm -rf $(pwd) "q" ../y'


def test_a_hostile_study_or_cluster_name_appears_only_as_its_slug(tmp_path: Path) -> None:
    spec = parse_spec({"name": HOSTILE, "model": "gpt-tiny", "num_gpus": 2, "training": {"global_batch_size": 2},
                       "space": {"tp": [1]}, "cluster": {"preset": "cpu-local", "gpus_per_node": 2, "name": "c\n$(id)"}})  # fmt: skip
    config = ParallelConfig(dp_replicate=2)
    for fmt in FORMATS:
        text = export_layout(fmt, spec, config)
        assert HOSTILE not in text and "rm -rf" not in text and "$(pwd)" not in text and "$(id)" not in text
        assert slug(HOSTILE) in text
    script = export_layout("sbatch", spec, config)
    assert f"#SBATCH --job-name={slug(HOSTILE)}" in script.splitlines()
    # Run it with a stand-in srun: the config lands in <slug>-<job id>/ and nothing else is created.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\necho "$PWD" "$@" > "$ARGS_OUT"\n')
    (bin_dir / "srun").chmod(0o755)
    submit = tmp_path / "submit"
    submit.mkdir()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "ARGS_OUT": str(tmp_path / "args")}
    subprocess.run(["bash", "-c", script], cwd=submit, env=env, check=True)
    run_dir = submit / f"{slug(HOSTILE)}-42"
    assert [p.name for p in submit.iterdir()] == [run_dir.name]
    assert BenchmarkConfig.from_json((run_dir / "config.json").read_text()).parallel == config
    assert (tmp_path / "args").read_text().split() == [
        str(run_dir), "--kill-on-bad-exit=1", "--wait=60", "--distribution=block", "python", "-m", "trainer.benchmark", "--config", "config.json",
        "--out", "result.json",
    ]  # fmt: skip


def test_the_exported_job_stops_at_the_first_failing_line(tmp_path: Path) -> None:
    """A site setup line that fails (a module the cluster lacks, say) ends the job before srun."""
    spec, config, _ = CASES["tiny_cpu"]
    script = export_layout("sbatch", spec, config, site=SiteSettings(setup=("false",), python="python"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\ntouch "$SRUN_RAN"\n')
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SRUN_RAN": str(tmp_path / "srun-ran")}
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env)
    assert run.returncode == 1 and not (tmp_path / "srun-ran").exists()
    assert not (tmp_path / f"{slug(spec.name)}-7").exists()


def _study_with_a_result(db: str, slurm: dict) -> int:
    """A tiny CPU study with one completed trial in a fresh database; `slurm` is its spec's section."""
    from tests import records
    from tuner import store
    from tuner.db import connect
    from tuner.outcome import Outcome

    spec = _spec("gpt-tiny", {"preset": "cpu-local", "gpus_per_node": 2}, 2, 8, "fp32", slurm=slurm)
    with connect(db).begin() as s:
        study = store.create_study(s, spec)
        records.record_trial(s, study, ParallelConfig(dp_replicate=2, micro_batch_size=4),
                             Outcome(ok=True, tokens_per_s=900.0, mfu=0.1, step_time_s=0.3,
                                     peak_memory_bytes=10_000, tflops_per_device=0.01))  # fmt: skip
        records.finish(s, study.id)
        return study.id


def test_the_cli_and_the_api_export_the_sites_slurm_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TUNER_SLURM_ACCOUNT, PARTITION, PYTHON and SETUP reach the exported script as they reach a trial
    job, from `tuner export` and from the API alike; what the study's spec sets wins."""
    from fastapi.testclient import TestClient

    from api.main import create_app
    from tuner.settings import Settings

    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    study_id = _study_with_a_result(db, {"partition": "gpu"})
    setup = tmp_path / "setup.sh"
    setup.write_text("source /opt/site/env.sh\n")
    site = {"TUNER_SLURM_ACCOUNT": "site-acct", "TUNER_SLURM_PARTITION": "site-part",
            "TUNER_SLURM_PYTHON": "/opt/site/bin/python", "TUNER_SLURM_SETUP": str(setup)}  # fmt: skip
    tuner = str(Path(sys.executable).parent / "tuner")
    argv = [tuner, "export", str(study_id), "--format", "sbatch"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TUNER_")}, "TUNER_DATABASE_URL": db}
    cli = subprocess.run(argv, capture_output=True, text=True, env={**env, **site}, timeout=120)
    assert cli.returncode == 0, cli.stderr
    lines = cli.stdout.splitlines()
    assert {"#SBATCH --account=site-acct", "#SBATCH --partition=gpu", "source /opt/site/env.sh"} <= set(lines)
    assert "#SBATCH --partition=site-part" not in lines
    assert lines[-1].startswith("exec srun ") and " /opt/site/bin/python -m trainer.benchmark " in lines[-1]
    for name, value in {**site, "TUNER_DATABASE_URL": db}.items():
        monkeypatch.setenv(name, value)
    api = TestClient(create_app(Settings.from_env())).get(f"/api/studies/{study_id}/export?format=sbatch")
    assert api.status_code == 200 and api.text == cli.stdout
    # Without TUNER_SLURM_PYTHON: python from the job's PATH, not this machine's interpreter.
    bare = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120).stdout.splitlines()
    assert " python -m trainer.benchmark " in bare[-1] and not [line for line in bare if "--account" in line]
