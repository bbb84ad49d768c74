"""Exported launch configs (torchtitan config module, Megatron-LM arguments, sbatch): golden files,
each parsed the way its stack parses it (torchtitan's own ConfigManager; Megatron-LM's flag list and
validate_args rules), and what each format must say for a few layouts. UPDATE_GOLDEN=1 rewrites the
golden files."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer.context_parallel import local_positions
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig
from trainer.pipeline import stage_layer_ranges
from tuner.dispatch.sbatch import ROOT, SiteSettings
from tuner.exports import FORMATS, MEGATRON_SOURCE, TORCHTITAN_CONFIG_FN, TORCHTITAN_VERSION, export_layout
from tuner.exports.torchtitan.moe import balance_coeff
from tuner.spec import StudySpec, padded_model, parse_spec, slug

GOLDEN = Path(__file__).parent / "golden"
SITE = SiteSettings(account="abc123", partition="batch", setup=("source /opt/site/env.sh",),
                    python="/opt/site/venv/bin/python")  # fmt: skip


def _spec(model: str | dict, cluster: dict | str, num_gpus: int, global_batch: int, precision: str,
          training: dict | None = None, **extra) -> StudySpec:  # fmt: skip
    name = model if isinstance(model, str) else model["preset"]
    training = {"global_batch_size": global_batch, "precision": precision, **(training or {})}
    return parse_spec({"name": f"{name}-export", "model": model, "cluster": cluster, "num_gpus": num_gpus,
                       "training": training, "space": {"tp": [1, 2, 4]}, **extra})  # fmt: skip


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
    # Llama 3.1 8B on 16 x H100: tp4 (2 KV heads per rank) x pp2 1F1B x dp_shard 2, ZeRO-2, selective AC, SP.
    "llama8b_h100": (
        _spec("llama3.1-8b", {"preset": "h100-80gb", "num_nodes": 2}, 16, 16, "bf16"),
        ParallelConfig(tp=4, pp=2, dp_shard=2, micro_batch_size=1, num_microbatches=8, zero_stage=2,
                       activation_checkpoint="selective", sequence_parallel=True),
        SITE,
    ),
    # Qwen2.5-7B (q/k/v bias, base 1e6, eps 1e-6) on one DGX A100: tp4 (one KV head per rank) x dp_shard 2
    # ZeRO-3 without pipeline (Megatron's torch-FSDP2 path), full AC.
    "qwen7b_a100": (
        _spec("qwen2.5-7b", "a100-80gb", 8, 8, "bf16"),
        ParallelConfig(tp=4, dp_shard=2, micro_batch_size=1, num_microbatches=4, zero_stage=3,
                       activation_checkpoint="full"),
        SITE,
    ),
    # Qwen3-30B-A3B (128 experts of 768, top 8; heads of 128, per-head q/k norms) on 16 x H100: pp2 1F1B x
    # dp_shard 8 ZeRO-2, the experts over ep 8 (one expert rank group per pipeline stage, edp 1).
    "qwen3moe_h100": (
        _spec("qwen3-30b-a3b", {"preset": "h100-80gb", "num_nodes": 2}, 16, 64, "bf16"),
        ParallelConfig(pp=2, dp_shard=8, ep=8, num_microbatches=8, zero_stage=2),
        SITE,
    ),
    # Llama 3.1 8B at 32k tokens on 16 x H100: tp2 + SP x cp4 (8 head-tail chunks of 4096 tokens) x dp_shard 2,
    # ZeRO-2, full AC: gradients averaged over dp 2 x cp 4.
    "llama8b_cp_h100": (
        _spec("llama3.1-8b", {"preset": "h100-80gb", "num_nodes": 2}, 16, 8, "bf16", {"seq_len": 32768}),
        ParallelConfig(tp=2, dp_shard=2, cp=4, num_microbatches=4, zero_stage=2, activation_checkpoint="full",
                       sequence_parallel=True),
        SITE,
    ),
    # The CPU Llama (2 KV heads for 4 query heads) on 4 local "devices": tp2 x dp_replicate 2.
    "llama_tiny_cpu": (
        _spec("llama-tiny", {"preset": "cpu-local", "gpus_per_node": 4, "device_memory_gb": 4.0, "cores_per_node": 4},
              4, 8, "fp32", space={"tp": [1, 2]}),
        ParallelConfig(tp=2, dp_replicate=2, micro_batch_size=2, num_microbatches=2),
        None,
    ),
}  # fmt: skip


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


MANY_VALUES = {"--recompute-modules"}  # Megatron's flags that take several values


def _megatron_args(text: str) -> tuple[list[str], dict[str, str | None]]:
    """(the launcher words before pretrain_gpt.py, {flag: value or None}) of the exported command."""
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    script = words.index("pretrain_gpt.py")
    flags: dict[str, str | None] = {}
    for word in words[script + 1 :]:
        if word.startswith("--"):
            flags[word] = None
            last = word
        elif last in MANY_VALUES and flags[last] is not None:  # nargs="+" in Megatron's parser
            flags[last] += f" {word}"
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

# The other Llama-family presets beyond the golden cases, each in a layout it fits: tied heads (Llama
# 3.2), 70B and 405B over pipelines, and the small CPU shape.
MORE_LLAMA = {
    "llama1b_tied": (_spec("llama3.2-1b", "h100-80gb", 8, 8, "bf16"),
                     ParallelConfig(tp=2, dp_shard=4, num_microbatches=2, zero_stage=3)),
    "llama3b_tied": (_spec("llama3.2-3b", "h100-80gb", 8, 8, "bf16", space={"tp": [1, 2, 4, 8]}),
                     ParallelConfig(tp=8, num_microbatches=8, sequence_parallel=True)),
    "llama70b": (_spec("llama3.1-70b", {"preset": "h100-80gb", "num_nodes": 8}, 64, 32, "bf16"),
                 ParallelConfig(tp=8, pp=4, dp_shard=2, num_microbatches=16, zero_stage=2,
                                activation_checkpoint="full", sequence_parallel=True)),
    "llama405b": (_spec("llama3.1-405b", {"preset": "h100-80gb", "num_nodes": 18}, 144, 36, "bf16"),
                  ParallelConfig(tp=8, pp=9, dp_shard=2, num_microbatches=18, zero_stage=2,
                                 activation_checkpoint="full", sequence_parallel=True)),
    "llama_small": (_spec("llama-small", {"preset": "cpu-local", "gpus_per_node": 2}, 2, 4, "fp32",
                          space={"tp": [1, 2]}),
                    ParallelConfig(dp_shard=2, num_microbatches=2, zero_stage=3)),
}  # fmt: skip
# Mixtures of experts beyond the golden case, each in a layout it can run: Mixtral (no q/k norms) over tp2 + SP,
# pp2 and ep 8 of dp 4 x tp 2; DeepSeek-V3 (latent attention, sigmoid group-limited routing with the expert
# bias, a shared expert, 3 dense layers) over tp2 + SP and ep 32, ZeRO-3, full AC; the CPU DeepSeek-shaped
# router on 4 ranks.
MORE_MOE = {
    "mixtral": (_spec("mixtral-8x7b", {"preset": "h100-80gb", "num_nodes": 2}, 16, 32, "bf16"),
                ParallelConfig(tp=2, pp=2, dp_shard=4, ep=8, num_microbatches=8, zero_stage=2, sequence_parallel=True,
                               activation_checkpoint="full")),
    "deepseek_v3": (_spec("deepseek-v3", {"preset": "h100-80gb", "num_nodes": 8}, 64, 32, "bf16"),
                    ParallelConfig(tp=2, dp_shard=32, ep=32, zero_stage=3, sequence_parallel=True,
                                   activation_checkpoint="full")),
    "moe_tiny_ds": (_spec("moe-tiny-ds", {"preset": "cpu-local", "gpus_per_node": 4, "device_memory_gb": 4.0,
                                          "cores_per_node": 4}, 4, 8, "fp32"),
                    ParallelConfig(dp_shard=4, ep=4, zero_stage=2, num_microbatches=2)),
}  # fmt: skip
# The same study measured with balanced routing (training.moe_routing; BenchmarkConfig.moe_routing).
MOE_BALANCED = _spec("moe-tiny-ds", {"preset": "cpu-local", "gpus_per_node": 4, "device_memory_gb": 4.0,
                                     "cores_per_node": 4}, 4, 8, "fp32", {"moe_routing": "balanced"})  # fmt: skip
# ... and with token drop at capacity factor 1 (training.moe_capacity_factor): Megatron's
# --moe-expert-capacity-factor; torchtitan has none.
MOE_TOKEN_DROP = _spec("moe-tiny-ds", {"preset": "cpu-local", "gpus_per_node": 4, "device_memory_gb": 4.0,
                                       "cores_per_node": 4}, 4, 8, "fp32", {"moe_capacity_factor": 1.0})  # fmt: skip
# Context parallelism beyond the golden case: with a pipeline and without sharding (zero_stage 0, which torchtitan
# shards over cp all the same), ep 4 over dp_shard 2 x cp 2 (torchtitan borrows it from dp_shard x cp x tp), and
# ZeRO-3 over the cp ranks alone.
CP_CASES = {
    "cp_pipeline": (_spec("llama-small", {"preset": "cpu-local", "gpus_per_node": 8}, 8, 4, "fp32", space={"tp": [1, 2]}),
                    ParallelConfig(pp=2, dp_replicate=2, cp=2, num_microbatches=2)),
    "moe_cp": (_spec("moe-tiny-ds", {"preset": "cpu-local", "gpus_per_node": 4, "device_memory_gb": 4.0,
                                     "cores_per_node": 4}, 4, 4, "fp32"),
               ParallelConfig(dp_shard=2, cp=2, ep=4, zero_stage=2, num_microbatches=2)),
    # FSDP over the cp ranks alone (dp_shard 1, zero 3): torchtitan's FSDP 1 x CP 8
    "cp_fsdp_over_cp": (_spec("llama-small", {"preset": "cpu-local", "gpus_per_node": 8}, 8, 4, "fp32"),
                        ParallelConfig(cp=8, zero_stage=3, num_microbatches=4)),
}  # fmt: skip
# Layouts beyond the golden cases: more than 2 virtual stages per rank (pipeline_parallel_layers_per_stage)
# and an uneven layer split; and the Llama presets.
MORE_TORCHTITAN = {
    "virtual3": (_spec({"preset": "gpt-tiny", "num_layers": 12}, "h100-80gb", 4, 8, "bf16"),
                 ParallelConfig(pp=2, dp_shard=2, zero_stage=2, num_microbatches=4,
                                pp_schedule="interleaved_1f1b", virtual_stages=3)),
    "uneven": (_spec({"preset": "gpt-tiny", "num_layers": 5}, "h100-80gb", 8, 8, "bf16"),
               ParallelConfig(pp=2, dp_replicate=4, num_microbatches=2)),
    # a V schedule: torchtitan places its two stages a rank in a V itself (the class's style)
    "zbv": (_spec({"preset": "gpt-tiny", "num_layers": 8}, "h100-80gb", 4, 8, "bf16"),
            ParallelConfig(pp=2, dp_shard=2, zero_stage=2, num_microbatches=4, pp_schedule="zbv", virtual_stages=2)),
    **MORE_LLAMA,
    **MORE_MOE,
    **CP_CASES,
}  # fmt: skip


# torchtitan's own llama3 flavors (models/llama3/__init__.py) -> (the preset of the same model, the case
# that exports it).
TORCHTITAN_FLAVORS = {"1B": ("llama3.2-1b", "llama1b_tied"), "3B": ("llama3.2-3b", "llama3b_tied"),
                      "8B": ("llama3.1-8b", "llama8b_h100"), "70B": ("llama3.1-70b", "llama70b"),
                      "405B": ("llama3.1-405b", "llama405b")}  # fmt: skip


def _torchtitan_flavor(flavor: str, m: ModelConfig) -> str:
    """A config module that selects torchtitan's own llama3 `flavor`, at the preset's sequence length."""
    return (
        "from torchtitan.models.llama3 import model_registry\n"
        "from torchtitan.models.llama3.config_registry import llama3_debugmodel\n\n\n"
        "def tuned_layout():\n"
        "    config = llama3_debugmodel()\n"
        f'    config.model_spec = model_registry("{flavor}")\n'
        f"    config.loss.loss_fn.global_vocab_size = {m.vocab_size}\n"
        f"    config.training.seq_len = {m.seq_len}\n"
        "    return config\n"
    )


def _tied_with_pipeline(text: str) -> str:
    """A tied-head export edited to pp 2 (with CUDA graphs off, which pp needs), which the export
    itself refuses: to show torchtitan's own refusal."""
    one = "    config.parallelism.pipeline_parallel_degree = 1\n"
    assert one in text
    return text.replace(one, one.replace("1", "2") + "    config.training.disable_cuda_graphs = True\n")


