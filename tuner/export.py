"""A study's best layout as a launch config for another stack: a torchtitan job TOML, Megatron-LM
`pretrain_gpt.py` arguments under torchrun, or an sbatch script that runs our own trainer.

Only the layout and the model's shape travel: data, tokenizer, optimizer and step counts belong to
the run, not the layout. Where a stack has no equivalent of a knob the file says so in a comment
instead of silently changing what was measured. Names a user wrote (study, cluster) appear only as
slug(name), so no comment or shell line carries a user's text. Golden files: tests/tuner/golden/.
"""

from __future__ import annotations

import shlex

from trainer.config import ParallelConfig
from trainer.launch import CONFIG_FILE, RESULT_FILE
from tuner.dispatch.sbatch import (
    SITE_OPTIONS,
    SiteSettings,
    SlurmResources,
    layout_resources,
    preamble,
    trainer_command,
)
from tuner.spec import SlurmSpec, StudySpec, benchmark_config, slug

FORMATS = ("torchtitan", "megatron", "sbatch")

# torch.distributed.pipelining schedule class names (torchtitan passes them to get_schedule_class).
TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
# zero_stage -> FSDP2 reshard_after_forward (trainer/parallelize.py: apply_fsdp). 0 has no FSDP.
TORCHTITAN_RESHARD = {0: "default", 2: "never", 3: "always"}


