"""The search space: every layout the spec allows, split into valid ones and rejections with reasons."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from trainer.contract.axes import AXES, AXIS
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from trainer.contract.result import layout_not_built
from trainer.contract.rules import zero_rules
from tuner.spec import SpaceSpec, StudySpec, padded_model

RULE_GPUS = "tp * pp must divide the GPU count"  # tp * tp_col * pp with a column axis
RULE_BATCH = "global batch must be divisible by dp * micro_batch_size"
RULE_CROSS_NODE_TP = "tp spans nodes (space.allow_cross_node_tp is false)"
RULE_CROSS_NODE_TENSOR = "tp x tp_col spans nodes (space.allow_cross_node_tp is false)"
RULE_CROSS_NODE_EP = "ep spans nodes (space.allow_cross_node_ep is false)"
RULE_CROSS_NODE_CP = "cp spans nodes (space.allow_cross_node_cp is false)"


def axis_values(model: ModelConfig, space: SpaceSpec, max_gpus: int) -> dict[str, list]:
    """The values a study searches of each searched axis (trainer/contract/axes.py): the spec's
    list, or, where it left an axis with a computed default (ep, cp) out, that default."""
    return {
        a.name: list(getattr(space, a.name))
        if getattr(space, a.name) is not None
        else a.space_auto(model, max_gpus)
        for a in AXES
        if a.searched
    }


def ep_values(model: ModelConfig, space: SpaceSpec, max_gpus: int) -> list[int]:
    """The ep degrees a study searches (axis_values)."""
    return axis_values(model, space, max_gpus)["ep"]


def cp_values(model: ModelConfig, space: SpaceSpec, max_gpus: int) -> list[int]:
    """The cp degrees a study searches (axis_values)."""
    return axis_values(model, space, max_gpus)["cp"]


# The searched axes that multiply the world (their product leaves dp: tp, tp_col, pp, cp), and the
# others, in the enumeration's nesting order (schedule, virtual stages, micro-batch, ZeRO, ...).
_WORLD = tuple(a for a in AXES if a.searched and a.multiplies_world)
_INNER = tuple(
    sorted((a for a in AXES if a.searched and not a.multiplies_world), key=lambda a: a.space_order)
)


def _inner_combos(values: dict[str, list], chosen: dict[str, Any], i: int = 0) -> Iterator[dict[str, Any]]:
    """Every combination of the inner axes' values that applies given `chosen` (space_narrow)."""
    if i == len(_INNER):
        yield dict(chosen)
        return
    axis = _INNER[i]
    listed = values[axis.name]
    for value in axis.space_narrow(chosen, listed) if axis.space_narrow else listed:
        chosen[axis.name] = value
        yield from _inner_combos(values, chosen, i + 1)
    chosen.pop(axis.name, None)


def _named(axis, value: int) -> bool:
    """Whether a message names this world axis: always for tp and pp, the others (tp_col, cp,
    HSDP's dp_replicate) only when used."""
    return (axis.written == "always" and axis.name != "dp_replicate") or value != axis.default


def _product_text(degrees: dict[str, int]) -> str:
    """'tp (2) * tp_col (2) * pp (1) * cp (2)': the degrees that multiply to a device count, those
    added later (tp_col, cp, dp_replicate) only when used."""
    return " * ".join(f"{a.name} ({degrees[a.name]})" for a in _WORLD if _named(a, degrees[a.name]))


def layout(tp: int = 1, pp: int = 1, dp: int = 1, dp_replicate: int = 1, **knobs) -> ParallelConfig:
    """A ParallelConfig from the tuner's view (dp + zero stage): ZeRO 0 replicates over dp, higher
    stages shard over it; with dp_replicate > 1 (HSDP, ZeRO > 0 only) `dp` is the shard group's
    size and the replicas multiply it."""
    zero = knobs.get("zero_stage", 0)
    if zero:
        return ParallelConfig(tp=tp, pp=pp, dp_replicate=dp_replicate, dp_shard=dp, **knobs)
    return ParallelConfig(tp=tp, pp=pp, dp_replicate=dp * dp_replicate, dp_shard=1, **knobs)


