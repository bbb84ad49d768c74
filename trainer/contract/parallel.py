"""ParallelConfig: one layout, its fields made from the axis table (trainer/contract/axes.py).

world_size = the product of the axes that multiply the world (tp * tp_col * pp * dp_replicate *
dp_shard * cp); global_batch = micro_batch_size * num_microbatches * dp_replicate * dp_shard (cp
ranks share their sequences: context parallelism does not change the batch).

tp is the (row) tensor-parallel degree of Megatron-LM; tp_col a second, column degree (AxoNN's
G_c, trainer/tp2d.py): each weight is split over tp x tp_col ranks.

ep, expert parallelism, is folded into the ranks of data and tensor parallelism rather than
multiplying the world (torchtitan's sparse mesh, Megatron's "parallel folding"): a mixture of
experts' routed experts are split over ep neighbouring ranks of each pipeline stage's dp x tp
block, and each expert's replicas (expert data parallelism, edp = dp x tp / ep) are sharded
(zero_stage > 0) or replicated like the dense weights (trainer/contract/topology.py: expert_groups;
docs/parallelism.md).

cp, context parallelism, splits every sequence over cp ranks (head-tail: 2 x cp chunks, rank r
holds chunks r and 2cp-1-r; trainer/context_parallel.py). Its mesh axis sits between dp_shard and
tp (torchtitan's [pp, dp_replicate, dp_shard, cp, tp]); the cp ranks hold the same weights, so
FSDP2 shards over dp_shard x cp (over cp alone with dp_shard 1 and zero_stage > 0, as torchtitan
does) and gradients are averaged over dp x cp; ep folds into dp x cp x tp (torchtitan: ep divides
dp_shard x cp x tp).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import TYPE_CHECKING, Any, Literal

from trainer.contract.axes import AXES
from trainer.contract.dicts import from_dict
from trainer.contract.rules import Violations

if TYPE_CHECKING:
    from trainer.contract.model import ModelConfig

ActivationCheckpoint = Literal[
    "none",
    "selective",
    "moe_act",
    "layernorm",
    "layernorm+moe_act",
    "mla_up_proj",
    "mla_up_proj+moe_act",
    "layernorm+mla_up_proj+moe_act",
    "op",
    "full",
]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"]


# What the methods below read of the table, looked up once (a plan asks them of every layout).
_WORLD = operator.attrgetter(*(a.name for a in AXES if a.multiplies_world))
_DEGREES = tuple(a.name for a in AXES if a.type is int and not a.choices)  # each >= 1
_RULES = tuple(a.rules for a in AXES if a.rules is not None)  # in the table's order
_CHOICES = tuple((a.name, a.choices) for a in AXES if a.check_choices)


class _Layout:
    """ParallelConfig's behaviour; its fields are the axes (below)."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return math.prod(_WORLD(self))

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def stage_layers(self, num_layers: int) -> list[range]:
        """Each pipeline stage's layers (stage_layer_ranges over num_stages), in stage order."""
        return stage_layer_ranges(num_layers, self.num_stages)

    def stages_of(self, pp_rank: int) -> list[int]:
        """The pipeline stages rank `pp_rank` holds: looped (Narayanan et al. 2021: r, r + pp, ...),
        or a V schedule's (ZBV, DualPipeV) r and 2 pp - 1 - r: the first and the last stage on rank
        0, the middle two on rank pp - 1 (which hands one to the other without a send)."""
        if self.pp_schedule in ("zbv", "dualpipev") and self.pp > 1:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + v * self.pp for v in range(self.virtual_stages)]

    @property
    def edp(self) -> int:
        """Expert data parallelism: the ranks of one pipeline stage holding the same experts."""
        return self.dp * self.cp * self.tp * self.tp_col // self.ep

    def problems(self, model: ModelConfig) -> list[str]:
        """Every reason this layout cannot run `model`; empty when it can."""
        return [message for _, message in self.violations(model)]

    def violations(self, model: ModelConfig) -> Violations:
        """(rule, message) for every rule this layout breaks: every degree >= 1, then each axis's
        own rules in the table's order, then the values outside an axis's choices."""
        out: Violations = []
        for name in _DEGREES:
            if getattr(self, name) < 1:
                out.append((f"{name} must be >= 1", f"{name} must be >= 1, got {getattr(self, name)}"))
        if out:
            return out
        for rules in _RULES:
            out += rules(self, model)
        for name, choices in _CHOICES:
            value = getattr(self, name)
            if value not in choices:
                out.append((f"unknown {name}", f"{name} {value!r} is not one of {list(choices)}"))
        return out

    def describe(self) -> str:
        """A short human label, e.g. 'tp2 pp2(1f1b) dp2(z3) mbs2 x4 ac=full sp' ('tp2x2': row 2,
        column 2): each axis's token, in the table's order."""
        return " ".join(t for a in AXES if a.token is not None and (t := a.token(self)))

    def to_dict(self) -> dict[str, Any]:
        """The axes added after layouts were first stored (tp_col, ep, cp) appear only when set, so
        a layout without them keeps the keys it had before they existed (stored layout keys, golden
        scripts, old results)."""
        return {
            a.name: getattr(self, a.name)
            for a in AXES
            if a.written == "always" or getattr(self, a.name) != a.default
        }

    def to_trial_dict(self) -> dict[str, Any]:
        """The layout as a trial's config.json writes it: as to_dict, but the axes whose history
        wrote them always there (tp_col) are written at their default too."""
        return {
            a.name: getattr(self, a.name)
            for a in AXES
            if a.written != "when_set" or getattr(self, a.name) != a.default
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        return from_dict(cls, data)


ParallelConfig = dataclasses.make_dataclass(
    "ParallelConfig",
    [(a.name, a.annotation, dataclasses.field(default=a.default)) for a in AXES],
    bases=(_Layout,),
    frozen=True,
    namespace={"__doc__": "One layout: a value for every parallel axis (trainer/contract/axes.py)."},
)
ParallelConfig.__module__ = (
    __name__  # make_dataclass's module argument is Python 3.12's; pickle finds it here
)


def stage_layer_count(num_layers: int, num_stages: int, stage: int) -> int:
    """Layers of pipeline stage `stage`: as even as possible, earlier stages taking the remainder
    because the last stage also carries the head (a V x h matmul per token). What
    trainer/pipeline.py builds, the cost model prices and the exports write."""
    base, extra = divmod(num_layers, num_stages)
    return base + (1 if stage < extra else 0)


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Each stage's contiguous range of layers (stage_layer_count each)."""
    ranges, start = [], 0
    for s in range(num_stages):
        n = stage_layer_count(num_layers, num_stages, s)
        ranges.append(range(start, start + n))
        start += n
    return ranges
