"""A study's best layout as a launch config for another stack: a torchtitan config module,
Megatron-LM `pretrain_gpt.py` arguments under torchrun, or an sbatch script that runs our own trainer.

Only the layout and the model travel (tuner/export_model.py: the model by family;
tuner/export_moe.py: attention variants and mixtures of experts; tuner/export_cp.py: context
parallelism, and what each stack requires for it): data,
tokenizer, optimizer and step counts belong to the run, not the layout. Where a stack has no
equivalent of a knob the file says so in a comment instead of silently changing what was measured;
where it cannot run the layout or build the model at all, export_layout refuses with the reason
(UNSUPPORTED). Names a user wrote (study, cluster) appear only as
slug(name), so no comment or shell line carries a user's text. Golden files: tests/tuner/golden/;
the tests parse them with torchtitan's own ConfigManager and check Megatron-LM's flags and
validate_args rules (docs/exports.md).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from trainer.contract.parallel import ParallelConfig
from trainer.contract.trial_dir import CONFIG_FILE, RESULT_FILE
from tuner.dispatch.sbatch import (
    SITE_OPTIONS,
    SiteSettings,
    SlurmResources,
    layout_resources,
    preamble,
    trainer_command,
)
from tuner.export_cp import (
    describe_cp,
    megatron_cp_args,
    megatron_cp_notes,
    megatron_cp_unsupported,
    torchtitan_cp_notes,
    torchtitan_cp_parallelism,
    torchtitan_cp_reshard,
    torchtitan_cp_unsupported,
)
from tuner.export_model import (
    describe,
    megatron_model_args,
    megatron_model_note,
    megatron_unsupported,
    torchtitan_builds,
    torchtitan_imports,
    torchtitan_model,
    torchtitan_notes,
    torchtitan_unsupported,
)
from tuner.export_moe import (
    megatron_moe_args,
    megatron_moe_notes,
    torchtitan_moe_notes,
    torchtitan_moe_parallelism,
)
from tuner.spec import SlurmSpec, StudySpec, benchmark_config, padded_vocab, slug

if TYPE_CHECKING:
    from tuner.settings import SlurmSettings

FORMATS = ("torchtitan", "megatron", "sbatch")
# The releases the exports are written for and tested against (docs/exports.md).
TORCHTITAN_VERSION = "0.3.0"
MEGATRON_SOURCE = "megatron-core 0.19.2, megatron/training/arguments.py"

# torch.distributed.pipelining schedule class names (torchtitan passes them to get_schedule_class).
TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
# zero_stage -> FSDP2 reshard_after_forward (trainer/parallelize.py: apply_fsdp). 0 has no FSDP.
TORCHTITAN_RESHARD = {0: "default", 2: "never", 3: "always"}
# activation_checkpoint -> (module to import from, the Trainer.Config value)
_AC_MODULE = "torchtitan.distributed.activation_checkpoint"
TORCHTITAN_AC = {"none": ("", "None"), "full": (_AC_MODULE, "FullAC.Config()"),
                 "selective": (_AC_MODULE, "SelectiveAC.Config()")}  # fmt: skip
TORCHTITAN_CONFIG_FN = "tuned_layout"
# What the export's base config (torchtitan's llama3_debugmodel) reads, relative to the working
# directory: files of a torchtitan source checkout that the package does not ship (tests/tuner/test_export.py
# reads them from torchtitan's own parse).
TORCHTITAN_BASE_TOKENIZER = "./tests/assets/tokenizer"
TORCHTITAN_BASE_DATASET = ("c4_test", "tests/assets/c4_test")
EXPORT_PYTHON = "python"  # the sbatch export's interpreter when the site names none: the job's PATH


def export_layout(
    fmt: str, spec: StudySpec, config: ParallelConfig, *, site: SiteSettings | None = None
) -> str:
    """The launch config for `config` in format `fmt` (one of FORMATS). `site` (sbatch only)
    supplies Slurm defaults, the job preamble and the python (export_site: the TUNER_SLURM_*
    settings); None: no site options, `python` from PATH.
    ValueError when the model cannot run the layout or the stack cannot express it."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {list(FORMATS)}")
    if config.tp_col > 1 and fmt != "sbatch":  # our own trainer runs it (trainer/tp2d.py)
        raise ValueError(
            f"{fmt}: cannot express layout {config.describe()}: tp_col {config.tp_col} is 2D tensor "
            "parallelism (AxoNN's column axis), which neither Megatron-LM nor torchtitan implements"
        )
    problems = config.problems(spec.gpt())
    if problems:
        raise ValueError(f"layout {config.describe()} cannot run the study's model: " + "; ".join(problems))
    reasons = UNSUPPORTED[fmt](spec, config)
    if reasons:
        raise ValueError(f"{fmt}: cannot express layout {config.describe()}: " + "; ".join(reasons))
    if fmt == "torchtitan":
        return _torchtitan(spec, config)
    if fmt == "megatron":
        return _megatron(spec, config)
    return _sbatch(spec, config, site or SiteSettings(python=EXPORT_PYTHON))