def _cp_attention(text: str, backend: str) -> str:
    """The cp golden export edited to build its model with another attention backend than FlexAttention,
    which torchtitan's context parallelism refuses: to show its own refusal."""
    old = "config.model_spec = model_registry(FLAVOR)"
    assert old in text
    return text.replace(old, f'config.model_spec = model_registry(FLAVOR, attn_backend="{backend}")')


def _ep_over_replicas(text: str) -> str:
    """The CPU MoE export (dp_shard 4, ep 4) edited to dp_replicate 2 x dp_shard 2, which the export
    itself refuses (ep 4 does not divide dp_shard 2): to show torchtitan's own refusal."""
    for old, new in (("data_parallel_replicate_degree = 1", "data_parallel_replicate_degree = 2"),
                     ("data_parallel_shard_degree = 4", "data_parallel_shard_degree = 2")):  # fmt: skip
        assert old in text
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def torchtitan_parsed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """{name: what torchtitan parsed} for every golden torchtitan export, the MORE_TORCHTITAN
    layouts, `no_cuda_graphs_rule`: the pipeline golden without its disable_cuda_graphs line, and
    `tied_pipeline_rule`: a tied head with pp 2 (_tied_with_pipeline). One process (tests/tuner/torchtitan_parse.py) keeps torchtitan's imports out of this one."""
    folder = tmp_path_factory.mktemp("torchtitan")
    modules = {}
    for case, (spec, *_) in CASES.items():
        modules[case] = (
            (GOLDEN / f"export_torchtitan_{case}.txt").read_text(),
            spec.as_model_config().num_layers,
        )
    for name, (spec, config) in MORE_TORCHTITAN.items():
        modules[name] = (export_layout("torchtitan", spec, config), spec.as_model_config().num_layers)
    pipelined = modules["gpt13b_h100"][0]
    modules["no_cuda_graphs_rule"] = ("".join(line for line in pipelined.splitlines(keepends=True)
                                              if "disable_cuda_graphs" not in line), 24)  # fmt: skip
    modules["tied_pipeline_rule"] = (_tied_with_pipeline(modules["llama1b_tied"][0]), 16)
    modules["ep_replicate_rule"] = (_ep_over_replicas(modules["moe_tiny_ds"][0]), 4)
    for backend in ("varlen", "sdpa"):
        modules[f"cp_{backend}_rule"] = (_cp_attention(modules["llama8b_cp_h100"][0], backend), 32)
    modules["moe_balanced"] = (export_layout("torchtitan", MOE_BALANCED, MORE_MOE["moe_tiny_ds"][1]), 4)
    for flavor, (preset, _) in TORCHTITAN_FLAVORS.items():
        modules[f"flavor_{flavor}"] = (_torchtitan_flavor(flavor, MODEL_PRESETS[preset]), 1)
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
        "data_parallel_shard_degree": c.dp_shard, "context_parallel_degree": c.cp}  # fmt: skip
    assert par["enable_sequence_parallel"] is c.sequence_parallel
    assert par["expert_parallel_degree"] == c.ep
    # with cp > 1 torchtitan shards over dp_shard x cp even at zero_stage 0: 'never' is the nearest to replicas
    reshard = {0: "never" if c.cp > 1 else "default", 2: "never", 3: "always"}[c.zero_stage]
    assert par["fsdp_reshard_after_forward"] == reshard
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
                                                     "interleaved_1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble",
                                                     "dualpipev": "DualPipeV"}[c.pp_schedule]  # fmt: skip
        # torchtitan's own pipeline split gives every stage the layers our trainer gave it.
        ranges = stage_layer_ranges(spec.as_model_config().num_layers, c.num_stages)
        assert parsed["stage_layers"] == [list(r) for r in ranges]
    else:
        assert (parsed["gradient_accumulation_steps"], train["local_batch_size"]) == (c.num_microbatches,
                                                                                        c.micro_batch_size)  # fmt: skip
    # CUDA graphs refused with pipelines and with expert parallelism (test_torchtitan_refuses_..._cuda_graphs)
    assert train["disable_cuda_graphs"] is True  # as measured (and refused with pp > 1, ep > 1 anyway)


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


