"""The torchtitan target (torchtitan 0.3.0): a config module. Since torchtitan 0.3.0 a run is a
Python function returning a `Trainer.Config`, named with `--module` and `--config`; the exported
function starts from torchtitan's llama3_debugmodel (data, tokenizer, optimizer: BASE), sets the
study's model on it where torchtitan builds it, and the measured layout.

Families (trainer/contract/families/): each registers the torchtitan model its dense models and its
mixtures of experts are flavors of (Family.torchtitan_dense, Family.torchtitan_moe):
- a dense model whose family registers llama3 (Llama 3.x, Qwen2): a flavor of torchtitan's llama3
  (models.py). Refused: dropout; a head tied to the embedding with pp > 1.
- a mixture of experts whose family registers qwen3 (Mixtral, Qwen3-MoE) or deepseek_v3: a flavor of
  it (moe.py). Refused: a family that registers none (gpt, custom), OLMoE's q/k norms over the
  whole projections (qk_norm 'proj'), dropout, a q/k/v bias, a tied head with pp > 1, a
  deepseek_v3 shared expert that is not whole experts.
- any other (no torchtitan model: gpt, custom; or not this block: q/k norms or wide heads, Qwen3;
  a dense latent-attention model): the layout only, the model named in a comment with the
  family's reason (Family.torchtitan_why).
Axes (ParallelConfig):
- tp, sequence parallelism, dp_replicate x dp_shard (FSDP2; zero_stage as
  fsdp_reshard_after_forward), activation checkpointing (none, full, selective): supported.
- pp (GPipe, 1F1B, Interleaved1F1B): supported; refused beyond 2 stages per rank where no
  pipeline_parallel_layers_per_stage gives the stage count.
- cp: context_parallel_degree, head-tail; refused unless seq_len is a multiple of 2 x cp (x tp with
  sequence parallelism).
- ep: expert_parallel_degree; refused unless ep divides dp_shard x cp x tp.
- tp_col (2D tensor parallelism): refused (tuner/exports/__init__.py).

Context parallelism (ParallelConfig.cp), read from torchtitan 0.3.0's source:
- `parallelism.context_parallel_degree` and `context_parallel_load_balancer` ("headtail", its
  default: torch's _HeadTailLoadBalancer gives rank r chunks r and 2cp-1-r, as ours; "ptrr" or
  None otherwise). The export sets both.
- Attention: language models run FlexAttention only ("sdpa is no longer supported for language
  models": models/common/config_utils.py), and with cp > 1 its default spmd_types backend refuses
  SDPA and varlen (distributed/full_dtensor.py: validate_config; llama3/qwen3 update_from_config
  refuse varlen too). K/V are all-gathered over cp at the attention's local_map boundary
  (models/common/decoder_sharding.py: set_gqa_inner_attention_local_map), as ours.
- FSDP always spans dp_shard x cp when cp > 1 (distributed/parallel_dims.py: "fsdp" mesh), even
  without dp_shard: a zero_stage 0 layout's weights are then sharded over cp.
- Trainer.__init__ (trainer.py) requires seq_len divisible by 2 x cp x (tp with sequence
  parallelism), stricter than our trainer's seq_len / cp divisible by tp.
- Expert parallelism borrows from dp_shard x cp x tp (moe.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from trainer.contract.families import family_of
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.cost.layer import recomputed_modules
from tuner.exports.common import capacity_factor, comments, header, launcher, routing
from tuner.exports.torchtitan.models import (
    torchtitan_builds,
    torchtitan_imports,
    torchtitan_model,
    torchtitan_notes,
    torchtitan_unsupported,
)
from tuner.exports.torchtitan.moe import torchtitan_moe_notes, torchtitan_moe_parallelism
from tuner.spec import StudySpec, padded_vocab, slug

if TYPE_CHECKING:
    from tuner.dispatch.sbatch import SiteSettings

# The release the export is written for and tested against (docs/exports.md).
TORCHTITAN_VERSION = "0.3.0"

# torch.distributed.pipelining schedule class names (torchtitan passes them to get_schedule_class).
# The V schedules: torchtitan places their two stages a rank in a V itself (the class's style).
TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
                        "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}  # fmt: skip
# zero_stage -> FSDP2 reshard_after_forward (trainer/parallelize.py: apply_fsdp). 0 has no FSDP.
TORCHTITAN_RESHARD = {0: "default", 2: "never", 3: "always"}
# activation_checkpoint -> (module to import from, the Trainer.Config value)
_AC_MODULE = "torchtitan.distributed.activation_checkpoint"
# (torchtitan's SelectiveAC is op-level: ours "op" is its policy, trainer/parallelize.py)
TORCHTITAN_AC = {"none": ("", "None"), "full": (_AC_MODULE, "FullAC.Config()"),
                 "selective": (_AC_MODULE, "SelectiveAC.Config()"), "op": (_AC_MODULE, "SelectiveAC.Config()"),
                 "moe_act": ("", "None"), "layernorm": ("", "None"), "layernorm+moe_act": ("", "None")}  # fmt: skip
TORCHTITAN_CONFIG_FN = "tuned_layout"
# What the export's base config (torchtitan's llama3_debugmodel) reads, relative to the working
# directory: files of a torchtitan source checkout that the package does not ship (tests/tuner/test_export.py
# reads them from torchtitan's own parse).
TORCHTITAN_BASE_TOKENIZER = "./tests/assets/tokenizer"
TORCHTITAN_BASE_DATASET = ("c4_test", "tests/assets/c4_test")
TORCHTITAN_CP_LOAD_BALANCER = "headtail"


def unsupported(spec: StudySpec, config: ParallelConfig) -> list[str]:
    """torchtitan derives the stage count from `pipeline_parallel_layers_per_stage` (ceil(layers /
    layers per stage)); beyond its default of 2 stages per rank some counts have no such value. Its
    mixture of experts has no token drop."""
    reasons = torchtitan_unsupported(spec.as_model_config(), config) + torchtitan_cp_unsupported(
        spec.as_model_config(), config
    )
    if config.activation_checkpoint == "offload":
        reasons.append(
            "activation_checkpoint 'offload': torchtitan 0.3.0 recomputes activations and offloads none "
            "to host memory; study full or op"
        )
    if spec.training.grad_reduce_dtype == "bf16":
        reasons.append(
            "training.grad_reduce_dtype bf16: torchtitan 0.3.0's training.mixed_precision_reduce accepts float32 "
            "only; export to Megatron-LM (--grad-reduce-in-bf16), or study it with fp32"
        )
    if (factor := capacity_factor(spec, config)) is not None:
        reasons.append(
            f"training.moe_capacity_factor {factor:g}: torchtitan's mixture of experts routes dropless (no capacity "
            "factor); export to Megatron-LM (--moe-expert-capacity-factor), or study it dropless"
        )
    if config.pp == 1 or config.virtual_stages <= 2:
        return reasons
    layers, stages = spec.as_model_config().num_layers, config.num_stages
    if math.ceil(layers / _layers_per_stage(layers, stages)) != stages:
        reasons.append(f"no pipeline_parallel_layers_per_stage splits {layers} layers into {stages} stages")
    return reasons


def _layers_per_stage(layers: int, stages: int) -> int:
    return math.ceil(layers / stages)


def render(spec: StudySpec, config: ParallelConfig, site: SiteSettings | None = None) -> str:
    """A torchtitan config module. Since torchtitan 0.3.0 a run is a Python function returning a
    `Trainer.Config`, named with `--module` and `--config` (TOML job files are gone, and its
    `--section.option` flags are frozen, kept only for old scripts). The function starts from a
    base config, which supplies the model, data and optimizer, and sets the layout on it."""
    c = config
    module = f"{slug(spec.name).replace('-', '_').replace('.', '_')}_layout"
    torchrun, multi_node = launcher(spec, config)
    dataset, dataset_path = TORCHTITAN_BASE_DATASET
    run = [
        f"save as {module}.py on PYTHONPATH, then run from the root of a torchtitan {TORCHTITAN_VERSION} "
        "source checkout:",
        f"  {torchrun} -m torchtitan.train --module {module} --config {TORCHTITAN_CONFIG_FN}",
        *multi_node,
        f"(BASE reads its tokenizer from {TORCHTITAN_BASE_TOKENIZER} and the {dataset} dataset from "
        f"{dataset_path}, relative to the working directory; the torchtitan package ships neither. With "
        "your own BASE, run it where its paths resolve.)",
    ]
    lines = comments([*header(spec, config, f"torchtitan {TORCHTITAN_VERSION} config"), *run, "",
                      *_torchtitan_notes(spec, config)])  # fmt: skip
    ac_module, ac_expr = TORCHTITAN_AC[c.activation_checkpoint]
    body = [
        *([f"from {ac_module} import {ac_expr.split('.')[0]}"] if ac_module else []),
        *(torchtitan_imports(spec.as_model_config()) if torchtitan_builds(spec.as_model_config()) else []),
        "from torchtitan.models.llama3.config_registry import llama3_debugmodel",
        "from torchtitan.trainer import Trainer",
        *_torchtitan_model(spec),
        "",
        "",
        f"def {TORCHTITAN_CONFIG_FN}() -> Trainer.Config:",
        *_torchtitan_config(spec),
        *[f"    config.parallelism.{line}" for line in _torchtitan_parallelism(spec, config)],
        *[f"    config.training.{line}" for line in _torchtitan_training(spec, config)],
        "    config.compile.enable_async_tensor_parallel = False  # measured without async TP",
        *(  # the experts' balanced routing: a mixture of experts only
            ["    config.debug.moe_force_load_balance = True  # balanced routing, as measured"]
            if spec.as_model_config().moe and routing(spec, config) == "balanced"
            else []
        ),
        f"    config.activation_checkpoint = {ac_expr}",
        "    return config",
    ]
    return "\n".join([*lines, "", *body]) + "\n"


def _torchtitan_model(spec: StudySpec) -> list[str]:
    """The lines between the imports and the config function: BASE, and for a model torchtitan
    builds (models.py) the model as a flavor of its torchtitan model; else why not (the family's
    Family.torchtitan_why)."""
    m = spec.as_model_config()
    if not torchtitan_builds(m):
        return [
            "",
            "# The model, data, tokenizer and optimizer: replace with your config function that builds the",
            f"# model above ({family_of(m).torchtitan_why}).",
            "# llama3_debugmodel's tokenizer and data are in torchtitan's source tree only (see the top).",
            "BASE = llama3_debugmodel",
        ]
    return torchtitan_model(m, slug(spec.name))


def _torchtitan_config(spec: StudySpec) -> list[str]:
    """The config function's first lines: BASE, with the study's model where torchtitan builds it."""
    m = spec.as_model_config()
    if not torchtitan_builds(m):
        return ['    """BASE with the measured layout."""', "    config = BASE()"]
    return [
        '    """BASE with the study\'s model and the measured layout."""',
        "    config = BASE()",
        "    config.model_spec = model_registry(FLAVOR)",
        f"    config.loss.loss_fn.global_vocab_size = {m.vocab_size}  # BASE's loss was sized for its own model",
    ]