def export_site(slurm: SlurmSettings) -> SiteSettings:
    """The site an sbatch export is written for: the TUNER_SLURM_* settings, as trial jobs take them
    (what a spec sets wins), except that without TUNER_SLURM_PYTHON the job runs `python` from its
    PATH, not the path of this process's interpreter, which is a path on the exporting machine."""
    return slurm.site(default_python=EXPORT_PYTHON)


def _header(spec: StudySpec, config: ParallelConfig, tool: str) -> list[str]:
    """Comment lines (without '# ') shared by every format: which study, layout, model, batch."""
    m, c = spec.gpt(), config
    nodes, per_node = layout_resources(benchmark_config(spec, config), spec.cluster.gpus_per_node)
    folded = "dp x cp x tp" if c.cp > 1 else "dp x tp"
    lines = [
        f"{tool} for study {slug(spec.name)} (parallel-tuner, tuner/export.py): {c.describe()}",
        f"{c.world_size} ranks = tp {c.tp}"
        + (f" x tp_col {c.tp_col}" if c.tp_col > 1 else "")
        + f" x pp {c.pp} x dp_replicate {c.dp_replicate} x dp_shard "
        f"{c.dp_shard}"
        + (f" x cp {c.cp}" if c.cp > 1 else "")
        + (f" (ep {c.ep} folded into {folded}: expert data parallelism {c.edp})" if m.moe else "")
        + f", on {nodes} node(s) x {per_node} of cluster {slug(spec.cluster.name)}",
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads"
        + (f" ({m.kv_heads} KV heads)" if m.kv_heads != m.num_heads else "")
        + f", ffn {m.ffn_size}, vocab {m.vocab_size}, seq {m.seq_len} ({describe(m)})",
        f"batch: global {c.global_batch_size} = micro-batch {c.micro_batch_size} x {c.num_microbatches} "
        f"micro-batches x dp {c.dp}; precision {spec.training.precision}",
    ]
    return lines + ([describe_cp(m, c)] if c.cp > 1 else [])


def _comments(lines: list[str]) -> list[str]:
    return [f"# {line}" if line else "#" for line in lines]


# --- what each stack cannot run ---


def _torchtitan_unsupported(spec: StudySpec, config: ParallelConfig) -> list[str]:
    """torchtitan derives the stage count from `pipeline_parallel_layers_per_stage` (ceil(layers /
    layers per stage)); beyond its default of 2 stages per rank some counts have no such value."""
    reasons = torchtitan_unsupported(spec.gpt(), config) + torchtitan_cp_unsupported(spec.gpt(), config)
    if config.pp == 1 or config.virtual_stages <= 2:
        return reasons
    layers, stages = spec.gpt().num_layers, config.num_stages
    if math.ceil(layers / _layers_per_stage(layers, stages)) != stages:
        reasons.append(f"no pipeline_parallel_layers_per_stage splits {layers} layers into {stages} stages")
    return reasons