TORCHTITAN_CP_CASES = [case for case, (_, c) in TORCHTITAN_CASES.items() if c.cp > 1]


@pytest.mark.parametrize("case", TORCHTITAN_CP_CASES)
def test_torchtitan_splits_each_sequence_as_the_trainer_does(case: str, torchtitan_parsed: dict) -> None:
    """context_parallel_load_balancer 'headtail': torchtitan's own cp_shard gives cp rank r the positions
    our trainer gives it (chunks r and 2cp-1-r of 2 x cp), and its meshes and its check of the attention
    under cp (FlexAttention: distributed/full_dtensor.py validate_config) accept the export."""
    spec, c = TORCHTITAN_CASES[case]
    parsed = torchtitan_parsed[case]
    assert "error" not in parsed, parsed
    assert parsed["parallelism"]["context_parallel_load_balancer"] == "headtail"
    expected = [local_positions(spec.seq_len, c.cp, rank).tolist() for rank in range(c.cp)]
    assert parsed["cp_positions"] == expected


def test_torchtitan_context_parallelism_needs_flex_attention(torchtitan_parsed: dict) -> None:
    """What the export requires and says: torchtitan 0.3.0 runs cp with FlexAttention only. Its own
    refusals of the cp export built with varlen attention, and with SDPA (no longer a language-model
    backend)."""
    assert "Varlen attention is not supported with CP" in torchtitan_parsed["cp_varlen_rule"]["error"]
    assert "sdpa is no longer supported for language models" in torchtitan_parsed["cp_sdpa_rule"]["error"]
    spec, config, _ = CASES["llama8b_cp_h100"]
    notes = " ".join(export_layout("torchtitan", spec, config).split("\n#"))
    assert "cp requires FlexAttention in torchtitan 0.3.0" in notes
    layout_only = _spec({"preset": "gpt-tiny"}, "h100-80gb", 4, 4, "bf16")
    text = export_layout("torchtitan", layout_only, ParallelConfig(dp_replicate=2, cp=2, num_microbatches=2))
    assert "the model you put in BASE must use it" in text


def test_torchtitan_refuses_a_sequence_its_trainer_cannot_split() -> None:
    """torchtitan's Trainer.__init__ wants seq_len divisible by 2 x cp x tp under sequence parallelism;
    our trainer (and Megatron) only seq_len / cp divisible by tp: 12 tokens over cp 2 x tp 2 + SP."""
    spec = _spec({"preset": "llama-tiny"}, {"preset": "cpu-local", "gpus_per_node": 4}, 4, 2, "fp32",
                 {"seq_len": 12}, space={"tp": [1, 2]})  # fmt: skip
    layout = ParallelConfig(tp=2, cp=2, sequence_parallel=True, num_microbatches=2)
    assert export_layout("sbatch", spec, layout) and export_layout("megatron", spec, layout)
    with pytest.raises(ValueError, match=r"torchtitan: .*seq_len \(12\) is not a multiple of 2 x cp \(2\) x tp "
                                         r"\(2, sequence parallelism\) = 8"):  # fmt: skip
        export_layout("torchtitan", spec, layout)


def test_the_exports_say_cp_and_that_data_parallelism_spans_dp_x_cp() -> None:
    for fmt in FORMATS:
        header = [line for line in _export(fmt, "llama8b_cp_h100").splitlines() if line.startswith("#")]
        assert any(
            "16 ranks = tp 2 x pp 1 x dp_replicate 1 x dp_shard 2 x cp 4" in line for line in header
        ), fmt
        assert any("cp 4: each sequence of 32768 in 8 head-tail chunks of 4096" in line
                   and "data parallelism spans dp x cp (2 x 4 = 8 ranks" in line for line in header), fmt  # fmt: skip


def test_torchtitan_refuses_pipeline_parallelism_with_cuda_graphs(torchtitan_parsed: dict) -> None:
    """Why the export sets disable_cuda_graphs with pp > 1: torchtitan's own check."""
    error = torchtitan_parsed["no_cuda_graphs_rule"]["error"]
    assert "CUDA graphs do not support pipeline parallelism" in error


@pytest.mark.parametrize("case", TORCHTITAN_CASES)
def test_torchtitan_builds_the_studys_model(case: str, torchtitan_parsed: dict) -> None:
    """A Llama-family study's export selects a flavor of torchtitan's llama3 with the study's shape,
    and the model torchtitan builds from it (on the meta device, after its own checks of the model
    against the layout) has the parameters ModelConfig counts. A GPT study's export keeps the base's
    model (torchtitan has no GPT): the layout only."""
    spec, _ = TORCHTITAN_CASES[case]
    m, model = spec.as_model_config(), torchtitan_parsed[case]["model"]
    if m.moe:
        _check_moe_model(spec, model)
        return
    if m.family != "llama":
        assert (model["name"], model["flavor"]) == ("llama3", "debugmodel")
        return
    assert (model["name"], model["flavor"]) == ("llama3", slug(spec.name))
    rope = {"theta": m.rope_theta, "scaling": "none", "max_seq_len": m.seq_len}
    if m.rope_scaling_factor is not None:
        rope |= {"scaling": "llama", "scaling_factor": m.rope_scaling_factor, "low_freq_factor": m.rope_low_freq_factor,
                 "high_freq_factor": m.rope_high_freq_factor,
                 "original_max_position_embeddings": m.rope_original_max_positions}  # fmt: skip
    assert {k: model["rope"][k] for k in rope} == rope
    assert {k: model[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "vocab_size",
                                  "loss_vocab_size", "tied", "norm_eps", "qkv_bias")} == {
        "dim": m.hidden_size, "n_layers": m.num_layers, "n_heads": m.num_heads, "n_kv_heads": m.kv_heads,
        "hidden_dim": [m.ffn_size], "vocab_size": m.vocab_size, "loss_vocab_size": m.vocab_size,
        "tied": m.tie_embeddings, "norm_eps": [m.norm_eps], "qkv_bias": [m.qkv_bias]}  # fmt: skip
    assert model["num_params"] == m.num_params