RULE_HSDP_ZERO = "HSDP's replicas need zero_stage > 0"


@dataclass
class Enumeration:
    valid: list[ParallelConfig]
    rejected: Counter = field(default_factory=Counter)  # rule -> layouts breaking it (may break several)
    num_rejected: int = 0
    examples: dict[str, str] = field(default_factory=dict)  # rule -> one message with its numbers

    @property
    def space_size(self) -> int:
        return len(self.valid) + self.num_rejected


class SearchSpace:
    def __init__(
        self,
        model: ModelConfig,
        num_gpus: int,
        gpus_per_node: int,
        global_batch_size: int,
        space: SpaceSpec | None = None,
        domain: int | None = None,
    ):
        self.model, self.num_gpus, self.gpus_per_node = model, num_gpus, gpus_per_node
        # The scale-up domain (ClusterSpec.domain_size): where tp, ep and cp groups may go without
        # crossing the network. A node's GPUs by default; NVL72's 72.
        self.domain = domain or gpus_per_node
        self.global_batch_size = global_batch_size
        self.space = space or SpaceSpec()
        # A scaling study tries several device counts (space.num_gpus); by default, all of them.
        self.world_sizes = sorted(self.space.num_gpus or [num_gpus])
        self.values = axis_values(model, self.space, max(self.world_sizes))

    def searched_axes(self) -> set[str]:
        """The axes this study tries at more than their default value."""
        return {name for name, values in self.values.items() if values != [AXIS[name].default]}

    @classmethod
    def from_spec(cls, spec: StudySpec) -> SearchSpace:
        return cls(
            spec.as_model_config(),
            spec.devices,
            spec.cluster.gpus_per_node,
            spec.training.global_batch_size,
            spec.space,
            domain=spec.cluster.domain_size,
        )

    def _candidates(self) -> Iterator[ParallelConfig | tuple[str, str]]:
        """Every combination of the space's values, as a config or, where the world's axes and the
        micro-batch cannot make a layout at all, as a (rule, message) rejection. The axes that
        multiply the world (tp, tp_col, pp, cp) leave dp; the others nest inside, each narrowed to
        what applies (pp = 1 has no schedule to choose; tp = 1 has no sequence parallelism to
        choose). tp_col is the column degree of 2D tensor parallelism: tp x tp_col ranks share
        each weight."""
        world_values = [self.values[a.name] for a in _WORLD]
        for num_gpus, *degrees in itertools.product(self.world_sizes, *world_values):
            chosen = {a.name: d for a, d in zip(_WORLD, degrees, strict=True)}
            combos = list(_inner_combos(self.values, dict(chosen)))
            used = math.prod(degrees)
            if num_gpus % used:
                msg = f"{_product_text(chosen)} does not divide {num_gpus} GPUs"
                yield from itertools.repeat((RULE_GPUS, msg), len(combos))
                continue
            dp = num_gpus // used  # the shard group's (with HSDP's replicas: dp x dp_replicate in all)
            replicas = chosen.get("dp_replicate", 1)
            for knobs in combos:
                mbs = knobs["micro_batch_size"]
                if replicas > 1 and knobs.get("zero_stage", 0) == 0:
                    msg = (f"dp_replicate ({replicas}) > 1 with zero_stage 0: replicated data parallelism over "
                           f"dp ({dp * replicas}) already (HSDP shards within groups: zero_stage 2 or 3)")  # fmt: skip
                    yield (RULE_HSDP_ZERO, msg)
                    continue
                if self.global_batch_size % (dp * replicas * mbs):
                    msg = (f"global batch {self.global_batch_size} not divisible by dp ({dp * replicas}) * "
                           f"micro_batch_size ({mbs})")  # fmt: skip
                    yield (RULE_BATCH, msg)
                    continue
                nmb = self.global_batch_size // (dp * replicas * mbs)
                yield layout(dp=dp, num_microbatches=nmb, **knobs)

    def violations(self, config: ParallelConfig) -> list[tuple[str, str]]:
        """(rule, message) for every rule `config` breaks in this study."""
        out = []
        if config.world_size not in self.world_sizes:
            sizes = " or ".join(map(str, self.world_sizes))
            names = [a.name for a in _WORLD if _named(a, getattr(config, a.name))]
            names.insert(names.index("pp") + 1, "dp")  # dp_replicate x dp_shard, after pp in the mesh's words
            out.append((RULE_GPUS, f"{'*'.join(names)} = {config.world_size} != {sizes} GPUs in the study"))
        if config.global_batch_size != self.global_batch_size:
            out.append((
                RULE_BATCH,
                f"micro_batch_size * num_microbatches * dp = {config.global_batch_size} != global batch "
                f"{self.global_batch_size}",
            ))  # fmt: skip
        tensor = config.tp * config.tp_col  # one block of neighbouring ranks (trainer/contract/topology.py)
        fabric = (
            f"gpus_per_node ({self.domain})"
            if self.domain == self.gpus_per_node
            else f"scaleup_domain ({self.domain})"
        )
        if tensor > self.domain and not self.space.allow_cross_node_tp:
            if config.tp_col > 1:
                msg = f"tp ({config.tp}) x tp_col ({config.tp_col}) = {tensor} > {fabric}"
                out.append((RULE_CROSS_NODE_TENSOR, msg))
            else:
                out.append((RULE_CROSS_NODE_TP, f"tp ({config.tp}) > {fabric}"))
        if config.ep > self.domain and not self.space.allow_cross_node_ep:
            # ep neighbouring ranks of a stage (trainer/contract/topology.py: expert_groups): past the
            # fast fabric every MoE layer's all-to-alls cross the network
            out.append((
                RULE_CROSS_NODE_EP,
                f"ep ({config.ep}) > {fabric}: the expert group's all-to-alls "
                "would cross nodes on every MoE layer (set space.allow_cross_node_ep to search it)",
            ))  # fmt: skip
        if config.cp > 1 and config.cp * tensor > self.domain and not self.space.allow_cross_node_cp:
            # cp ranks tp x tp_col apart (trainer/contract/topology.py): past the fast fabric every
            # layer's K/V gathers cross the network
            out.append((
                RULE_CROSS_NODE_CP,
                f"cp ({config.cp}) x tp ({tensor}) = {config.cp * tensor} > {fabric}: "
                "the context-parallel group's K/V gathers would cross nodes on every layer (set "
                "space.allow_cross_node_cp to search it)",
            ))  # fmt: skip
        # What the trainer does not build, as a trial refuses it (trainer.contract.result).
        out += layout_not_built(self.model, config)
        if config.zero_stage == 1:  # the perf model prices it, the contract refuses it; the rest as stage 2
            out += zero_rules(config, self.model)
            config = ParallelConfig(**{**config.to_dict(), "zero_stage": 2})
        # The trainer builds the vocabulary padded for the layout's tp (tuner.spec.padded_model),
        # so an unpadded tokenizer vocabulary (GPT-2's 50257) never rules a tp out. The column
        # axis splits the embedding and head by hidden dim, not vocabulary: tp alone pads it.
        return out + config.violations(padded_model(self.model, config.tp))

    def explain(self, config: ParallelConfig) -> list[str]:
        """Every reason `config` is not a valid layout of this study; empty when it is."""
        return [message for _, message in self.violations(config)]

    def enumerate(self) -> Enumeration:
        result = Enumeration(valid=[])
        for cand in self._candidates():
            problems = [cand] if isinstance(cand, tuple) else self.violations(cand)
            if problems:
                result.num_rejected += 1
                result.rejected.update({rule for rule, _ in problems})
                for rule, message in problems:
                    result.examples.setdefault(rule, message)
            else:
                result.valid.append(cand)
        return result