def _megatron_unsupported(spec: StudySpec, config: ParallelConfig) -> list[str]:
    layers, c = spec.gpt().num_layers, config
    reasons = megatron_unsupported(spec.gpt()) + megatron_cp_unsupported(spec.gpt(), config)
    if c.pp > 1 and layers % c.num_stages:
        reasons.append(
            f"num_layers ({layers}) is not a multiple of pp ({c.pp}) x virtual_stages ({c.virtual_stages}) "
            f"= {c.num_stages}: Megatron-LM splits layers evenly over stages"
        )
    if _interleaved(c) and c.num_microbatches < c.pp:
        # forward_backward_pipelining_with_interleaving raises ValueError unless the micro-batch group
        # lies in [pp, num_microbatches]: no --microbatch-group-size-per-virtual-pipeline-stage fits.
        reasons.append(
            f"num_microbatches ({c.num_microbatches}) < pp ({c.pp}): Megatron-LM's interleaved schedule runs "
            f"each virtual stage on groups of at least pp micro-batches (megatron/core/pipeline_parallel/"
            f"schedules.py); our trainer ran one round of {c.num_microbatches}"
        )
    return reasons


# format -> why that stack cannot run a layout our trainer measured (empty: it can). A layout knob
# a stack lacks is refused here with its reason, never exported as something else.
UNSUPPORTED: dict[str, Callable[[StudySpec, ParallelConfig], list[str]]] = {
    "torchtitan": _torchtitan_unsupported,
    "megatron": _megatron_unsupported,
    "sbatch": lambda spec, config: [],  # our own trainer ran it
}


# --- torchtitan ---


def _layers_per_stage(layers: int, stages: int) -> int:
    return math.ceil(layers / stages)


def _torchrun(spec: StudySpec, config: ParallelConfig) -> tuple[str, list[str]]:
    """(the torchrun launcher, a note for several nodes) on the study's nodes."""
    nodes, per_node = layout_resources(benchmark_config(spec, config), spec.cluster.gpus_per_node)
    note = [f"run this on each of the {nodes} nodes with --node-rank and --master-addr (or "
            "--rdzv-backend=c10d --rdzv-endpoint)."] if nodes > 1 else []  # fmt: skip
    return f"torchrun --nproc-per-node={per_node} --nnodes={nodes}", note


def _torchtitan(spec: StudySpec, config: ParallelConfig) -> str:
    """A torchtitan config module. Since torchtitan 0.3.0 a run is a Python function returning a
    `Trainer.Config`, named with `--module` and `--config` (TOML job files are gone, and its
    `--section.option` flags are frozen, kept only for old scripts). The function starts from a
    base config, which supplies the model, data and optimizer, and sets the layout on it."""
    c = config
    module = f"{slug(spec.name).replace('-', '_').replace('.', '_')}_layout"
    torchrun, multi_node = _torchrun(spec, config)
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
    lines = _comments([*_header(spec, config, f"torchtitan {TORCHTITAN_VERSION} config"), *run, "",
                       *_torchtitan_notes(spec, config)])  # fmt: skip
    ac_module, ac_expr = TORCHTITAN_AC[c.activation_checkpoint]
    body = [
        *([f"from {ac_module} import {ac_expr.split('.')[0]}"] if ac_module else []),
        *(torchtitan_imports(spec.gpt()) if torchtitan_builds(spec.gpt()) else []),
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
        *(
            ["    config.debug.moe_force_load_balance = True  # balanced routing, as measured"]
            if spec.gpt().moe and _routing(spec, config) == "balanced"
            else []
        ),
        f"    config.activation_checkpoint = {ac_expr}",
        "    return config",
    ]
    return "\n".join([*lines, "", *body]) + "\n"


def _torchtitan_model(spec: StudySpec) -> list[str]:
    """The lines between the imports and the config function: BASE, and for a model torchtitan
    builds (tuner/export_model.py) the model as a flavor of its llama3."""
    m = spec.gpt()
    if not torchtitan_builds(m):
        why = ("torchtitan has no GPT with learned positions; llama3 is the nearest family" if m.family == "gpt"
               else "torchtitan has no model with this block; its llama3 is RMSNorm, SwiGLU and RoPE")  # fmt: skip
        return [
            "",
            "# The model, data, tokenizer and optimizer: replace with your config function that builds the",
            f"# model above ({why}).",
            "# llama3_debugmodel's tokenizer and data are in torchtitan's source tree only (see the top).",
            "BASE = llama3_debugmodel",
        ]
    return torchtitan_model(m, slug(spec.name))