def _check_moe_model(spec: StudySpec, model: dict) -> None:
    """A mixture of experts as a flavor of torchtitan's qwen3 (grouped-query attention) or
    deepseek_v3 (latent attention): every field the export sets, read back from torchtitan's config,
    and the parameters of the model it builds on the meta device are ModelConfig's."""
    m = spec.as_model_config()
    assert (model["name"], model["flavor"]) == (
        "deepseek_v3" if m.attention == "mla" else "qwen3",
        slug(spec.name),
    )
    expected = {
        "dim": m.hidden_size, "vocab_size": m.vocab_size, "loss_vocab_size": m.vocab_size, "n_layers": m.num_layers,
        "n_dense_layers": m.moe_dense_layers, "n_heads": m.num_heads,
        "dense_hidden_dim": [m.ffn_size] if m.moe_dense_layers else [], "num_experts": [m.num_experts],
        "moe_hidden_dim": [m.expert_ffn_size], "top_k": [m.moe_top_k],
        "router": {"score_func": m.moe_router_score, "route_norm": m.moe_norm_topk, "route_scale": m.moe_route_scale,
                   "num_expert_groups": m.moe_groups if m.moe_groups > 1 else None,
                   "num_limited_groups": m.moe_topk_groups if m.moe_groups > 1 else None},
        "load_balance_coeff": [balance_coeff(m)], "shared_hidden_dim": m.moe_shared_ffn_hidden_size,
        "tied": m.tie_embeddings, "norm_eps": [m.norm_eps], "num_params": m.num_params,
    }  # fmt: skip
    if m.attention == "mla":
        expected |= {"mla": {k: getattr(m, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                         "qk_rope_head_dim", "v_head_dim")},
                     "rope": {"theta": m.rope_theta, "scaling": "none"}}  # fmt: skip
    else:
        expected |= {"n_kv_heads": m.kv_heads, "head_dim": m.head_dim, "qk_norm": [m.qk_norm == "head"],
                     "rope": {"theta": m.rope_theta}}  # fmt: skip
    assert {k: model[k] for k in expected} == expected
    assert model["force_load_balance"] == [False]  # learned routing, as measured
    # balanced as the study balances: its expert bias, or torchtitan's in place of an auxiliary loss
    # (torchtitan has none); never unbalanced where the study balances
    assert model["load_balance_coeff"] != [None] or not (m.moe_bias_update_rate or m.moe_aux_loss_coef)


def test_torchtitan_forces_balanced_routing_where_the_study_measured_it(torchtitan_parsed: dict) -> None:
    """BenchmarkConfig.moe_routing 'balanced' -> debug.moe_force_load_balance, which torchtitan's
    decoder hands to every router (update_from_config); Megatron's --moe-router-force-load-balancing."""
    assert torchtitan_parsed["moe_balanced"]["model"]["force_load_balance"] == [True]
    spec, config = MORE_MOE["moe_tiny_ds"]
    assert "--moe-router-force-load-balancing" not in export_layout("megatron", spec, config)
    assert (
        "--moe-router-force-load-balancing"
        in _megatron_args(export_layout("megatron", MOE_BALANCED, config))[1]
    )


def test_token_drop_exports_to_megatron_and_is_refused_by_torchtitan() -> None:
    """training.moe_capacity_factor -> --moe-expert-capacity-factor with the trainer's drop policy
    (the lowest routing weights, unpadded); torchtitan's experts route dropless, so it refuses."""
    config = MORE_MOE["moe_tiny_ds"][1]
    text = export_layout("megatron", MOE_TOKEN_DROP, config)
    flags = _megatron_args(text)[1]
    assert (flags["--moe-expert-capacity-factor"], flags["--moe-token-drop-policy"]) == ("1", "probs")
    assert "token drop at capacity factor 1" in text
    assert (
        "--moe-expert-capacity-factor"
        not in _megatron_args(export_layout("megatron", MORE_MOE["moe_tiny_ds"][0], config))[1]
    )
    with pytest.raises(
        ValueError, match=r"moe_capacity_factor 1: torchtitan's mixture of experts routes dropless"
    ):
        export_layout("torchtitan", MOE_TOKEN_DROP, config)


def test_bf16_gradient_reduction_exports_to_megatron_and_is_refused_by_torchtitan() -> None:
    """training.grad_reduce_dtype bf16 -> Megatron's --grad-reduce-in-bf16 (its bf16 default reduces and
    accumulates in fp32); torchtitan 0.3.0's mixed_precision_reduce is Literal["float32"]."""
    spec, config = MORE_LLAMA["llama70b"]
    bf16 = spec.model_copy(
        update={"training": spec.training.model_copy(update={"grad_reduce_dtype": "bf16"})}
    )
    assert "--grad-reduce-in-bf16" in _megatron_args(export_layout("megatron", bf16, config))[1]
    assert "--grad-reduce-in-bf16" not in _megatron_args(export_layout("megatron", spec, config))[1]
    with pytest.raises(
        ValueError, match=r"grad_reduce_dtype bf16: torchtitan 0.3.0's training.mixed_precision_reduce"
    ):
        export_layout("torchtitan", bf16, config)


def test_torchtitan_refuses_expert_parallelism_over_replicas(torchtitan_parsed: dict) -> None:
    """torchtitan folds ep into dp_shard x cp x tp (its sparse mesh): with dp_replicate 2 x dp_shard 2
    and ep 4 its own mesh build fails, so the export refuses the layout; Megatron's expert grid
    (ep over all dp x tp ranks) and our trainer run it."""
    assert "mesh_sizes" in torchtitan_parsed["ep_replicate_rule"]["error"]
    spec, _ = MORE_MOE["moe_tiny_ds"]
    layout = ParallelConfig(dp_replicate=2, dp_shard=2, ep=4, zero_stage=2, num_microbatches=2)
    assert export_layout("sbatch", spec, layout) and export_layout("megatron", spec, layout)
    with pytest.raises(ValueError, match=r"torchtitan: .*ep \(4\) must divide data_parallel_shard x tensor_parallel "
                                         r"\(2 x 1 = 2\)"):  # fmt: skip
        export_layout("torchtitan", spec, layout)


def test_olmoe_is_refused_by_both_frameworks_with_the_reason() -> None:
    """OLMoE's q/k norms over the whole projections: neither Megatron's --qk-layernorm (per head)
    nor torchtitan's qwen3 builds them; our trainer does (sbatch)."""
    spec = _spec("olmoe-1b-7b", "h100-80gb", 8, 8, "bf16")
    layout = ParallelConfig(dp_shard=8, ep=8, zero_stage=2)
    assert export_layout("sbatch", spec, layout)
    with pytest.raises(ValueError, match=r"megatron: .*qk_norm 'proj' .*--qk-layernorm normalises each head"):
        export_layout("megatron", spec, layout)
    with pytest.raises(ValueError, match=r"torchtitan: .*qk_norm 'proj' .*torchtitan has no such flavor"):
        export_layout("torchtitan", spec, layout)


def test_megatron_refuses_a_router_it_cannot_express() -> None:
    """Megatron renormalises sigmoid scores always, and its expert bias takes sigmoid scores only."""
    base = {"preset": "moe-tiny-ds"}
    layout = ParallelConfig(dp_shard=4, ep=4, zero_stage=2, num_microbatches=2)
    for fields, reason in (({"moe_norm_topk": False}, "sigmoid router scores without renormalising"),
                           ({"moe_router_score": "softmax"}, "--moe-router-enable-expert-bias takes sigmoid")):  # fmt: skip
        spec = _spec(base | fields, {"preset": "cpu-local", "gpus_per_node": 4}, 4, 8, "fp32")
        assert export_layout("torchtitan", spec, layout)  # torchtitan's router takes both
        with pytest.raises(ValueError, match=r"megatron: .*" + reason):
            export_layout("megatron", spec, layout)


def test_a_dense_qwen3_block_is_flags_in_megatron_and_the_layout_only_in_torchtitan() -> None:
    """Wide heads and per-head q/k norms are --kv-channels and --qk-layernorm (Megatron's parse of
    them: test_megatrons_own_validate_args_parses_the_studys_model); torchtitan's llama3 has neither,
    so its export keeps the base's model and says so, as for a custom block."""
    spec, layout = QWEN3_DENSE
    _, flags = _megatron_args(export_layout("megatron", spec, layout))
    assert (flags["--kv-channels"], flags["--qk-layernorm"]) == ("32", None)
    titan = export_layout("torchtitan", spec, layout)
    assert "model_registry" not in titan and "torchtitan's llama3 has no q/k norms nor heads wider" in titan
    assert "heads of 32; q/k norms per head" in titan


