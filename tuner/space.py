"""The search space: every layout the spec allows, split into valid ones and rejections with reasons."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from tuner.spec import SpaceSpec, StudySpec, padded_model

RULE_GPUS = "tp * pp must divide the GPU count"  # tp * tp_col * pp with a column axis
RULE_BATCH = "global batch must be divisible by dp * micro_batch_size"
RULE_CROSS_NODE_TP = "tp spans nodes (space.allow_cross_node_tp is false)"
RULE_CROSS_NODE_TENSOR = "tp x tp_col spans nodes (space.allow_cross_node_tp is false)"
RULE_CROSS_NODE_EP = "ep spans nodes (space.allow_cross_node_ep is false)"
RULE_CROSS_NODE_CP = "cp spans nodes (space.allow_cross_node_cp is false)"
# Megatron-LM's guidance: context parallelism from about 8k tokens (shared notes, docs/parallelism.md).
CP_FROM_SEQ_LEN = 8192
CP_MAX_DEFAULT = 16  # the default space's largest cp (Llama 3's 128k stage used 16)
RULE_QK_NORM_PROJ = "qk_norm 'proj' needs tp 1"
RULE_TP_COL_HEADS = "tp_col > 1 needs the plain attention heads"


def ep_values(model: ModelConfig, space: SpaceSpec, max_gpus: int) -> list[int]:
    """The ep degrees a study searches: space.ep, or by default 1 for a dense model and the
    powers of two up to the experts and the GPUs for a mixture of experts (those the rules then
    refuse are rejected with their reason)."""
    if space.ep is not None:
        return list(space.ep)
    if not model.moe:
        return [1]
    out, ep = [], 1
    while ep <= min(model.num_experts, max_gpus):
        out.append(ep)
        ep *= 2
    return out


def cp_values(model: ModelConfig, space: SpaceSpec, max_gpus: int) -> list[int]:
    """The cp degrees a study searches: space.cp, or by default 1 below CP_FROM_SEQ_LEN tokens and
    the powers of two up to CP_MAX_DEFAULT and the GPUs from it (those the rules refuse, e.g. a
    sequence not divisible by 2 x cp, are rejected with their reason)."""
    if space.cp is not None:
        return list(space.cp)
    if model.seq_len < CP_FROM_SEQ_LEN:
        return [1]
    out, cp = [], 1
    while cp <= min(CP_MAX_DEFAULT, max_gpus):
        out.append(cp)
        cp *= 2
    return out


def layout(tp: int, pp: int, dp: int, **knobs) -> ParallelConfig:
    """A ParallelConfig from the tuner's view (whole dp + zero stage): ZeRO 0 replicates, higher
    stages shard over the whole dp degree (HSDP is not in the search space yet)."""
    zero = knobs.get("zero_stage", 0)
    return ParallelConfig(tp=tp, pp=pp, dp_replicate=1 if zero else dp, dp_shard=dp if zero else 1, **knobs)


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
    ):
        self.model, self.num_gpus, self.gpus_per_node = model, num_gpus, gpus_per_node
        self.global_batch_size = global_batch_size
        self.space = space or SpaceSpec()
        # A scaling study tries several device counts (space.num_gpus); by default, all of them.
        self.world_sizes = sorted(self.space.num_gpus or [num_gpus])
        self.eps = ep_values(model, self.space, max(self.world_sizes))
        self.cps = cp_values(model, self.space, max(self.world_sizes))

    @classmethod
    def from_spec(cls, spec: StudySpec) -> SearchSpace:
        return cls(
            spec.gpt(), spec.devices, spec.cluster.gpus_per_node, spec.training.global_batch_size, spec.space
        )

    def _candidates(self) -> Iterator[ParallelConfig | tuple[str, str]]:
        """Every combination of the space's values, as a config or, where tp, pp and micro-batch
        cannot make a layout at all, as a (rule, message) rejection. pp = 1 has no schedule to
        choose; tp = 1 has no sequence parallelism to choose. tp_col is the column degree of 2D
        tensor parallelism: tp x tp_col ranks share each weight."""
        s = self.space
        schedules = [(sched, 1) for sched in s.pp_schedule if sched != "interleaved_1f1b"]
        if "interleaved_1f1b" in s.pp_schedule:
            schedules += [("interleaved_1f1b", v) for v in s.virtual_stages if v > 1]
        for num_gpus, tp, tp_col, pp, cp in itertools.product(
            self.world_sizes, s.tp, s.tp_col, s.pp, self.cps
        ):
            scheds = schedules if pp > 1 else [("1f1b", 1)]
            sps = s.sequence_parallel if tp > 1 else [False]
            combos = list(
                itertools.product(
                    scheds, s.micro_batch_size, s.zero_stage, s.activation_checkpoint, sps, self.eps
                )
            )
            if num_gpus % (tp * tp_col * pp * cp):
                col = f" * tp_col ({tp_col})" if tp_col > 1 else ""
                ctx = f" * cp ({cp})" if cp > 1 else ""
                msg = f"tp ({tp}){col} * pp ({pp}){ctx} does not divide {num_gpus} GPUs"
                yield from itertools.repeat((RULE_GPUS, msg), len(combos))
                continue
            dp = num_gpus // (tp * tp_col * pp * cp)
            for (sched, v), mbs, zero, ac, sp, ep in combos:
                if self.global_batch_size % (dp * mbs):
                    msg = f"global batch {self.global_batch_size} not divisible by dp ({dp}) * micro_batch_size ({mbs})"
                    yield (RULE_BATCH, msg)
                    continue
                yield layout(
                    tp, pp, dp, micro_batch_size=mbs, num_microbatches=self.global_batch_size // (dp * mbs),
                    zero_stage=zero, activation_checkpoint=ac, sequence_parallel=sp, pp_schedule=sched,
                    virtual_stages=v, tp_col=tp_col, ep=ep, cp=cp,
                )  # fmt: skip

    def violations(self, config: ParallelConfig) -> list[tuple[str, str]]:
        """(rule, message) for every rule `config` breaks in this study."""
        out = []
        if config.world_size not in self.world_sizes:
            sizes = " or ".join(map(str, self.world_sizes))
            col = "*tp_col" if config.tp_col > 1 else ""
            ctx = "*cp" if config.cp > 1 else ""
            out.append((RULE_GPUS, f"tp{col}*pp*dp{ctx} = {config.world_size} != {sizes} GPUs in the study"))
        if config.global_batch_size != self.global_batch_size:
            out.append((
                RULE_BATCH,
                f"micro_batch_size * num_microbatches * dp = {config.global_batch_size} != global batch "
                f"{self.global_batch_size}",
            ))  # fmt: skip
        tensor = config.tp * config.tp_col  # one block of neighbouring ranks (trainer/contract/topology.py)
        if tensor > self.gpus_per_node and not self.space.allow_cross_node_tp:
            if config.tp_col > 1:
                msg = f"tp ({config.tp}) x tp_col ({config.tp_col}) = {tensor} > gpus_per_node ({self.gpus_per_node})"
                out.append((RULE_CROSS_NODE_TENSOR, msg))
            else:
                out.append((RULE_CROSS_NODE_TP, f"tp ({config.tp}) > gpus_per_node ({self.gpus_per_node})"))
        if config.ep > self.gpus_per_node and not self.space.allow_cross_node_ep:
            # ep neighbouring ranks of a stage (trainer/contract/topology.py: expert_groups): past a node
            # every MoE layer's all-to-alls cross the network
            out.append((
                RULE_CROSS_NODE_EP,
                f"ep ({config.ep}) > gpus_per_node ({self.gpus_per_node}): the expert group's all-to-alls "
                "would cross nodes on every MoE layer (set space.allow_cross_node_ep to search it)",
            ))  # fmt: skip
        if config.cp > 1 and config.cp * tensor > self.gpus_per_node and not self.space.allow_cross_node_cp:
            # cp ranks tp x tp_col apart (trainer/contract/topology.py): past a node every layer's K/V
            # gathers cross the network
            out.append((
                RULE_CROSS_NODE_CP,
                f"cp ({config.cp}) x tp ({tensor}) = {config.cp * tensor} > gpus_per_node ({self.gpus_per_node}): "
                "the context-parallel group's K/V gathers would cross nodes on every layer (set "
                "space.allow_cross_node_cp to search it)",
            ))  # fmt: skip
        # What the trainer does not build (trainer.contract.result.trainer_problems), as rules of the space.
        if self.model.qk_norm == "proj" and tensor > 1:
            out.append((
                RULE_QK_NORM_PROJ,
                f"qk_norm 'proj' (one norm over all heads' q and k, OLMoE) needs tp 1, got tp {config.tp}"
                + (f" x tp_col {config.tp_col}" if config.tp_col > 1 else "")
                + ": a tensor-parallel rank holds only its heads",
            ))  # fmt: skip
        if config.tp_col > 1 and (self.model.qk_norm != "none" or self.model.attention_head_dim is not None):
            out.append((
                RULE_TP_COL_HEADS,
                f"tp_col ({config.tp_col}) > 1 with qk_norm {self.model.qk_norm!r} or attention_head_dim "
                f"{self.model.attention_head_dim} is not built in the trainer (2D tensor parallelism splits "
                "heads by hidden/heads); use tp_col 1",
            ))  # fmt: skip
        if config.zero_stage == 1:  # the perf model can price it; the bundled trainer cannot run it
            out.append((
                "zero_stage 1 not offered by the trainer",
                "zero_stage 1 is not offered by the bundled trainer (FSDP2 has no optimizer-only "
                "sharding); stage 2 moves the same bytes",
            ))  # fmt: skip
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