def _torchtitan_parallelism(spec: StudySpec, config: ParallelConfig) -> list[str]:
    """`ParallelismConfig` fields. Pipeline stages: no extra weight for the embedding and the head
    (first/last_stage_less_layers 0), so torchtitan splits the layers as evenly as our trainer,
    earlier stages taking the remainder (trainer/pipeline.py: stage_layer_ranges)."""
    c = config
    lines = [
        f"data_parallel_replicate_degree = {c.dp_replicate}",
        f"data_parallel_shard_degree = {c.dp_shard}",
        f'fsdp_reshard_after_forward = "{torchtitan_cp_reshard(c, TORCHTITAN_RESHARD[c.zero_stage])}"',
        f"tensor_parallel_degree = {c.tp}",
        f"enable_sequence_parallel = {c.sequence_parallel}",
        *torchtitan_cp_parallelism(c),
        f"pipeline_parallel_degree = {c.pp}",
        *torchtitan_moe_parallelism(spec.as_model_config(), c),
    ]
    if c.pp == 1:
        return lines
    lines += [
        f'pipeline_parallel_schedule = "{TORCHTITAN_SCHEDULES[c.pp_schedule]}"',
        f"pipeline_parallel_microbatch_size = {c.micro_batch_size}",
        "pipeline_parallel_first_stage_less_layers = 0  # layers split evenly, as measured",
        "pipeline_parallel_last_stage_less_layers = 0",
    ]
    if c.virtual_stages > 2:  # torchtitan's default for a looped schedule is 2 stages per rank
        per_stage = _layers_per_stage(spec.as_model_config().num_layers, c.num_stages)
        lines.append(f"pipeline_parallel_layers_per_stage = {per_stage}  # {c.num_stages} stages")
    return lines