def _torchtitan_config(spec: StudySpec) -> list[str]:
    """The config function's first lines: BASE, with the study's model where torchtitan builds it."""
    m = spec.gpt()
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
        *torchtitan_moe_parallelism(spec.gpt(), c),
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
        per_stage = _layers_per_stage(spec.gpt().num_layers, c.num_stages)
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
        f"seq_len = {spec.gpt().seq_len}",
        f'mixed_precision_param = "{"float32" if spec.training.precision == "fp32" else "bfloat16"}"',
    ]
    if _no_cuda_graphs(spec, c):
        lines.append("disable_cuda_graphs = True")
    return lines


def _no_cuda_graphs(spec: StudySpec, config: ParallelConfig) -> bool:
    """Trainer.Config refuses CUDA graphs (its default) with pipeline parallelism, and with expert
    parallelism over its all-to-all token dispatcher (it synchronises with the CPU)."""
    return config.pp > 1 or (spec.gpt().moe and config.ep > 1)


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
        notes.append("torchtitan captures CUDA graphs by default (pp = 1); the layout was measured without.")
    if c.activation_checkpoint == "selective":
        notes.append(
            "selective: ours recomputes the attention core (Korthikanti et al. 2022); torchtitan's "
            "SelectiveAC saves matmul outputs (every second one) instead: similar, not the same memory."
        )
    if spec.training.precision == "fp16":
        notes.append("fp16 study: torchtitan's mixed precision is bfloat16 (the trainer measured bf16 too).")
    notes += torchtitan_cp_notes(spec.gpt(), c, builds=torchtitan_builds(spec.gpt()))
    notes += torchtitan_moe_notes(spec.gpt(), c, _routing(spec, config))
    return notes + torchtitan_notes(spec.gpt(), padded_vocab(spec.gpt().vocab_size, c.tp))


# --- Megatron-LM ---


