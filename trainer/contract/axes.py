"""THE table of parallel axes: each axis declared once, everything else derived from it.

A row says what one knob of a layout is: its ParallelConfig field (also the store's column, the
CSV's column, the sampler's knob and the dashboard's dimension), its type and default, whether it
multiplies the world (and where it sits in the device mesh), the values the trainer accepts, the
values a study searches by default, how a sampler sees it, its token in `describe()`, its label,
and its validity hook (trainer/contract/rules.py). ParallelConfig (trainer/contract/parallel.py),
SpaceSpec (tuner/spec.py), the space's enumeration defaults, the samplers' knobs, the plan's
candidate rows, the CSV columns, the store's columns (tuner/db.py) and the dashboard's parallel
coordinates (served by GET /api/axes) all read this table. Adding an axis: docs/architecture.md.

Torch-free: the tuner and the API import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from trainer.contract import rules
from trainer.contract.rules import (
    ACTIVATION_CHECKPOINTS,
    MULTI_STAGE_SCHEDULES,
    PIPELINE_SCHEDULES,
    V_SCHEDULES,
    Violations,
)

if TYPE_CHECKING:
    from trainer.contract.model import ModelConfig
    from trainer.contract.parallel import ParallelConfig

# Megatron-LM's guidance: context parallelism from about 8k tokens (docs/parallelism.md).
CP_FROM_SEQ_LEN = 8192
CP_MAX_DEFAULT = 16  # the default space's largest cp (Llama 3's 128k stage used 16)

# How a to_dict writes an axis: "always"; "when_set" (only when not at its default: an axis added
# after layouts were first stored, so a layout without it keeps the keys, layout key and golden
# scripts it had); "when_set_in_layout" (dropped at its default from ParallelConfig.to_dict, the
# layout's identity, but always written in a trial's config.json: tp_col's history).
Written = Literal["always", "when_set", "when_set_in_layout"]
# How the external samplers (optuna, deephyper) see an axis: "int" (categorical integers),
# "categorical" (categorical strings, an int read back with int()), "bool" (the strings 'False',
# 'True'), or None (not a knob of its own: derived, or folded into another axis's knob).
SamplerKind = Literal["int", "categorical", "bool"] | None


def _powers_of_two_up_to(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def _ep_auto(model: ModelConfig, max_gpus: int) -> list[int]:
    """Expert parallelism's default: 1 for a dense model, the powers of two up to the experts and
    the GPUs for a mixture of experts (those the rules then refuse are rejected with a reason)."""
    return _powers_of_two_up_to(min(model.num_experts, max_gpus)) if model.moe else [1]


def _cp_auto(model: ModelConfig, max_gpus: int) -> list[int]:
    """Context parallelism's default: 1 below CP_FROM_SEQ_LEN tokens (the K/V gathers buy nothing
    there), the powers of two up to CP_MAX_DEFAULT and the GPUs from it."""
    return [1] if model.seq_len < CP_FROM_SEQ_LEN else _powers_of_two_up_to(min(CP_MAX_DEFAULT, max_gpus))


def _tp_token(p: ParallelConfig) -> str:
    return f"tp{p.tp}" + (f"x{p.tp_col}" if p.tp_col > 1 else "")  # 'tp2x2': row 2, column 2


def _pp_token(p: ParallelConfig) -> str:
    if p.pp == 1:
        return "pp1"
    return f"pp{p.pp}({p.pp_schedule}" + (f"/v{p.virtual_stages}" if p.virtual_stages > 1 else "") + ")"


def _cp_token(p: ParallelConfig) -> str:
    if p.cp == 1:
        return ""
    # with dp_shard 1 and ZeRO, FSDP2 shards over the cp ranks alone: say so
    return f"cp{p.cp}" + (f"(z{p.zero_stage})" if p.dp_shard == 1 and p.zero_stage else "")


def _schedules(chosen: dict[str, Any], values: list[str]) -> list[str]:
    """pp > 1: the listed schedules, the multi-stage ones last; pp 1: no schedule to choose."""
    if chosen["pp"] == 1:
        return ["1f1b"]
    return sorted(values, key=lambda s: s in MULTI_STAGE_SCHEDULES)


def _virtual_stages(chosen: dict[str, Any], values: list[int]) -> list[int]:
    """Interleaved 1F1B: the listed counts above 1; a V schedule: its two stages a rank; else 1."""
    if chosen["pp_schedule"] == "interleaved_1f1b":
        return [v for v in values if v > 1]
    return [2] if chosen["pp_schedule"] in V_SCHEDULES else [1]


@dataclass(frozen=True)
class Axis:
    name: str  # the ParallelConfig field, the store's and the CSV's column, the sampler's knob
    type: type  # int, bool or str
    annotation: str  # the field's type as written in ParallelConfig
    default: Any
    label: str  # a short human label (the dashboard's dimension, a column's heading)
    help: str  # one line: what the axis is (SpaceSpec's field description, docs)
    # The world is the product of these degrees; mesh_order places them in the device mesh,
    # outermost first (trainer/contract/topology.py).
    multiplies_world: bool = False
    mesh_order: int | None = None
    choices: tuple[Any, ...] = ()  # the values the contract accepts; () for a degree (an int >= 1)
    # What a study searches (SpaceSpec): space_default the spec's default list; None: not a list of
    # its own in a spec (the space derives it: dp from the GPUs left, the micro-batch count from
    # the batch); space_auto: the default is None and the space computes it from the model and
    # the GPUs; space_choices: the values a spec may list (default: choices, or any int >= 1).
    space_default: tuple[Any, ...] | None = None
    space_auto: Callable[[ModelConfig, int], list[int]] | None = None
    space_choices: tuple[Any, ...] | None = None
    # The space's enumeration nests the axes that do not multiply the world in this order (outer
    # first), each inside every combination of the world's axes; space_narrow(chosen, values)
    # keeps the listed values that apply given the axes chosen so far (sequence parallelism
    # only with tp > 1, a schedule only with pp > 1).
    space_order: int = 0
    space_narrow: Callable[[dict[str, Any], list[Any]], list[Any]] | None = None
    sampler: SamplerKind = None
    knob_order: int = 0  # the samplers' knob order (kept as it was before the table: seeded runs repeat)
    token: Callable[[ParallelConfig], str] | None = None  # describe()'s part ("" when at rest)
    written: Written = "always"
    rules: Callable[[ParallelConfig, ModelConfig], Violations] | None = None
    aliases: tuple[str, ...] = ()  # short names a user may type (tuner plan --config mbs=2)
    check_choices: bool = False  # a value outside `choices` is a violation ("unknown <name>")
    short: str = ""  # a narrow column's heading where the label is too wide (see `heading`)

    @property
    def heading(self) -> str:
        """Its column's heading in a table of layouts (tuner plan, the dashboard's trials)."""
        return self.short or self.label

    @property
    def searched(self) -> bool:
        """A SpaceSpec field of its own (a list, or None for a computed default)."""
        return self.space_default is not None or self.space_auto is not None


# The order is ParallelConfig's field order (keyword construction everywhere; the JSON a trial's
# config.json holds keeps it). A tuple of frozen rows: nothing adds to it at run time.
AXES: tuple[Axis, ...] = (
    Axis("tp", int, "int", 1, "tp", "tensor parallelism (Megatron-LM's row degree)",
         multiplies_world=True, mesh_order=4, space_default=(1, 2, 4, 8), sampler="int", knob_order=0,
         token=_tp_token, rules=rules.tp_rules),
    Axis("tp_col", int, "int", 1, "tp col", "2D tensor parallelism's column degree (AxoNN's G_c; trainer/tp2d.py)",
         multiplies_world=True, mesh_order=5, space_default=(1,), sampler="int", knob_order=1,
         written="when_set_in_layout"),
    Axis("pp", int, "int", 1, "pp", "pipeline parallelism: stages over ranks",
         multiplies_world=True, mesh_order=0, space_default=(1, 2, 4, 8, 16, 32, 64), sampler="int",
         knob_order=2, token=_pp_token, rules=rules.pp_rules),
    Axis("dp_replicate", int, "int", 1, "dp repl.",
         "data parallelism, replicated weights (DDP / HSDP's outer): a space lists HSDP's replica counts, "
         "each sharding over dp / dp_replicate ranks with ZeRO > 0",
         multiplies_world=True, mesh_order=1, space_default=(1,), token=lambda p: f"dpr{p.dp_replicate}" if p.dp_replicate > 1 else ""),
    Axis("dp_shard", int, "int", 1, "dp shard", "data parallelism, sharded weights (FSDP2 / ZeRO)",
         multiplies_world=True, mesh_order=2,
         token=lambda p: f"dps{p.dp_shard}(z{p.zero_stage})" if p.dp_shard > 1 else ""),
    Axis("micro_batch_size", int, "int", 1, "micro-batch", "sequences per micro-batch and data-parallel rank",
         space_default=(1, 2, 4, 8), space_order=2, sampler="categorical", knob_order=5, aliases=("mbs",),
         token=lambda p: f"mbs{p.micro_batch_size}x{p.num_microbatches}", short="mbs"),
    Axis("num_microbatches", int, "int", 1, "micro-batches",
         "gradient accumulation steps; with pp > 1, micro-batches per pipeline flush", short="nmb"),
    Axis("zero_stage", int, "int", 0, "ZeRO", "ZeRO stage of the data-parallel sharding (0, 2, 3; FSDP2)",
         choices=rules.ZERO_STAGES, space_default=(0, 2, 3), space_choices=(0, 1, 2, 3), space_order=3,
         sampler="categorical", knob_order=6, rules=rules.zero_rules, aliases=("zero",), short="zero"),
    Axis("activation_checkpoint", str, "ActivationCheckpoint", "none", "act. ckpt",
         "activation checkpointing: none, selective (attention core), moe_act (the experts' activation, "
         "Megatron's --recompute-modules moe_act), layernorm (the norms' outputs; also layernorm+moe_act), "
         "mla_up_proj (latent attention's q, k and v from the latents; also with moe_act, layernorm), op (torchtitan's op-level: matmul, attention and "
         "reduce-scatter outputs kept, the rest recomputed), full (every block) or offload (no recompute: each "
         "block's saved activations copied to host memory until its backward, trainer/offload.py)",
         choices=ACTIVATION_CHECKPOINTS, space_default=("none", "selective", "full"), space_order=4, sampler="categorical",
         knob_order=7, aliases=("ac",), rules=rules.ac_rules,
         token=lambda p: f"ac={p.activation_checkpoint}" if p.activation_checkpoint != "none" else "",
         check_choices=True, short="ckpt"),
    Axis("sequence_parallel", bool, "bool", False, "seq. par.", "sequence parallelism over the tp ranks",
         choices=(False, True), space_default=(False, True), space_order=5,
         space_narrow=lambda chosen, values: values if chosen["tp"] > 1 else [False], sampler="bool", knob_order=8,
         aliases=("sp",), token=lambda p: "sp" if p.sequence_parallel else "", short="sp"),
    Axis("pp_schedule", str, "PipelineSchedule", "1f1b", "schedule", "the pipeline schedule",
         choices=PIPELINE_SCHEDULES, space_default=("1f1b", "interleaved_1f1b"), space_order=0,
         space_narrow=_schedules, check_choices=True),
    Axis("virtual_stages", int, "int", 1, "virtual stages", "pipeline stages per pp rank (interleaved 1F1B)",
         space_default=(2, 4), space_order=1, space_narrow=_virtual_stages),
    Axis("ep", int, "int", 1, "ep", "expert parallelism, folded into dp x cp x tp (a mixture of experts only)",
         space_auto=_ep_auto, space_order=6, sampler="int", knob_order=3, token=lambda p: f"ep{p.ep}" if p.ep > 1 else "",
         written="when_set", rules=rules.ep_rules),
    Axis("cp", int, "int", 1, "cp", "context parallelism: each sequence split over cp ranks",
         multiplies_world=True, mesh_order=3, space_auto=_cp_auto, sampler="int", knob_order=4, token=_cp_token,
         written="when_set", rules=rules.cp_rules),
)  # fmt: skip

AXIS = {axis.name: axis for axis in AXES}
WORLD_AXES = tuple(axis.name for axis in AXES if axis.multiplies_world)
MESH_AXES = tuple(a.name for a in sorted((a for a in AXES if a.multiplies_world), key=lambda a: a.mesh_order))
# The external samplers' knobs, in their order; the pipeline schedule is one knob of its own
# ("schedule": pp_schedule with virtual_stages, "none" at pp 1), after the others.
SAMPLER_AXES = tuple(a.name for a in sorted((a for a in AXES if a.sampler), key=lambda a: a.knob_order))


def axes_payload() -> list[dict[str, Any]]:
    """The table as JSON (GET /api/axes): what a client needs to show a layout's knobs."""
    return [
        {"name": a.name, "label": a.label, "heading": a.heading, "help": a.help, "type": a.type.__name__, "default": a.default,
         "choices": list(a.choices), "multiplies_world": a.multiplies_world}
        for a in AXES
    ]  # fmt: skip