def _torchtitan_training(spec: StudySpec, config: ParallelConfig) -> list[str]:
    """`TrainingConfig` fields, counted in sequences. Per data-parallel rank torchtitan takes
    `local_batch_size` sequences and accumulates gradients up to `global_batch_size`; with pp > 1
    it splits the local batch into pipeline micro-batches of `pipeline_parallel_microbatch_size`.
    So with pp > 1 the local batch is all of a flush's micro-batches; with pp = 1 it is one
    micro-batch and num_microbatches becomes gradient accumulation."""
    c = config
    lines = [
        f"local_batch_size = {c.micro_batch_size * (c.num_microbatches if c.pp > 1 else 1)}",
        f"global_batch_size = {c.global_batch_size}",
        f"seq_len = {spec.as_model_config().seq_len}",
        f'mixed_precision_param = "{"float32" if spec.training.precision == "fp32" else "bfloat16"}"',
    ]
    # as measured (our trainer captures no CUDA graphs); torchtitan refuses them with pp > 1 anyway
    lines.append("disable_cuda_graphs = True")
    return lines


def _no_cuda_graphs(spec: StudySpec, config: ParallelConfig) -> bool:
    """Trainer.Config refuses CUDA graphs (its default) with pipeline parallelism, and with expert
    parallelism over its all-to-all token dispatcher (it synchronises with the CPU): the experts'
    dispatcher, a mixture of experts only."""
    return config.pp > 1 or (spec.as_model_config().moe and config.ep > 1)