def _megatron(spec: StudySpec, config: ParallelConfig) -> str:
    """`torchrun ... pretrain_gpt.py` with the layout's arguments, one per line."""
    m, c = spec.gpt(), config
    fsdp = _megatron_fsdp2(spec, config)
    args = [
        ("--tensor-model-parallel-size", c.tp),
        ("--pipeline-model-parallel-size", c.pp),
        *megatron_cp_args(c),
    ]
    if _interleaved(c):
        args.append(("--num-layers-per-virtual-pipeline-stage", m.num_layers // c.num_stages))
        if _microbatch_group(c) != c.pp:  # Megatron's default group is pp micro-batches
            args.append(("--microbatch-group-size-per-virtual-pipeline-stage", _microbatch_group(c)))
    if c.sequence_parallel:
        args.append(("--sequence-parallel", None))
    args += [
        ("--micro-batch-size", c.micro_batch_size),
        ("--global-batch-size", c.global_batch_size),
        *megatron_model_args(m),
        *megatron_moe_args(m, c, _routing(spec, config)),
    ]
    if spec.training.precision != "fp32":  # --use-torch-fsdp2 refuses --fp16; bf16 is what was measured
        args.append(("--bf16" if fsdp else f"--{spec.training.precision}", None))
    if c.activation_checkpoint == "full":
        args += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                 ("--recompute-num-layers", 1)]  # fmt: skip
    elif c.activation_checkpoint == "selective":
        args.append(("--recompute-granularity", "selective"))
    if fsdp:
        args += [("--use-torch-fsdp2", None), ("--no-gradient-accumulation-fusion", None)]
    elif c.zero_stage:
        args.append(("--use-distributed-optimizer", None))
    notes = [
        "add data, tokenizer, optimizer and iteration arguments; Megatron pads the vocabulary "
        f"({m.vocab_size}) to a multiple of --make-vocab-size-divisible-by x tp.",
        megatron_model_note(m),
    ]
    torchrun, multi_node = _torchrun(spec, config)
    notes += multi_node
    env, env_note = _megatron_env(spec, config)
    notes += [*([env_note] if env_note else []), *_megatron_notes(spec, config)]
    notes += megatron_cp_notes(c) + megatron_moe_notes(m, c, _routing(spec, config))
    lines = _comments(
        [*_header(spec, config, f"Megatron-LM launch (flags of {MEGATRON_SOURCE})"), "", *notes]
    )
    argv = [f"{env}{torchrun} pretrain_gpt.py"]
    argv += [f"    {flag}" if value is None else f"    {flag} {value}" for flag, value in args]
    return "\n".join([*lines, " \\\n".join(argv)]) + "\n"


def _interleaved(config: ParallelConfig) -> bool:
    return config.pp > 1 and config.pp_schedule == "interleaved_1f1b"


def _microbatch_group(config: ParallelConfig) -> int:
    """The micro-batches each virtual stage runs before the next, as our trainer measured them: torch's
    ScheduleInterleaved1F1B runs max(1, M // pp) rounds of M / rounds micro-batches (M divides evenly:
    ParallelConfig.problems). Megatron's --microbatch-group-size-per-virtual-pipeline-stage is that
    group, default pp; its schedule refuses a group outside [pp, M], or M % group in (0, pp), so with
    M not a multiple of pp only this flag makes it run, and in the same order (test_export.py)."""
    rounds = max(1, config.num_microbatches // config.pp)
    return config.num_microbatches // rounds


def _megatron_fsdp2(spec: StudySpec, config: ParallelConfig) -> bool:
    """zero_stage 3 runs as --use-torch-fsdp2, which validate_args refuses with pipeline parallelism,
    with expert parallelism and with a head tied to the embedding."""
    return config.zero_stage == 3 and config.pp == 1 and config.ep == 1 and not spec.gpt().tie_embeddings


def _routing(spec: StudySpec, config: ParallelConfig) -> str:
    """How the study's trials route tokens (BenchmarkConfig.moe_routing: learned or balanced)."""
    return benchmark_config(spec, config).moe_routing


def _megatron_env(spec: StudySpec, config: ParallelConfig) -> tuple[str, str]:
    """(prefix of the torchrun command, why) for CUDA_DEVICE_MAX_CONNECTIONS, as validate_args
    rules: --use-torch-fsdp2 asserts it is unset or > 1; otherwise tensor or context parallelism
    (sequence parallelism needs tp > 1) asserts it is 1 on GPUs before Blackwell, which on later GPUs
    is allowed and harmless. Expert parallelism adds no rule of its own (only a warning with
    --overlap-moe-expert-parallel-comm, which is not exported)."""
    if _megatron_fsdp2(spec, config):
        return "env -u CUDA_DEVICE_MAX_CONNECTIONS ", (
            "CUDA_DEVICE_MAX_CONNECTIONS unset: --use-torch-fsdp2 requires it unset or > 1"
            + (
                f" (with {_tp_cp(config)} > 1 Megatron warns that {_tp_cp(config, upper=True)} would rather have 1)."
                if config.tp > 1 or config.cp > 1
                else "."
            )
        )
    if config.tp > 1 or config.cp > 1:
        which = {"tp": "tensor parallelism", "cp": "context parallelism"}.get(_tp_cp(config),
                                                                             "tensor and context parallelism")  # fmt: skip
        return "CUDA_DEVICE_MAX_CONNECTIONS=1 ", (
            f"CUDA_DEVICE_MAX_CONNECTIONS=1: {which} {'require' if ' and ' in which else 'requires'} it on GPUs "
            "before Blackwell "
            f"(kernels then start in issue order, so {_tp_cp(config, upper=True)} communication overlaps compute)."
        )
    return "", ""


def _tp_cp(config: ParallelConfig, *, upper: bool = False) -> str:
    """'tp', 'cp' or 'tp and cp': which of the two that need CUDA_DEVICE_MAX_CONNECTIONS=1 are > 1."""
    return " and ".join(name.upper() if upper else name for name in ("tp", "cp") if getattr(config, name) > 1)


def _megatron_notes(spec: StudySpec, config: ParallelConfig) -> list[str]:
    """What Megatron-LM runs differently from the measured layout."""
    c, notes = config, []
    if _megatron_fsdp2(spec, config):
        notes.append("zero_stage 3 -> --use-torch-fsdp2 (torch FSDP2 instead of Megatron's DDP); it does "
                     "not combine with the distributed optimizer or gradient accumulation fusion.")  # fmt: skip
    elif c.zero_stage:
        notes.append(
            "Megatron's distributed optimizer shards optimizer state (and reduce-scatters gradients) "
            "like ZeRO-1/2 over all dp ranks; it has no ZeRO-3."
        )
    if c.zero_stage == 3 and c.pp > 1:
        notes.append("zero_stage 3 with pp > 1: Megatron's --use-torch-fsdp2 does not combine with "
                     "pipeline parallelism, so this uses the distributed optimizer: parameters are not "
                     "sharded and memory per GPU is higher than measured.")  # fmt: skip
    elif c.zero_stage == 3 and spec.gpt().tie_embeddings:
        notes.append("zero_stage 3 with a tied head: Megatron's --use-torch-fsdp2 requires "
                     "--untie-embeddings-and-output-weights, so this uses the distributed optimizer: "
                     "parameters are not sharded and memory per GPU is higher than measured.")  # fmt: skip
    if c.dp_replicate > 1 and c.dp_shard > 1:
        notes.append(f"dp_replicate {c.dp_replicate} x dp_shard {c.dp_shard} (HSDP): Megatron shards over "
                     "all dp ranks; --num-distributed-optimizer-instances sets replicas where supported.")  # fmt: skip
    if c.pp > 1 and c.pp_schedule == "gpipe":
        notes.append("Megatron has no GPipe schedule: it runs 1F1B over the same micro-batches.")
    if _interleaved(c) and _microbatch_group(c) != c.pp:
        notes.append(
            f"--microbatch-group-size-per-virtual-pipeline-stage {_microbatch_group(c)}: {c.num_microbatches} "
            f"micro-batches are not a multiple of pp ({c.pp}), which Megatron's interleaved schedule refuses "
            "with its default group (pp); this group is the one measured (torch's Interleaved1F1B rounds)."
        )
    if c.activation_checkpoint == "selective":
        notes.append("selective recompute is the attention core in both (Korthikanti et al. 2022).")
    if spec.training.precision == "fp16":
        notes.append("--bf16: --use-torch-fsdp2 does not support fp16; the trainer measured bf16 too."
                     if _megatron_fsdp2(spec, config)
                     else "--fp16 uses loss scaling; the trainer measured this layout in bf16.")  # fmt: skip
    return notes


# --- sbatch running our trainer ---


def _sbatch(spec: StudySpec, config: ParallelConfig, site: SiteSettings) -> str:
    """The job script that runs trainer.benchmark for this layout, as tuner/dispatch/slurm.py's
    jobs do, with the resources as #SBATCH lines. Those lines are not shell and cannot be quoted,
    so every value is a number, a slug, or a name that passed SlurmSpec's checks (the site's too).
    Unlike a trial job it runs anywhere: no path of the exporting machine (the trainer comes from
    the site's python), the nodes to itself, and it stops at the first failing line."""
    q, s = shlex.quote, spec.slurm
    cfg = benchmark_config(spec, config)  # exactly what the study measured (tests/tuner/test_export.py)
    SlurmSpec(
        **{k: getattr(s, k) or getattr(site, k) for k in SITE_OPTIONS}
    )  # the site's names pass the spec's checks
    resources = SlurmResources.for_trial(cfg, name=slug(spec.name), timeout_s=spec.trial.timeout_s, spec=s,
                                         site=site, gpus_per_node=spec.cluster.gpus_per_node)  # fmt: skip
    run_dir = q(slug(spec.name)) + '-"$SLURM_JOB_ID"'
    lines = ["#!/bin/bash", *replace(resources, exclusive=True).sbatch_lines()]
    timing = (
        f"--time is the study's trial timeout ({spec.trial.timeout_s:g} s): the trainer warms up "
        f"{cfg.warmup_steps} and measures {cfg.measure_steps} steps; result.json has the figures."
    )
    python = (
        "the python below (TUNER_SLURM_PYTHON, else the job's PATH) must import trainer: install "
        "'parallel-tuner[trainer]' for it, or set PYTHONPATH in the site's setup (TUNER_SLURM_SETUP)."
    )
    lines += _comments([*_header(spec, config, "sbatch job"), timing, python])
    lines += ["set -euo pipefail", *preamble(s, site, {}, checkout=None)]
    lines += [
        "# one directory per job, under the submit directory (sbatch's working directory)",
        f"mkdir -p {run_dir}",
        f"cd {run_dir}",
        f"cat > {CONFIG_FILE} <<'CONFIG_JSON'",
        cfg.to_json(),
        "CONFIG_JSON",
        trainer_command(site.python, CONFIG_FILE, RESULT_FILE),
    ]
    return "\n".join(lines) + "\n"