def export_layout(
    fmt: str, spec: StudySpec, config: ParallelConfig, *, site: SiteSettings | None = None
) -> str:
    """The launch config for `config` in format `fmt` (one of FORMATS). `site` (sbatch only)
    supplies Slurm defaults and the job preamble; None: no site options, `python` from PATH."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {list(FORMATS)}")
    problems = config.problems(spec.gpt())
    if problems:
        raise ValueError(f"layout {config.describe()} cannot run the study's model: " + "; ".join(problems))
    if fmt == "torchtitan":
        return _torchtitan(spec, config)
    if fmt == "megatron":
        return _megatron(spec, config)
    return _sbatch(spec, config, site or SiteSettings(python="python"))


def _header(spec: StudySpec, config: ParallelConfig, tool: str) -> list[str]:
    """Comment lines (without '# ') shared by every format: which study, layout, model, batch."""
    m, c = spec.gpt(), config
    nodes, per_node = layout_resources(benchmark_config(spec, config), spec.cluster.gpus_per_node)
    return [
        f"{tool} for study {slug(spec.name)} (parallel-tuner, tuner/export.py): {c.describe()}",
        f"{c.world_size} ranks = tp {c.tp} x pp {c.pp} x dp_replicate {c.dp_replicate} x dp_shard "
        f"{c.dp_shard}, on {nodes} node(s) x {per_node} of cluster {slug(spec.cluster.name)}",
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, ffn {m.ffn_size}, "
        f"vocab {m.vocab_size}, seq {m.seq_len} (GPT: learned positions, pre-LN, GELU MLP, untied head, "
        "no linear biases)",
        f"batch: global {c.global_batch_size} = micro-batch {c.micro_batch_size} x {c.num_microbatches} "
        f"micro-batches x dp {c.dp}; precision {spec.training.precision}",
    ]


def _comments(lines: list[str]) -> list[str]:
    return [f"# {line}" if line else "#" for line in lines]


# --- torchtitan ---


def _torchtitan(spec: StudySpec, config: ParallelConfig) -> str:
    """A torchtitan JobConfig TOML. Per data-parallel rank torchtitan takes `local_batch_size`
    sequences and accumulates gradients up to `global_batch_size`; with pp > 1 it splits the local
    batch into pipeline micro-batches of `pipeline_parallel_microbatch_size`. So with pp > 1 the
    local batch is all of a flush's micro-batches; with pp = 1 it is one micro-batch and
    num_microbatches becomes gradient accumulation."""
    m, c = spec.gpt(), config
    local_batch = c.micro_batch_size * (c.num_microbatches if c.pp > 1 else 1)
    param_dtype = "float32" if spec.training.precision == "fp32" else "bfloat16"
    notes = [
        "[model] names a torchtitan model and flavor; ours (shape above) has no built-in flavor: "
        "register one with this shape.",
        f"zero_stage {c.zero_stage} -> fsdp_reshard_after_forward = {TORCHTITAN_RESHARD[c.zero_stage]!r} "
        "(ZeRO-3 reshards after forward, ZeRO-2 keeps parameters gathered until backward; "
        "FSDP2 always shards optimizer state and gradients)."
        if c.zero_stage
        else "zero_stage 0: no FSDP (data_parallel_shard_degree 1), so fsdp_reshard_after_forward has no effect.",
    ]
    if c.tp > 1:
        notes.append(
            "sequence parallelism is implied by tensor_parallel_degree > 1 in torchtitan"
            + ("." if c.sequence_parallel else "; this layout was measured without it.")
        )
    if c.pp > 1 and c.pp_schedule == "interleaved_1f1b":
        notes.append(
            f"Interleaved1F1B: torchtitan's default is 2 stages per rank; this layout has "
            f"{c.virtual_stages} ({m.num_layers} layers over {c.num_stages} stages)"
            + ("." if c.virtual_stages == 2 else "; set pipeline_parallel_layers_per_stage to match.")
        )
    if c.activation_checkpoint == "selective":
        notes.append(
            "selective: ours recomputes the attention core (Korthikanti et al. 2022); torchtitan's "
            "per-op policy ('op') saves matmul outputs instead: similar, not the same memory."
        )
    if spec.training.precision == "fp16":
        notes.append("fp16 study: torchtitan's mixed precision is bfloat16 (the trainer measured bf16 too).")
    if c.dp_shard == 1 and param_dtype != "float32":
        notes.append("mixed_precision_param is applied by FSDP; with dp_shard 1 check your version's AMP.")
    schedule = TORCHTITAN_SCHEDULES[c.pp_schedule] if c.pp > 1 else "1F1B"
    lines = _comments([*_header(spec, config, "torchtitan job config"), "", *notes])
    lines += [
        "",
        "[parallelism]",
        f"data_parallel_replicate_degree = {c.dp_replicate}",
        f"data_parallel_shard_degree = {c.dp_shard}",
        f'fsdp_reshard_after_forward = "{TORCHTITAN_RESHARD[c.zero_stage]}"',
        f"tensor_parallel_degree = {c.tp}",
        "enable_async_tensor_parallel = false",
        "disable_loss_parallel = false  # logits stay vocab-sharded into the loss, as measured",
        f"pipeline_parallel_degree = {c.pp}",
        f'pipeline_parallel_schedule = "{schedule}"',
        f"pipeline_parallel_microbatch_size = {c.micro_batch_size}",
        "context_parallel_degree = 1",
        "",
        "[training]",
        f"local_batch_size = {local_batch}",
        f"global_batch_size = {c.global_batch_size}",
        f"seq_len = {m.seq_len}",
        f'mixed_precision_param = "{param_dtype}"',
        "",
        "[activation_checkpoint]",
        f'mode = "{c.activation_checkpoint}"',
    ]
    if c.activation_checkpoint == "selective":
        lines.append('selective_ac_option = "op"')
    return "\n".join(lines) + "\n"


# --- Megatron-LM ---


def _megatron(spec: StudySpec, config: ParallelConfig) -> str:
    """`torchrun ... pretrain_gpt.py` with the layout's arguments, one per line."""
    m, c = spec.gpt(), config
    if c.pp > 1 and m.num_layers % c.num_stages:
        raise ValueError(
            f"megatron: num_layers ({m.num_layers}) is not a multiple of pp ({c.pp}) x virtual_stages "
            f"({c.virtual_stages}) = {c.num_stages}: Megatron-LM splits layers evenly over stages"
        )
    nodes, per_node = layout_resources(benchmark_config(spec, config), spec.cluster.gpus_per_node)
    args = [
        ("--tensor-model-parallel-size", c.tp),
        ("--pipeline-model-parallel-size", c.pp),
    ]
    if c.pp > 1 and c.pp_schedule == "interleaved_1f1b":
        args.append(("--num-layers-per-virtual-pipeline-stage", m.num_layers // c.num_stages))
    if c.sequence_parallel:
        args.append(("--sequence-parallel", None))
    args += [
        ("--micro-batch-size", c.micro_batch_size),
        ("--global-batch-size", c.global_batch_size),
        ("--num-layers", m.num_layers),
        ("--hidden-size", m.hidden_size),
        ("--num-attention-heads", m.num_heads),
        ("--ffn-hidden-size", m.ffn_size),
        ("--seq-length", m.seq_len),
        ("--max-position-embeddings", m.seq_len),
        ("--untie-embeddings-and-output-weights", None),
        ("--disable-bias-linear", None),
        ("--attention-dropout", m.dropout),
        ("--hidden-dropout", m.dropout),
    ]
    if spec.training.precision != "fp32":
        args.append((f"--{spec.training.precision}", None))
    if c.activation_checkpoint == "full":
        args += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                 ("--recompute-num-layers", 1)]  # fmt: skip
    elif c.activation_checkpoint == "selective":
        args.append(("--recompute-granularity", "selective"))
    fsdp = c.zero_stage == 3 and c.pp == 1
    if fsdp:
        args += [("--use-torch-fsdp2", None), ("--no-gradient-accumulation-fusion", None)]
    elif c.zero_stage:
        args.append(("--use-distributed-optimizer", None))
    notes = [
        "add data, tokenizer, optimizer and iteration arguments; Megatron pads the vocabulary "
        f"({m.vocab_size}) to a multiple of --make-vocab-size-divisible-by x tp.",
        "Megatron's defaults match the rest of the model: learned absolute positions, LayerNorm, GELU.",
    ]
    if nodes > 1:
        notes.append(f"run this on each of the {nodes} nodes with --node-rank and --master-addr (or "
                     "--rdzv-backend=c10d --rdzv-endpoint).")  # fmt: skip
    if c.tp > 1:
        notes.append("export CUDA_DEVICE_MAX_CONNECTIONS=1 so that TP/SP communication overlaps compute.")
    notes += _megatron_notes(spec, config)
    lines = _comments([*_header(spec, config, "Megatron-LM launch"), "", *notes])
    argv = [f"torchrun --nproc-per-node={per_node} --nnodes={nodes} pretrain_gpt.py"]
    argv += [f"    {flag}" if value is None else f"    {flag} {value}" for flag, value in args]
    return "\n".join([*lines, " \\\n".join(argv)]) + "\n"


def _megatron_notes(spec: StudySpec, config: ParallelConfig) -> list[str]:
    """What Megatron-LM runs differently from the measured layout."""
    c, notes = config, []
    if c.zero_stage:
        notes.append(
            "Megatron's distributed optimizer shards optimizer state (and reduce-scatters gradients) "
            "like ZeRO-1/2 over all dp ranks; it has no ZeRO-3."
        )
    if c.zero_stage == 3 and c.pp == 1:
        notes.append("zero_stage 3 -> --use-torch-fsdp2 (torch FSDP2 instead of Megatron's DDP); it does "
                     "not combine with the distributed optimizer or gradient accumulation fusion.")  # fmt: skip
    elif c.zero_stage == 3:
        notes.append("zero_stage 3 with pp > 1: Megatron's --use-torch-fsdp2 does not combine with "
                     "pipeline parallelism, so this uses the distributed optimizer: parameters are not "
                     "sharded and memory per GPU is higher than measured.")  # fmt: skip
    if c.dp_replicate > 1 and c.dp_shard > 1:
        notes.append(f"dp_replicate {c.dp_replicate} x dp_shard {c.dp_shard} (HSDP): Megatron shards over "
                     "all dp ranks; --num-distributed-optimizer-instances sets replicas where supported.")  # fmt: skip
    if c.pp > 1 and c.pp_schedule == "gpipe":
        notes.append("Megatron has no GPipe schedule: it runs 1F1B over the same micro-batches.")
    if c.activation_checkpoint == "selective":
        notes.append("selective recompute is the attention core in both (Korthikanti et al. 2022).")
    if spec.training.precision == "fp16":
        notes.append("--fp16 uses loss scaling; the trainer measured this layout in bf16.")
    return notes


# --- sbatch running our trainer ---


def _sbatch(spec: StudySpec, config: ParallelConfig, site: SiteSettings) -> str:
    """The job script that runs trainer.benchmark for this layout, as tuner/dispatch/slurm.py's
    jobs do, with the resources as #SBATCH lines. Those lines are not shell and cannot be quoted,
    so every value is a number, a slug, or a name that passed SlurmSpec's checks (the site's too)."""
    q, s = shlex.quote, spec.slurm
    cfg = benchmark_config(spec, config)  # exactly what the study measured (tests/tuner/test_export.py)
    SlurmSpec(
        **{k: getattr(s, k) or getattr(site, k) for k in SITE_OPTIONS}
    )  # the site's names pass the spec's checks
    resources = SlurmResources.for_trial(cfg, name=slug(spec.name), timeout_s=spec.trial.timeout_s, spec=s,
                                         site=site, gpus_per_node=spec.cluster.gpus_per_node)  # fmt: skip
    run_dir = q(slug(spec.name)) + '-"$SLURM_JOB_ID"'
    lines = ["#!/bin/bash", *resources.sbatch_lines()]
    timing = (
        f"--time is the study's trial timeout ({spec.trial.timeout_s:g} s): the trainer warms up "
        f"{cfg.warmup_steps} and measures {cfg.measure_steps} steps; result.json has the figures."
    )
    lines += _comments([*_header(spec, config, "sbatch job"), timing])
    lines += ["set -u", *preamble(s, site, {})]
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