def _torchtitan_notes(spec: StudySpec, config: ParallelConfig) -> list[str]:
    """What torchtitan runs differently from the measured layout."""
    c, notes = config, []
    if c.zero_stage:
        notes.append(
            f"zero_stage {c.zero_stage} -> fsdp_reshard_after_forward {TORCHTITAN_RESHARD[c.zero_stage]!r} "
            "(ZeRO-3 reshards after forward, ZeRO-2 keeps parameters gathered until backward; "
            "FSDP2 always shards optimizer state and gradients)."
        )
    elif c.cp == 1:  # with cp torchtitan shards anyway (torchtitan_cp_notes)
        notes.append("zero_stage 0: no sharding (data_parallel_shard_degree 1).")
    if c.tp > 1:
        notes.append("tp: logits stay vocab-sharded into the loss (torchtitan's loss parallel), as measured.")
    if not _no_cuda_graphs(spec, c):
        notes.append("disable_cuda_graphs: the layout was measured without CUDA graphs, which torchtitan "
                     "captures by default at pp = 1 (a speed-up our trainer did not measure).")  # fmt: skip
    if c.activation_checkpoint == "selective":
        notes.append(
            "selective: ours recomputes the attention core (Korthikanti et al. 2022); torchtitan's "
            "SelectiveAC saves matmul outputs (every second one) instead: similar, not the same memory "
            "(activation_checkpoint op is torchtitan's policy)."
        )
    if recomputed_modules(c):
        notes.append(
            f"{c.activation_checkpoint} (Megatron's --recompute-modules: the norms' outputs, the experts' "
            "activation, latent attention's up-projections) has no torchtitan equivalent: exported without checkpointing, which holds more "
            "than measured (or use SelectiveAC: activation_checkpoint op)."
        )
    if spec.training.precision == "fp16":
        notes.append("fp16 study: torchtitan's mixed precision is bfloat16 (the trainer measured bf16 too).")
    notes += torchtitan_cp_notes(spec.as_model_config(), c, builds=torchtitan_builds(spec.as_model_config()))
    notes += torchtitan_moe_notes(spec.as_model_config(), c, routing(spec, config))
    return notes + torchtitan_notes(
        spec.as_model_config(), padded_vocab(spec.as_model_config().vocab_size, c.tp)
    )