def test_megatron_moe_flags_say_the_model_and_the_expert_layout() -> None:
    """The experts, the router and the expert grid of each mixture-of-experts export, flag by flag."""
    _, qwen = _megatron_args(_megatron_export("qwen3moe_h100"))
    expected = {"--num-experts": "128", "--moe-router-topk": "8", "--moe-ffn-hidden-size": "768",
                "--kv-channels": "128", "--qk-layernorm": None, "--moe-router-score-function": "softmax",
                "--moe-router-load-balancing-type": "aux_loss",  # 0.001 x top-8 / 48 layers
                "--moe-aux-loss-coeff": "0.0001666666667",
                "--moe-grouped-gemm": None, "--moe-token-dispatcher-type": "alltoall",
                "--expert-model-parallel-size": "8", "--expert-tensor-parallel-size": "1",
                "--use-distributed-optimizer": None}  # fmt: skip
    assert {k: qwen.get(k, "<missing>") for k in expected} == expected
    assert not {"--moe-router-pre-softmax", "--moe-layer-freq", "--moe-router-enable-expert-bias"} & set(qwen)
    _, ds = _megatron_args(_megatron_export("deepseek_v3"))
    expected = {"--multi-latent-attention": None, "--q-lora-rank": "1536", "--kv-lora-rank": "512",
                "--qk-head-dim": "128", "--qk-pos-emb-head-dim": "64", "--v-head-dim": "128", "--rope-type": "rope",
                "--moe-shared-expert-intermediate-size": "2048", "--moe-layer-freq": "([0]*3+[1]*58)",
                "--moe-router-score-function": "sigmoid", "--moe-router-topk-scaling-factor": "2.5",
                "--moe-router-num-groups": "8", "--moe-router-group-topk": "4",
                "--moe-router-enable-expert-bias": None, "--moe-router-bias-update-rate": "0.001", "--moe-router-dtype": "fp32",
                "--expert-model-parallel-size": "32", "--use-distributed-optimizer": None}  # fmt: skip
    assert {k: ds.get(k, "<missing>") for k in expected} == expected
    assert "--use-torch-fsdp2" not in ds and "--group-query-attention" not in ds  # FSDP2 refuses ep > 1
    olmoe_like = _spec({"preset": "moe-tiny", "moe_norm_topk": False}, "h100-80gb", 2, 2, "bf16")
    assert "--moe-router-pre-softmax" in export_layout("megatron", olmoe_like, ParallelConfig(dp_shard=2, ep=2,
                                                                                              zero_stage=2))  # fmt: skip


@pytest.mark.parametrize("flavor", TORCHTITAN_FLAVORS)
def test_the_llama_3_exports_are_torchtitans_own_flavors(flavor: str, torchtitan_parsed: dict) -> None:
    """The export of a Llama 3.x preset is the model of torchtitan's flavor of that name, field for
    field and parameter for parameter, except RoPE's context (the flavors' 131072, which torchtitan
    cuts to the training length; the export writes the study's) and, for 1B and 3B, the RoPE scaling
    factor: torchtitan's flavors leave it at its default 8, Llama 3.2's config.json has 32."""
    preset, case = TORCHTITAN_FLAVORS[flavor]
    ours, theirs = torchtitan_parsed[case]["model"], torchtitan_parsed[f"flavor_{flavor}"]["model"]
    assert (theirs["flavor"], theirs["rope"]["max_seq_len"], ours["rope"]["max_seq_len"]) == (
        flavor,
        131072,
        8192,
    )
    differ = {k for k in ours if ours[k] != theirs[k]} | {f"rope.{k}" for k in ours["rope"]
                                                          if ours["rope"][k] != theirs["rope"][k]}  # fmt: skip
    factor = {"rope.scaling_factor"} if MODEL_PRESETS[preset].rope_scaling_factor != 8.0 else set()
    assert differ == {"flavor", "rope", "rope.max_seq_len"} | factor
    assert theirs["rope"]["scaling_factor"] == 8.0


def test_the_llama_presets_are_all_exported_to_torchtitan() -> None:
    exported = {TORCHTITAN_CASES[case][0].model.preset for case in TORCHTITAN_CASES}
    assert {name for name, m in MODEL_PRESETS.items() if m.family == "llama" and not m.moe} <= exported


def test_torchtitan_refuses_a_tied_head_with_pipeline_parallelism(torchtitan_parsed: dict) -> None:
    """torchtitan's Decoder refuses weight tying with pp > 1, so the export refuses the layout
    (our trainer runs it: sbatch)."""
    assert (
        torchtitan_parsed["tied_pipeline_rule"]["error"]
        == "Weight tying is not supported with Pipeline Parallel."
    )
    spec, _ = MORE_LLAMA["llama1b_tied"]
    layout = ParallelConfig(tp=2, pp=2, dp_replicate=2, num_microbatches=4)
    assert export_layout("sbatch", spec, layout)
    with pytest.raises(ValueError, match=r"torchtitan: .*a head tied to the token embedding with pp 2: "
                                         "torchtitan refuses weight tying with pipeline parallelism"):  # fmt: skip
        export_layout("torchtitan", spec, layout)


def test_torchtitan_refuses_dropout_in_a_llama() -> None:
    spec = _spec({"preset": "llama-tiny", "dropout": 0.1}, "h100-80gb", 2, 2, "bf16", space={"tp": [1, 2]})
    config = ParallelConfig(dp_replicate=2)
    assert "--attention-dropout 0.1" in export_layout("megatron", spec, config)
    with pytest.raises(ValueError, match=r"torchtitan: .*dropout 0.1: torchtitan's Llama 3 has no dropout"):
        export_layout("torchtitan", spec, config)


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


# Every golden case, the other Llama presets (MORE_LLAMA), the mixtures of experts and the cp layouts.
# A dense Qwen3-shaped block: heads of 32 on a 64-wide stream (4 x 32 = 128) and per-head q/k norms.
QWEN3_DENSE = (_spec({"preset": "llama-tiny", "qk_norm": "head", "attention_head_dim": 32}, "h100-80gb", 4, 8, "bf16",
                     space={"tp": [1, 2]}),
               ParallelConfig(tp=2, dp_shard=2, num_microbatches=4, zero_stage=2, sequence_parallel=True))  # fmt: skip
MEGATRON_CASES = {
    **{case: CASES[case][:2] for case in CASES},
    **MORE_LLAMA,
    **MORE_MOE,
    **CP_CASES,
    # layers not a multiple of the stages: --pipeline-model-parallel-layout (1F1B, interleaved, and
    # DeepSeek-V3's 61 layers over 8 stages)
    "uneven": MORE_TORCHTITAN["uneven"],
    "uneven_interleaved": (
        _spec({"preset": "gpt-tiny", "num_layers": 7}, "h100-80gb", 4, 8, "bf16"),
        ParallelConfig(
            pp=2,
            dp_shard=2,
            zero_stage=2,
            num_microbatches=4,
            pp_schedule="interleaved_1f1b",
            virtual_stages=2,
        ),
    ),
    "deepseek_v3_pp8": (
        _spec("deepseek-v3", {"preset": "h100-80gb", "num_nodes": 4}, 32, 32, "bf16"),
        ParallelConfig(
            pp=8, dp_shard=4, ep=4, zero_stage=2, num_microbatches=8, activation_checkpoint="full"
        ),
    ),
    "qwen3_dense": QWEN3_DENSE,
    "moe_token_drop": (MOE_TOKEN_DROP, MORE_MOE["moe_tiny_ds"][1]),
    # latent attention's up-projections recomputed with the experts' activation (Megatron's
    # --recompute-modules mla_up_proj moe_act) through validate_args
    "deepseek_mla_up_proj": (
        MORE_MOE["deepseek_v3"][0],
        dataclasses.replace(MORE_MOE["deepseek_v3"][1], activation_checkpoint="mla_up_proj+moe_act"),
    ),
    # bf16 gradient reduction (training.grad_reduce_dtype): --grad-reduce-in-bf16 through validate_args
    "llama70b_bf16_grads": (
        MORE_LLAMA["llama70b"][0].model_copy(
            update={
                "training": MORE_LLAMA["llama70b"][0].training.model_copy(
                    update={"grad_reduce_dtype": "bf16"}
                )
            }
        ),
        MORE_LLAMA["llama70b"][1],
    ),
}


