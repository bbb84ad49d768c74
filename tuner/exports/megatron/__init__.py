"""The Megatron-LM target (flags of megatron-core 0.19.2, megatron/training/arguments.py):
`torchrun ... pretrain_gpt.py` with the layout's and the model's arguments, one per line. Every flag
is one of its parser's (tests/tuner/megatron_flags.txt); scripts/check-megatron-export.py runs
validate_args and builds its TransformerConfig.

Families (trainer/contract/families/): every registered one, custom included, flag by flag from its
block's parts (models.py): a family with Family.megatron_defaults (GPT's block) is Megatron-LM's
defaults; any other block its parts' flags (--normalization RMSNorm, --swiglu,
--position-embedding-type rope, ...). Refused: a fractional rope_theta; Llama 3.1 RoPE scaling whose
frequency factors or original context are not Megatron's fixed ones.
- attention: grouped-query, wide heads, per-head q/k norms, latent attention. Refused: OLMoE's
  q/k norms over the whole projections (qk_norm 'proj').
- mixtures of experts. Refused: sigmoid scores not renormalised (top-k > 1), softmax top-1
  renormalised, the expert bias with other than sigmoid scores.
Axes (ParallelConfig):
- tp, sequence parallelism, activation checkpointing: supported.
- pp: 1F1B and interleaved (GPipe runs as 1F1B: a note). Layers not a multiple of the stage count
  (Llama 3.1 405B's 126 over 16, DeepSeek-V3's 61 over 8): --pipeline-model-parallel-layout with our
  trainer's split, stage by stage (pipeline_layout). Refused: interleaved with fewer micro-batches
  than pp; the V schedules (ZBV, DualPipeV: Megatron has neither).
- dp and zero_stage: the distributed optimizer; zero_stage 3 is --use-torch-fsdp2 where validate_args
  takes it (pp 1, ep 1, an untied head), Megatron-FSDP (--use-megatron-fsdp, optim_grads_params:
  parameters, gradients and optimizer state sharded) with ep > 1 at pp 1, else the distributed
  optimizer (a note: parameters not sharded); HSDP is a note.
- cp: --context-parallel-size with --cp-comm-type all_gather (see below). Refused: latent attention
  whose k and v heads differ in width.
- ep: --expert-model-parallel-size with --expert-tensor-parallel-size 1: supported.
- tp_col (2D tensor parallelism): refused (tuner/exports/__init__.py).

Context parallelism (megatron-core 0.19.2):
- `--context-parallel-size cp` and `--cp-comm-type all_gather` (Transformer Engine's
  AttnFuncWithCPAndKVAllGather: K/V all-gathered before attention, not overlapped; the default is
  the p2p ring). Its batch loader gives rank r chunks r and 2cp-1-r (megatron/core/utils.py:
  _get_batch_on_this_cp_rank_per_sequence_balancing), as ours; validate_args asserts seq_length
  divisible by 2 x cp, and, before Blackwell, CUDA_DEVICE_MAX_CONNECTIONS=1 with cp > 1 as with tp.
- Its data-parallel size excludes cp (world / (tp x pp x cp) = dp); gradients, the distributed
  optimizer and --use-torch-fsdp2 span dp x cp (get_data_parallel_group(with_context_parallel=True)).
- Only Transformer Engine's attention runs cp > 1 (core/transformer/dot_product_attention.py
  asserts cp 1), and its all_gather path refuses latent attention whose k and v heads differ in
  width (transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py:
  attn_forward_func_with_cp, "cannot support MLA": p2p or a2a+p2p only): refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig, stage_layer_count
from trainer.contract.rules import V_SCHEDULES
from tuner.cost.layer import recomputed_modules
from tuner.exports.common import capacity_factor, comments, header, launcher, routing
from tuner.exports.megatron.models import (
    megatron_model_args,
    megatron_model_note,
    megatron_moe_args,
    megatron_moe_notes,
    megatron_unsupported,
)
from tuner.spec import StudySpec

if TYPE_CHECKING:
    from tuner.dispatch.sbatch import SiteSettings

# The release the export is written for and tested against (docs/exports.md).
MEGATRON_SOURCE = "megatron-core 0.19.2, megatron/training/arguments.py"
MEGATRON_CP_COMM_TYPE = "all_gather"


def unsupported(spec: StudySpec, config: ParallelConfig) -> list[str]:
    layers, c = spec.as_model_config().num_layers, config
    reasons = megatron_unsupported(spec.as_model_config()) + megatron_cp_unsupported(
        spec.as_model_config(), config
    )
    if c.pp > 1 and layers < c.num_stages:
        reasons.append(
            f"num_layers ({layers}) < pp x virtual_stages ({c.num_stages}): a stage without a layer"
        )
    if c.activation_checkpoint == "offload":
        reasons.append(
            "activation_checkpoint 'offload': Megatron-LM's activation offloading (TransformerConfig."
            "cpu_offloading) keeps layers on the GPU and copies on a stream of its own, not what the "
            "trainer measured; study full or selective recompute for a Megatron-LM launch"
        )
    if c.pp > 1 and c.pp_schedule in V_SCHEDULES:
        reasons.append(
            f"pp_schedule {c.pp_schedule!r}: Megatron-LM's schedules are 1F1B and interleaved 1F1B "
            "(megatron/core/pipeline_parallel/schedules.py); export to torchtitan, or study interleaved_1f1b"
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


def render(spec: StudySpec, config: ParallelConfig, site: SiteSettings | None = None) -> str:
    """`torchrun ... pretrain_gpt.py` with the layout's arguments, one per line."""
    m, c = spec.as_model_config(), config
    fsdp = _megatron_fsdp(spec, config)
    args = [
        ("--tensor-model-parallel-size", c.tp),
        ("--pipeline-model-parallel-size", c.pp),
        *megatron_cp_args(c),
    ]
    if c.pp > 1 and m.num_layers % c.num_stages:
        args.append(("--pipeline-model-parallel-layout", f'"{pipeline_layout(m.num_layers, c)}"'))
    elif _interleaved(c):
        args.append(("--num-layers-per-virtual-pipeline-stage", m.num_layers // c.num_stages))
    if _interleaved(c) and _microbatch_group(c) != c.pp:  # Megatron's default group is pp micro-batches
        args.append(("--microbatch-group-size-per-virtual-pipeline-stage", _microbatch_group(c)))
    if c.sequence_parallel:
        args.append(("--sequence-parallel", None))
    args += [
        ("--micro-batch-size", c.micro_batch_size),
        ("--global-batch-size", c.global_batch_size),
        *megatron_model_args(m),
        *megatron_moe_args(m, c, routing(spec, config), capacity_factor(spec, config)),
    ]
    if spec.training.precision != "fp32":  # --use-torch-fsdp2 refuses --fp16; bf16 is what was measured
        args.append(("--bf16" if fsdp == "torch" else f"--{spec.training.precision}", None))
        if spec.training.grad_reduce_dtype == "bf16":  # Megatron's bf16 default reduces in fp32
            args.append(("--grad-reduce-in-bf16", None))
    if c.activation_checkpoint == "full":
        args += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                 ("--recompute-num-layers", 1)]  # fmt: skip
    elif c.activation_checkpoint == "selective":
        args.append(("--recompute-granularity", "selective"))
    elif recomputed_modules(c):  # the same modules (layernorm, moe_act, mla_up_proj)
        modules = c.activation_checkpoint.replace("+", " ")
        args += [("--recompute-granularity", "selective"), ("--recompute-modules", modules)]
    elif c.activation_checkpoint == "op":  # the nearest modules: norms, the experts' activation
        modules = ("layernorm", "moe_act") if m.moe else ("layernorm",)
        args += [("--recompute-granularity", "selective"), ("--recompute-modules", " ".join(modules))]
    if fsdp == "torch":
        args += [("--use-torch-fsdp2", None), ("--no-gradient-accumulation-fusion", None)]
    elif fsdp == "megatron":
        args += [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads_params"),
                 ("--use-distributed-optimizer", None), ("--ckpt-format", "fsdp_dtensor")]  # fmt: skip
    elif c.zero_stage:
        args.append(("--use-distributed-optimizer", None))
    notes = [
        "add data, tokenizer, optimizer and iteration arguments; Megatron pads the vocabulary "
        f"({m.vocab_size}) to a multiple of --make-vocab-size-divisible-by x tp.",
        megatron_model_note(m),
    ]
    torchrun, multi_node = launcher(spec, config)
    notes += multi_node
    env, env_note = _megatron_env(spec, config)
    notes += [*([env_note] if env_note else []), *_megatron_notes(spec, config)]
    notes += megatron_cp_notes(c) + megatron_moe_notes(
        m, c, routing(spec, config), capacity_factor(spec, config)
    )
    lines = comments([*header(spec, config, f"Megatron-LM launch (flags of {MEGATRON_SOURCE})"), "", *notes])
    argv = [f"{env}{torchrun} pretrain_gpt.py"]
    argv += [f"    {flag}" if value is None else f"    {flag} {value}" for flag, value in args]
    return "\n".join([*lines, " \\\n".join(argv)]) + "\n"


def pipeline_layout(num_layers: int, config: ParallelConfig) -> str:
    """Megatron's --pipeline-model-parallel-layout for our trainer's split of `num_layers` (earlier
    stages take the remainder: trainer/contract/parallel.py stage_layer_count): one `|`-separated
    entry per stage in stage order (virtual stage v of pp rank r is stage v pp + r in both), `t*n`
    its n decoder layers, E (the embedding) on the first, L (the head and loss) on the last
    (megatron/core/transformer/pipeline_parallel_layer_layout.py parse_str_to_list). E.g. 61 layers
    over 8 stages: "Et*8|t*8|t*8|t*8|t*8|t*7|t*7|t*7L"."""
    n = config.num_stages
    stages = [f"t*{stage_layer_count(num_layers, n, s)}" for s in range(n)]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return "|".join(stages)


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
    return _megatron_fsdp(spec, config) == "torch"


def _megatron_fsdp(spec: StudySpec, config: ParallelConfig) -> str | None:
    """Which FSDP runs zero_stage 3: "torch" (--use-torch-fsdp2: pp 1, ep 1, an untied head, as
    validate_args takes it), "megatron" (Megatron-FSDP, --use-megatron-fsdp with
    optim_grads_params, which validate_args takes with expert parallelism; at pp 1 only, as
    Megatron's MoE FSDP recipes run it), or None (the distributed optimizer: parameters whole)."""
    if config.zero_stage != 3 or config.pp > 1:
        return None
    if config.ep > 1:
        return "megatron"
    return None if spec.as_model_config().tie_embeddings else "torch"


def _megatron_env(spec: StudySpec, config: ParallelConfig) -> tuple[str, str]:
    """(prefix of the torchrun command, why) for CUDA_DEVICE_MAX_CONNECTIONS, as validate_args
    rules: --use-torch-fsdp2 asserts it is unset or > 1; otherwise tensor or context parallelism
    (sequence parallelism needs tp > 1) asserts it is 1 on GPUs before Blackwell, which on later GPUs
    is allowed and harmless. Expert parallelism adds no rule of its own (only a warning with
    --overlap-moe-expert-parallel-comm, which is not exported)."""
    if _megatron_fsdp(spec, config):
        flag = "--use-torch-fsdp2" if _megatron_fsdp2(spec, config) else "--use-megatron-fsdp"
        return "env -u CUDA_DEVICE_MAX_CONNECTIONS ", (
            f"CUDA_DEVICE_MAX_CONNECTIONS unset: {flag} requires it unset or > 1"
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
    elif _megatron_fsdp(spec, config) == "megatron":
        notes.append("zero_stage 3 with ep > 1 -> --use-megatron-fsdp --data-parallel-sharding-strategy "
                     "optim_grads_params (Megatron-FSDP: parameters, gradients and optimizer state sharded, as "
                     "measured; --use-torch-fsdp2 does not combine with expert parallelism); it needs "
                     "--ckpt-format fsdp_dtensor.")  # fmt: skip
    elif c.zero_stage:
        notes.append(
            "Megatron's distributed optimizer shards optimizer state (and reduce-scatters gradients) "
            "like ZeRO-1/2 over all dp ranks; it has no ZeRO-3."
        )
    if c.zero_stage == 3 and c.pp > 1:
        notes.append("zero_stage 3 with pp > 1: Megatron's --use-torch-fsdp2 does not combine with "
                     "pipeline parallelism, so this uses the distributed optimizer: parameters are not "
                     "sharded and memory per GPU is higher than measured.")  # fmt: skip
    elif c.zero_stage == 3 and spec.as_model_config().tie_embeddings and not _megatron_fsdp(spec, config):
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
    if c.activation_checkpoint == "op":
        notes.append(
            "op (torchtitan's op-level checkpointing, as measured) has no Megatron equivalent: "
            "--recompute-modules layernorm (and moe_act) discards the norms' (and the experts' "
            "activation's) outputs only, where op also recomputes every other matmul, the activations "
            "and the MoE experts' GEMMs: Megatron holds more, computes less."
        )
    if spec.training.precision == "fp16":
        notes.append("--bf16: --use-torch-fsdp2 does not support fp16; the trainer measured bf16 too."
                     if _megatron_fsdp2(spec, config)
                     else "--fp16 uses loss scaling; the trainer measured this layout in bf16.")  # fmt: skip
    return notes


# --- context parallelism ---


def megatron_cp_unsupported(m: ModelConfig, config: ParallelConfig) -> list[str]:
    if config.cp == 1 or not m.attention_kind.latent:
        return []
    k_width, v_width = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    if k_width == v_width:
        return []
    return [
        f"cp {config.cp} with latent attention (k heads of {k_width}, v heads of {v_width}): Transformer Engine's "
        f"--cp-comm-type {MEGATRON_CP_COMM_TYPE} (what our trainer measured) refuses k and v of different widths "
        "(attn_forward_func_with_cp: p2p or a2a+p2p only)"
    ]


def megatron_cp_args(config: ParallelConfig) -> list[tuple[str, object]]:
    if config.cp == 1:
        return []
    return [("--context-parallel-size", config.cp), ("--cp-comm-type", MEGATRON_CP_COMM_TYPE)]


def megatron_cp_notes(config: ParallelConfig) -> list[str]:
    c = config
    if c.cp == 1:
        return []
    return [
        f"cp {c.cp}: --cp-comm-type {MEGATRON_CP_COMM_TYPE} all-gathers K/V before attention (Transformer Engine), "
        "as measured (Megatron's default p2p passes them around a ring); its batch loader gives rank r chunks r "
        f"and 2cp-1-r of {2 * c.cp}, as ours. It needs Transformer Engine's attention (the default "
        "--transformer-impl; Megatron's local attention refuses cp > 1).",
        f"data parallelism spans dp x cp: Megatron's data-parallel size is {c.dp} (world / (tp x pp x cp)), and "
        f"its gradients and optimizer shards span dp x cp ({c.dp * c.cp} ranks), as measured.",
    ]