# --- context parallelism ---


def torchtitan_cp_unsupported(m: ModelConfig, config: ParallelConfig) -> list[str]:
    c = config
    if c.cp == 1:
        return []
    divisor = 2 * c.cp * (c.tp if c.sequence_parallel else 1)
    if m.seq_len % divisor:
        sp = f" x tp ({c.tp}, sequence parallelism)" if c.sequence_parallel else ""
        return [
            f"seq_len ({m.seq_len}) is not a multiple of 2 x cp ({c.cp}){sp} = {divisor}: torchtitan's trainer "
            "requires it (trainer.py: Trainer.__init__), our trainer only seq_len / cp divisible by tp"
        ]
    return []


def torchtitan_cp_parallelism(config: ParallelConfig) -> list[str]:
    lines = [f"context_parallel_degree = {config.cp}"]
    if config.cp > 1:
        lines.append(
            f'context_parallel_load_balancer = "{TORCHTITAN_CP_LOAD_BALANCER}"  # chunks r and 2cp-1-r, as measured'
        )
    return lines


def torchtitan_cp_reshard(config: ParallelConfig, measured: str) -> str:
    """fsdp_reshard_after_forward: torchtitan applies FSDP over dp_shard x cp whenever cp > 1; for a
    zero_stage 0 layout 'never' keeps the gathered weights through backward, the nearest to replicas."""
    return "never" if config.cp > 1 and config.zero_stage == 0 else measured


def torchtitan_cp_notes(m: ModelConfig, config: ParallelConfig, *, builds: bool) -> list[str]:
    c = config
    if c.cp == 1:
        return []
    notes = [
        f"cp {c.cp}: context_parallel_load_balancer {TORCHTITAN_CP_LOAD_BALANCER!r} gives rank r chunks r and "
        f"2cp-1-r of {2 * c.cp}, as measured; torchtitan all-gathers K/V over cp at the attention (FlexAttention), "
        "as our trainer does (SDPA with an explicit mask per chunk).",
        "cp requires FlexAttention in torchtitan 0.3.0 (attn_backend 'flex' or 'flex_flash'): with cp > 1 its "
        "spmd_types backend refuses SDPA and varlen, and SDPA is no longer a language-model backend"
        + ("." if builds else "; the model you put in BASE must use it."),
        f"data parallelism spans dp x cp: torchtitan's FSDP runs over dp_shard x cp ({c.dp_shard} x {c.cp}) and "
        f"its loss over dp x cp, as measured.",
    ]
    if c.zero_stage == 0:
        notes.append(
            f"zero_stage 0 with cp {c.cp}: torchtitan always shards over dp_shard x cp with cp > 1 (its fsdp mesh), "
            "so weights are sharded over cp where the trainer replicated them; fsdp_reshard_after_forward 'never' "
            "keeps them gathered from forward to backward."
        )
    return notes