def _megatron_export(case: str) -> str:
    if case in CASES:
        return (GOLDEN / f"export_megatron_{case}.txt").read_text()
    return export_layout("megatron", *MEGATRON_CASES[case])


@pytest.mark.parametrize("case", MEGATRON_CASES)
def test_megatron_export_uses_only_flags_of_megatrons_parser(case: str) -> None:
    header, known = _megatron_flags()
    assert header.startswith(f"# {MEGATRON_SOURCE.split(',')[0]}:")
    _, flags = _megatron_args(_megatron_export(case))
    assert set(flags) <= known, set(flags) - known


def _megatron_expected(m: ModelConfig) -> dict:
    """The study's model in the names of Megatron-LM's arguments (after validate_args)."""
    rope = m.positions == "rope"
    return {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_heads,
        "num_query_groups": m.kv_heads, "kv_channels": m.head_dim, "ffn_hidden_size": m.ffn_size,
        "seq_length": m.seq_len, "normalization": "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm",
        "layernorm_epsilon": m.norm_eps, "swiglu": m.mlp == "swiglu",
        "position_embedding_type": "rope" if rope else "learned_absolute",
        "rotary_base": int(m.rope_theta) if rope else 10000, "use_rope_scaling": m.rope_scaling_factor is not None,
        "rope_scaling_factor": m.rope_scaling_factor or 8.0,
        "untie_embeddings_and_output_weights": not m.tie_embeddings, "add_bias_linear": False,
        "add_qkv_bias": m.qkv_bias, "attention_dropout": m.dropout, "hidden_dropout": m.dropout,
    }  # fmt: skip


