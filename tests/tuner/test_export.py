"""Exported launch configs (torchtitan TOML, Megatron-LM arguments, sbatch): golden files, and what
each format must say for a few layouts. UPDATE_GOLDEN=1 rewrites the golden files."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from trainer.config import BenchmarkConfig, ParallelConfig
from tuner.dispatch.sbatch import ROOT, SiteSettings
from tuner.export import FORMATS, export_layout
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


def _toml(text: str) -> dict:
    return pytest.importorskip("tomllib").loads(text)  # Python 3.11+


def _megatron_args(text: str) -> tuple[list[str], dict[str, str | None]]:
    """(the torchrun words before pretrain_gpt.py, {flag: value or None}) of the exported command."""
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


@pytest.mark.parametrize("case", CASES)
def test_torchtitan_is_toml_with_the_layout(case: str) -> None:
    spec, config, _ = CASES[case]
    doc = _toml(_export("torchtitan", case))
    par, train = doc["parallelism"], doc["training"]
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"]) == (config.tp, config.pp)
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (
        config.dp_replicate, config.dp_shard)  # fmt: skip
    assert par["enable_async_tensor_parallel"] is False
    assert par["pipeline_parallel_microbatch_size"] == config.micro_batch_size
    assert train["global_batch_size"] == spec.training.global_batch_size and train["seq_len"] == spec.seq_len
    # torchtitan accumulates global / (local x dp) steps; with pp the local batch is one flush.
    accumulation = train["global_batch_size"] // (train["local_batch_size"] * config.dp)
    assert accumulation == (1 if config.pp > 1 else config.num_microbatches)
    assert doc["activation_checkpoint"]["mode"] == config.activation_checkpoint


def test_torchtitan_maps_schedules_zero_stages_and_precision() -> None:
    big = _toml(_export("torchtitan", "gpt13b_h100"))
    assert big["parallelism"]["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert big["parallelism"]["fsdp_reshard_after_forward"] == "always"  # ZeRO-3
    assert (big["training"]["local_batch_size"], big["training"]["mixed_precision_param"]) == (8, "bfloat16")
    hsdp = _toml(_export("torchtitan", "gpt125m_perlmutter"))
    assert hsdp["parallelism"]["pipeline_parallel_schedule"] == "GPipe"
    assert hsdp["parallelism"]["fsdp_reshard_after_forward"] == "never"  # ZeRO-2
    tiny = _toml(_export("torchtitan", "tiny_cpu"))
    assert (tiny["training"]["local_batch_size"], tiny["training"]["mixed_precision_param"]) == (2, "float32")
    assert _toml(_export("torchtitan", "gpt350m_a100"))["activation_checkpoint"] == {
        "mode": "selective", "selective_ac_option": "op"}  # fmt: skip


def test_megatron_interleaved_zero3_pipeline_layout() -> None:
    launcher, flags = _megatron_args(_export("megatron", "gpt13b_h100"))
    assert launcher == ["torchrun", "--nproc-per-node=8", "--nnodes=2"]
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
    assert launcher == ["torchrun", "--nproc-per-node=2", "--nnodes=1"]
    assert (tiny["--tensor-model-parallel-size"], tiny["--pipeline-model-parallel-size"]) == ("1", "1")
    assert (tiny["--micro-batch-size"], tiny["--global-batch-size"]) == ("2", "8")
    assert not {"--bf16", "--fp16", "--recompute-granularity", "--use-distributed-optimizer",
                "--sequence-parallel", "--num-layers-per-virtual-pipeline-stage"} & set(tiny)  # fmt: skip
    _, fsdp = _megatron_args(_export("megatron", "gpt350m_a100"))
    assert "--use-torch-fsdp2" in fsdp and "--use-distributed-optimizer" not in fsdp
    assert fsdp["--recompute-granularity"] == "selective" and "--recompute-method" not in fsdp
    launcher, hsdp = _megatron_args(_export("megatron", "gpt125m_perlmutter"))
    assert launcher == ["torchrun", "--nproc-per-node=4", "--nnodes=2"]
    assert "--fp16" in hsdp and "--use-distributed-optimizer" in hsdp
    assert "--num-layers-per-virtual-pipeline-stage" not in hsdp


def test_megatron_refuses_an_uneven_layer_split() -> None:
    spec = _spec({"preset": "gpt-tiny", "num_layers": 5}, "h100-80gb", 8, 8, "bf16")
    config = ParallelConfig(pp=2, dp_replicate=4, num_microbatches=2)
    assert export_layout("torchtitan", spec, config)  # torchtitan splits unevenly
    with pytest.raises(ValueError, match=r"num_layers \(5\) is not a multiple of pp \(2\)"):
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
        str(run_dir), "--kill-on-bad-exit=1", "--distribution=block", "python", "-m", "trainer.benchmark", "--config", "config.json",
        "--out", "result.json",
    ]  # fmt: skip