def _megatron_model(flags: dict[str, str | None]) -> dict:
    """The model the flags describe, Megatron's parser's defaults filling the rest (megatron-core
    0.19.2, megatron/training/arguments.py and TransformerConfig: learned absolute positions, LayerNorm
    eps 1e-5, GELU, multi-head attention (no --group-query-attention: one query group per head),
    kv channels hidden / heads, a tied head, linear biases, rotary base 10000, scaling factor 8)."""
    heads, hidden = int(flags["--num-attention-heads"]), int(flags["--hidden-size"])
    return {
        "num_layers": int(flags["--num-layers"]), "hidden_size": hidden, "num_attention_heads": heads,
        "num_query_groups": int(flags["--num-query-groups"]) if "--group-query-attention" in flags else heads,
        "kv_channels": int(flags.get("--kv-channels") or hidden // heads),
        "ffn_hidden_size": int(flags["--ffn-hidden-size"]), "seq_length": int(flags["--seq-length"]),
        "normalization": flags.get("--normalization", "LayerNorm"),
        "layernorm_epsilon": float(flags.get("--norm-epsilon") or 1e-5), "swiglu": "--swiglu" in flags,
        "position_embedding_type": flags.get("--position-embedding-type", "learned_absolute"),
        "rotary_base": int(flags.get("--rotary-base") or 10000), "use_rope_scaling": "--use-rope-scaling" in flags,
        "rope_scaling_factor": float(flags.get("--rope-scaling-factor") or 8.0),
        "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights" in flags,
        "add_bias_linear": "--disable-bias-linear" not in flags,
        "add_qkv_bias": "--add-qkv-bias" in flags or "--disable-bias-linear" not in flags,
        "attention_dropout": float(flags["--attention-dropout"]), "hidden_dropout": float(flags["--hidden-dropout"]),
    }  # fmt: skip


@pytest.mark.parametrize("case", MEGATRON_CASES)
def test_megatron_flags_describe_the_studys_model(case: str) -> None:
    """GQA as query groups, the FFN width, SwiGLU, RMSNorm and its eps, RoPE's base and Llama 3.1
    scaling, the head untied or not, q/k/v bias: what the flags say, over Megatron's defaults, is the
    study's model (a GPT study's flags are the ones it had)."""
    spec, _ = MEGATRON_CASES[case]
    assert _megatron_model(_megatron_args(_megatron_export(case))[1]) == _megatron_expected(
        spec.as_model_config()
    )


MEGATRON_WHEEL = "megatron-core==0.19.2"  # the first release with megatron/training; it needs Python 3.12


@pytest.fixture(scope="session")
def megatron_src(tmp_path_factory) -> str:
    """megatron-core 0.19.2 unpacked (MEGATRON_SRC, or downloaded from PyPI into the test's temp dir):
    no package for Python 3.11 ships megatron/training, so the wheel for 3.12 is unpacked, not
    installed (scripts/check-megatron-export.py). 2.4 MB; CI reaches PyPI."""
    if os.environ.get("MEGATRON_SRC"):
        return os.environ["MEGATRON_SRC"]
    import zipfile

    where = tmp_path_factory.mktemp("megatron")
    run = subprocess.run([sys.executable, "-m", "pip", "download", MEGATRON_WHEEL, "--no-deps", "--python-version",
                          "3.12", "--only-binary=:all:", "--quiet", "-d", str(where)], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    wheels = list(where.glob("megatron_core-*.whl"))
    assert run.returncode == 0 and wheels, f"cannot download {MEGATRON_WHEEL} from PyPI: {run.stderr[-2000:]}"
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(where / "src")
    return str(where / "src")


def test_megatrons_own_validate_args_parses_the_studys_model(tmp_path: Path, megatron_src: str) -> None:
    """Megatron-LM's parse_args + validate_args accept every export (MEGATRON_CASES) and describe the
    study's model and layout with their arguments (megatron-core 0.19.2's megatron/training)."""
    paths = {}
    for case in MEGATRON_CASES:
        paths[case] = tmp_path / f"{case}.txt"
        paths[case].write_text(_megatron_export(case))
    script = ROOT / "scripts" / "check-megatron-export.py"
    run = subprocess.run([sys.executable, str(script), "--json", *map(str, paths.values())], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": megatron_src})  # fmt: skip
    parsed = json.loads(run.stdout.splitlines()[-1]) if run.stdout else {}
    assert run.returncode == 0 and parsed, (run.stderr[-3000:], parsed)
    for case, (spec, config) in MEGATRON_CASES.items():
        args = parsed[str(paths[case])]
        if not args["group_query_attention"]:  # TransformerConfig: one group per head
            args["num_query_groups"] = args["num_attention_heads"]
        expected = _megatron_expected(spec.as_model_config())
        assert {k: args[k] for k in expected} == expected, case
        drop = spec.training.moe_capacity_factor  # token drop as the trainer drops: by weight, unpadded
        assert (args["moe_expert_capacity_factor"], args["moe_token_drop_policy"],
                args["moe_pad_expert_input_to_capacity"]) == (drop, "probs", False), case  # fmt: skip
        assert (args["max_position_embeddings"], args["rotary_percent"], args["rotary_interleaved"]) == (
            spec.seq_len, 1.0, False)  # fmt: skip
        assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"],
                args["data_parallel_size"]) == (config.tp, config.pp, config.dp)  # fmt: skip
        assert args["context_parallel_size"] == config.cp, case
        # the layers of each stage: an uneven split as our trainer's, written as Megatron's layout
        uneven = config.pp > 1 and spec.as_model_config().num_layers % config.num_stages
        ranges = stage_layer_ranges(spec.as_model_config().num_layers, config.num_stages)
        assert args["decoder_layers_by_stage"] == ([len(r) for r in ranges] if uneven else None), case
        assert args["virtual_pipeline_model_parallel_size"] == (
            config.virtual_stages if config.pp > 1 and config.virtual_stages > 1 else None), case  # fmt: skip
        if config.cp > 1:  # the K/V all-gather our trainer measured, as TransformerConfig holds it
            assert args["cp_comm_type"] == "all_gather", case
        assert args == args | _megatron_moe_expected(spec.as_model_config(), config), case


def _megatron_moe_expected(m: ModelConfig, config: ParallelConfig) -> dict:
    """The experts, router and attention variants in the names of Megatron's TransformerConfig."""
    out = {
        "qk_layernorm": m.qk_norm == "head" or m.attention == "mla",
        "multi_latent_attention": m.attention == "mla",
    }
    if m.attention == "mla":
        out |= {"q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_head_dim": m.qk_nope_head_dim,
                "qk_pos_emb_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "rope_type": "rope"}  # fmt: skip
    if not m.moe:
        return out | {"num_moe_experts": None, "expert_model_parallel_size": 1}
    return out | {
        "num_moe_experts": m.num_experts, "moe_router_topk": m.moe_top_k, "moe_ffn_hidden_size": m.expert_ffn_size,
        "moe_shared_expert_intermediate_size": m.moe_shared_ffn_hidden_size or None,
        "moe_layer_freq": [0] * m.moe_dense_layers + [1] * m.num_moe_layers if m.moe_dense_layers else 1,
        "moe_router_score_function": m.moe_router_score,
        "moe_router_pre_softmax": m.moe_router_score == "softmax" and not m.moe_norm_topk,
        "moe_router_topk_scaling_factor": m.moe_route_scale if m.moe_route_scale != 1 else None,
        "moe_router_num_groups": m.moe_groups if m.moe_groups > 1 else None,
        "moe_router_group_topk": m.moe_topk_groups if m.moe_groups > 1 else None,
        "moe_router_enable_expert_bias": m.moe_bias_update_rate > 0,
        "moe_router_dtype": "fp32" if m.moe_router_fp32 else None,
        # the batch form: Megatron's per-layer aux_loss is transformers' / top-k, summed over layers
        "moe_router_load_balancing_type": ("none" if not m.moe_aux_loss_coef else
                                           "seq_aux_loss" if m.moe_aux_loss == "sequence" else "aux_loss"),
        "moe_aux_loss_coeff": pytest.approx(m.moe_aux_loss_coef * (
            1 if m.moe_aux_loss == "sequence" else m.moe_top_k / m.num_moe_layers), rel=1e-9),
        "moe_router_force_load_balancing": False,
        "moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall",
        "expert_model_parallel_size": config.ep, "expert_tensor_parallel_size": 1,
    }  # fmt: skip


def test_megatrons_transformer_config_refuses_a_router_it_cannot_run(
    tmp_path: Path, megatron_src: str
) -> None:
    """scripts/check-megatron-export.py builds Megatron's TransformerConfig, not only its arguments:
    the DeepSeek-shaped CPU export with softmax scores instead of sigmoid is refused there (the
    expert bias takes sigmoid scores), which is why the export refuses that router itself."""
    spec, config = MORE_MOE["moe_tiny_ds"]
    text = export_layout("megatron", spec, config)
    assert "--moe-router-score-function sigmoid" in text
    (tmp_path / "softmax.txt").write_text(text.replace("--moe-router-score-function sigmoid",
                                                      "--moe-router-score-function softmax"))  # fmt: skip
    script = ROOT / "scripts" / "check-megatron-export.py"
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "softmax.txt")], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": megatron_src})  # fmt: skip
    assert run.returncode == 1 and "Expert bias for aux-loss-free routing only supports" in run.stdout, (
        run.stdout
    )


def _connections(launcher: list[str]) -> str | None:
    """CUDA_DEVICE_MAX_CONNECTIONS as the exported command sets it: a value, "unset", or None
    when the command leaves the caller's environment as it is."""
    if launcher[:3] == ["env", "-u", "CUDA_DEVICE_MAX_CONNECTIONS"]:
        return "unset"
    prefix = "CUDA_DEVICE_MAX_CONNECTIONS="
    return next((word.removeprefix(prefix) for word in launcher if word.startswith(prefix)), None)


@pytest.mark.parametrize("case", MEGATRON_CASES)
def test_megatron_export_passes_validate_args_rules(case: str) -> None:
    """The rules of Megatron's validate_args (megatron-core 0.19.2, megatron/training/arguments.py)
    that these layouts meet; scripts/check-megatron-export.py runs the real one (docs/exports.md)."""
    launcher, flags = _megatron_args(_megatron_export(case))
    connections = _connections(launcher)
    tp, pp = int(flags["--tensor-model-parallel-size"]), int(flags["--pipeline-model-parallel-size"])
    cp = int(flags.get("--context-parallel-size") or 1)
    if "--use-torch-fsdp2" in flags:
        assert connections == "unset" or ((connections or "").isdigit() and int(connections) > 1)
        assert pp == 1 and "--use-distributed-optimizer" not in flags and "--fp16" not in flags
        assert {"--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights"} <= set(flags)
    elif "--use-megatron-fsdp" in flags:  # Megatron-FSDP: its distributed optimizer, its checkpoint format
        assert connections == "unset" or ((connections or "").isdigit() and int(connections) > 1)
        assert "--use-distributed-optimizer" in flags and flags["--ckpt-format"] == "fsdp_dtensor"
        assert flags["--data-parallel-sharding-strategy"] == "optim_grads_params"
    elif tp > 1 or cp > 1:  # before Blackwell (every GPU the presets name)
        assert connections == "1"
    else:
        assert connections is None
    if "--num-layers-per-virtual-pipeline-stage" in flags:
        per_rank, rest = divmod(int(flags["--num-layers"]), pp)
        assert rest == 0 and per_rank % int(flags["--num-layers-per-virtual-pipeline-stage"]) == 0
        assert pp > 2 or "--no-overlap-p2p-communication" not in flags
    if "--sequence-parallel" in flags:
        assert tp > 1
    if cp > 1:
        assert int(flags["--seq-length"]) % (2 * cp) == 0 and flags["--cp-comm-type"] == "all_gather"


def test_megatron_zero3_with_experts_is_megatron_fsdp() -> None:
    """ZeRO-3 with ep > 1 shards the parameters in Megatron too: Megatron-FSDP (optim_grads_params),
    not the distributed optimizer, which keeps every parameter whole (DeepSeek-V3 at tp 2, ep 32:
    about 184 GiB of weights a GPU); megatron-core 0.19.2's validate_args takes it
    (test_megatrons_own_validate_args_parses_the_studys_model, MEGATRON_CASES "deepseek_v3")."""
    text = _megatron_export("deepseek_v3")
    launcher, flags = _megatron_args(text)
    assert launcher[:2] == ["env", "-u"] and launcher[2] == "CUDA_DEVICE_MAX_CONNECTIONS"
    assert "--use-megatron-fsdp" in flags and "--use-torch-fsdp2" not in flags
    assert "zero_stage 3 with ep > 1 -> --use-megatron-fsdp" in text
    assert "parameters are not sharded" not in text
    spec, config = MEGATRON_CASES["deepseek_v3"]
    pp2 = dataclasses.replace(config, pp=2, dp_shard=16, ep=16, num_microbatches=2)  # pipelined: said
    assert not pp2.problems(spec.as_model_config())
    text = export_layout("megatron", spec, pp2)
    assert "--use-megatron-fsdp" not in _megatron_args(text)[1] and "parameters are not sharded" in text


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


def test_megatron_context_parallel_layouts() -> None:
    """--context-parallel-size and the K/V all-gather; CUDA_DEVICE_MAX_CONNECTIONS=1 with cp alone too
    (validate_args), and Megatron's data-parallel size without cp, its gradients over dp x cp."""
    launcher, flags = _megatron_args(_export("megatron", "llama8b_cp_h100"))
    assert launcher[0] == "CUDA_DEVICE_MAX_CONNECTIONS=1"
    assert (flags["--context-parallel-size"], flags["--cp-comm-type"], flags["--seq-length"]) == (
        "4",
        "all_gather",
        "32768",
    )
    spec, config = CP_CASES["moe_cp"]
    text = export_layout("megatron", spec, config)
    launcher, flags = _megatron_args(text)
    assert launcher[0] == "CUDA_DEVICE_MAX_CONNECTIONS=1" and flags["--tensor-model-parallel-size"] == "1"
    assert "context parallelism requires it on GPUs before Blackwell" in text
    assert "Megatron's data-parallel size is 2 (world / (tp x pp x cp))" in text
    assert "ep 4 x etp 1 over the dp x cp x tp ranks of each stage" in text


def test_megatron_refuses_latent_attention_it_cannot_gather() -> None:
    """Transformer Engine's all_gather context parallelism refuses k and v heads of different widths
    (DeepSeek-V3: 128 + 64 rotary for k, 128 for v); torchtitan's deepseek_v3 runs it, as our trainer."""
    spec = _spec("deepseek-v3", {"preset": "h100-80gb", "num_nodes": 8}, 64, 16, "bf16")
    layout = ParallelConfig(tp=2, dp_shard=16, cp=2, ep=32, zero_stage=3, sequence_parallel=True,
                            activation_checkpoint="full")  # fmt: skip
    assert "context_parallel_degree = 2" in export_layout("torchtitan", spec, layout)
    with pytest.raises(ValueError, match=r"megatron: .*k heads of 192, v heads of 128\): Transformer Engine's "
                                         r"--cp-comm-type all_gather"):  # fmt: skip
        export_layout("megatron", spec, layout)


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


def test_megatron_refuses_rope_it_cannot_express() -> None:
    """Megatron's Llama 3.1 RoPE scaling takes only the factor (the frequency factors and the
    original context are fixed at Llama 3.1's 1, 4 and 8192), and its rotary base is an integer;
    torchtitan's RoPE config takes every field."""
    scaled = {"preset": "llama-tiny", "rope_scaling_factor": 8.0, "rope_low_freq_factor": 2.0,
              "rope_original_max_positions": 4096}  # fmt: skip
    for model, reasons in (
        (scaled, r"rope_low_freq_factor 2: Megatron-LM's Llama 3.1 RoPE scaling fixes it at 1 .*; "
                 r"rope_original_max_positions 4096: .* fixes it at 8192"),
        ({"preset": "llama-tiny", "rope_theta": 10000.5}, r"rope_theta 10000.5: Megatron-LM's --rotary-base is an integer"),
    ):  # fmt: skip
        spec = _spec(model, "h100-80gb", 2, 2, "bf16", space={"tp": [1, 2]})
        assert export_layout("torchtitan", spec, ParallelConfig(dp_replicate=2))
        with pytest.raises(ValueError, match=r"megatron: cannot express layout .*: " + reasons):
            export_layout("megatron", spec, ParallelConfig(dp_replicate=2))


def test_a_custom_block_exports_flag_by_flag_to_megatron_and_as_a_layout_to_torchtitan() -> None:
    """A mix of the families' parts (here GPT with RMSNorm) is neither GPT nor Llama: Megatron-LM
    writes each part as a flag; torchtitan has no such model, so its export keeps the base's model,
    as for GPT, and says so."""
    spec = _spec({"preset": "gpt-tiny", "norm": "rmsnorm"}, "h100-80gb", 2, 2, "bf16")
    megatron = export_layout("megatron", spec, ParallelConfig(dp_replicate=2))
    assert _megatron_model(_megatron_args(megatron)[1]) == _megatron_expected(spec.as_model_config())
    assert "--normalization RMSNorm" in megatron and "--swiglu" not in megatron and "rope" not in megatron
    titan = export_layout("torchtitan", spec, ParallelConfig(dp_replicate=2))
    assert (
        "(custom: learned positions, pre-RMSNorm eps 1e-05, GELU MLP, untied head, no linear biases)" in titan
    )
    assert "torchtitan has no model with this block" in titan and "model_registry" not in titan
    for fmt in FORMATS:
        assert "(GPT: " not in export_layout(fmt, spec, ParallelConfig(dp_replicate=2))


def test_megatron_keeps_fsdp2_for_untied_heads_only() -> None:
    """validate_args refuses --use-torch-fsdp2 with a tied head: ZeRO-3 of Llama 3.2 runs on the
    distributed optimizer, with a note (test_megatron_export_passes_validate_args_rules: the rest)."""
    _, flags = _megatron_args(_megatron_export("llama1b_tied"))
    assert "--use-distributed-optimizer" in flags and "--use-torch-fsdp2" not in flags
    assert "--untie-embeddings-and-output-weights" not in flags
    assert "zero_stage 3 with a tied head" in _megatron_export("llama1b_tied")
    assert "--use-torch-fsdp2" in _megatron_args(_megatron_export("qwen7b_a100"))[1]


def test_megatron_refuses_the_v_schedules() -> None:
    spec, config = MORE_TORCHTITAN["zbv"]
    assert export_layout("torchtitan", spec, config)
    with pytest.raises(ValueError, match=r"megatron: .*pp_schedule 'zbv': Megatron-LM's schedules are 1F1B"):
        export_layout("megatron", spec, config)


def test_megatron_writes_an_uneven_layer_split_as_its_layout() -> None:
    """Layers not a multiple of the stages: Megatron's --pipeline-model-parallel-layout with our
    trainer's split (earlier stages take the remainder), not a refusal; Megatron's own parser and
    TransformerConfig read it back stage by stage (MEGATRON_CASES "uneven", "uneven_interleaved",
    "deepseek_v3_pp8": test_megatrons_own_validate_args_parses_the_studys_model)."""
    spec, config = MORE_TORCHTITAN["uneven"]
    assert export_layout("torchtitan", spec, config)  # torchtitan splits unevenly (parsed above)
    flags = _megatron_args(export_layout("megatron", spec, config))[1]
    assert flags["--pipeline-model-parallel-layout"] == "Et*3|t*2L"
    spec, config = MEGATRON_CASES["uneven_interleaved"]
    flags = _megatron_args(export_layout("megatron", spec, config))[1]
    assert flags["--pipeline-model-parallel-layout"] == "Et*2|t*2|t*2|t*1L"
    assert "--num-layers-per-virtual-pipeline-stage" not in flags
    spec, config = MEGATRON_CASES["deepseek_v3_pp8"]
    flags = _megatron_args(export_layout("megatron", spec, config))[1]
    assert flags["--pipeline-model-parallel-layout"] == "Et*8|t*8|t*8|t*8|t*8|t*7|t*7|t*7L"


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
    assert (cfg.parallel, cfg.model) == (config, padded_model(spec.as_model_config(), config.tp))
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


def test_op_level_checkpointing_exports_torchtitans_policy_and_megatrons_nearest_modules(
    tmp_path: Path, megatron_src: str
) -> None:
    """activation_checkpoint op is torchtitan's SelectiveAC (its op-level policy); Megatron has none:
    the export asks for its nearest recompute modules (norms, the experts' activation), says so,
    and Megatron's own TransformerConfig accepts them (moe_act needs the grouped GEMM)."""
    spec, config = MORE_MOE["moe_tiny_ds"]
    op = dataclasses.replace(config, activation_checkpoint="op")
    assert "config.activation_checkpoint = SelectiveAC.Config()" in export_layout("torchtitan", spec, op)
    text = export_layout("megatron", spec, op)
    assert "--recompute-granularity selective" in text and "--recompute-modules layernorm moe_act" in text
    assert "has no Megatron equivalent" in text
    (tmp_path / "op.txt").write_text(text)
    script = ROOT / "scripts" / "check-megatron-export.py"
    run = subprocess.run([sys.executable, str(script), "--json", str(tmp_path / "op.txt")], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": megatron_src})  # fmt: skip
    parsed = json.loads(run.stdout.splitlines()[-1]) if run.stdout else {}
    assert run.returncode == 0 and parsed, (run.stderr[-3000:], run.stdout[-3000:])
    args = parsed[str(tmp_path / "op.txt")]
    moe_act = dataclasses.replace(config, activation_checkpoint="moe_act")  # the same module in both
    assert "--recompute-modules moe_act" in export_layout("megatron", spec, moe_act)
    assert "has no torchtitan equivalent" in export_layout("torchtitan", spec, moe_act)
    both = dataclasses.replace(config, activation_checkpoint="layernorm+moe_act")
    assert "--recompute-modules layernorm moe_act" in export_layout("megatron", spec, both)
    assert (args["recompute_granularity"], args["recompute_modules"]) == (
        "selective",
        ["layernorm", "moe_act"],
    )
