"""What to run and what came out: BenchmarkConfig (one trial), BenchmarkResult, and what this
trainer does not build (trainer_problems, layout_not_built). Torch-free: a frozen dataclass each, with a JSON
round-trip."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.contract.dicts import from_dict
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.rules import Violations

Status = Literal["ok", "pruned", "oom", "invalid", "error", "timeout"]


@dataclass(frozen=True)
class BenchmarkConfig:
    """One trial: a model, a layout, and how to measure it."""

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    warmup_steps: int = 2
    measure_steps: int = 5  # the most measured steps; fewer when stable or pruned (trainer/stopping.py)
    # Adaptive measurement: after min_measure_steps, stop once the ~95 % confidence interval of the
    # mean step time is within stable_rel_ci of it (None: always measure_steps), or as "pruned" when
    # slower than abandon_below_tokens_per_s (None: never).
    min_measure_steps: int = 3
    stable_rel_ci: float | None = None
    abandon_below_tokens_per_s: float | None = None
    seed: int = 0
    lr: float = 3e-4
    grad_clip: float = 1.0  # 0 disables clipping; the norm is computed (and reported) anyway
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 mixed precision on GPU, fp32 on CPU
    # "exact" builds the full model on CPU from the seed then shards it, so every layout starts
    # from the same weights (loss parity); "fast" inits each shard on the device (large models).
    init: Literal["auto", "exact", "fast"] = "auto"
    compile: bool = False
    # A mixture of experts' routing: "learned" (the router's top-k, dropless) or "balanced" (every
    # expert gets the same number of tokens, whatever the scores: Megatron's
    # --moe-router-force-load-balancing, for benchmarks). The result records which one ran.
    moe_routing: Literal["learned", "balanced"] = "learned"
    # Token drop (Megatron-LM's --moe-expert-capacity-factor, its "probs" drop policy): each expert
    # takes at most ceil(factor x tokens x k / experts) of a rank's assignments, those of the
    # highest routing weight; the rest are dropped (they add nothing to the token's output). None:
    # dropless. The result records the fraction dropped (BenchmarkResult.moe["dropped"]).
    moe_capacity_factor: float | None = None
    # The gradients' reduce and no-sync accumulation dtype under FSDP2 / replicate (their
    # MixedPrecisionPolicy.reduce_dtype): "fp32" (Megatron-LM's bf16 default,
    # accumulate_allreduce_grads_in_fp32), or "bf16" (--grad-reduce-in-bf16, Megatron-Bridge's MoE
    # recipes' grad_reduce_in_fp32 false): half the bytes of gradients a pipeline or no_sync
    # accumulates whole, and of the reduce. The reduced gradients land in fp32 either way.
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    max_memory_bytes: int | None = None  # peak over this -> status "oom" (emulates a smaller device)
    init_timeout_s: float = 600.0  # process-group timeout until step 1 finished
    step_timeout_s: float = 120.0  # process-group timeout afterwards: a wedged collective fails fast

    def __post_init__(self) -> None:
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {self.warmup_steps}")
        if self.measure_steps < 1:
            raise ValueError(f"measure_steps must be >= 1, got {self.measure_steps}")
        if self.min_measure_steps < 1:
            raise ValueError(f"min_measure_steps must be >= 1, got {self.min_measure_steps}")
        for name in ("stable_rel_ci", "abandon_below_tokens_per_s", "moe_capacity_factor"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {getattr(self, name)}")
        choices = {"device": ("auto", "cpu", "cuda"), "dtype": ("auto", "fp32", "bf16"),
                   "init": ("auto", "exact", "fast"), "moe_routing": ("learned", "balanced"),
                   "grad_reduce_dtype": ("fp32", "bf16")}  # fmt: skip
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {list(valid)}")

    @property
    def tokens_per_step(self) -> int:
        return self.parallel.global_batch_size * self.model.seq_len

    def to_dict(self) -> dict[str, Any]:
        """The model's and the layout's keys as their to_dict writes them (new axes only when
        used); moe_routing only for a mixture of experts, moe_capacity_factor only when set."""
        data = dataclasses.asdict(self)
        data["model"] = self.model.to_dict()
        data["parallel"] = self.parallel.to_trial_dict()
        if not self.model.moe and self.moe_routing == "learned":
            del data["moe_routing"]
        if self.moe_capacity_factor is None:  # dropless: the key only when it drops (older configs)
            del data["moe_capacity_factor"]
        if self.grad_reduce_dtype == "fp32":  # the key only when set (older configs)
            del data["grad_reduce_dtype"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchmarkConfig:
        data = dict(data)
        if "model" not in data:
            raise ValueError("BenchmarkConfig: missing field 'model'")
        model = data.pop("model")
        data["model"] = (
            MODEL_PRESETS[model] if isinstance(model, str) and model in MODEL_PRESETS
            else ModelConfig.from_dict(model)
        )  # fmt: skip
        data["parallel"] = ParallelConfig.from_dict(data.get("parallel", {}))
        return from_dict(cls, data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> BenchmarkConfig:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class BenchmarkResult:
    """What one trial measured. Throughput fields are 0 unless status is 'ok' or 'pruned'.

    status: 'ok'; 'pruned' (stopped while running: slower than abandon_below_tokens_per_s after
    min_measure_steps; the fields hold what it measured until then); 'invalid' (the layout cannot
    run; reasons in error); 'oom' (out of device memory, or over max_memory_bytes); 'timeout' (the
    trial hung or was too slow: the launcher's time limit, Slurm's TIMEOUT, or a collective that
    timed out because some rank stopped making progress); 'error' (a crash: an exception, or a
    rank that died).
    """

    status: Status
    error: str = ""  # reason (invalid), exception tail (error, oom, timeout) or the log tail
    failed_rank: int | None = None
    step_times_s: list[float] = field(default_factory=list)  # measured steps, max over ranks
    stopped_because: str = ""  # why measuring ended (trainer/stopping.py): stable, pruned or all steps
    tokens_per_s: float = 0.0  # global
    tokens_per_s_per_device: float = 0.0
    model_tflops_per_device: float = 0.0
    mfu: float = 0.0  # model_tflops_per_device / peak_tflops_per_device
    peak_tflops_per_device: float = 0.0
    peak_memory_bytes: int = 0  # max over ranks
    peak_memory_bytes_per_rank: list[int] = field(default_factory=list)
    memory_source: str = ""  # how peak memory was measured
    losses: list[float] = field(default_factory=list)  # every step, warm-up included
    grad_norms: list[float] = field(default_factory=list)  # before clipping
    world_size: int = 0
    parallel: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    device: str = ""
    device_name: str = ""
    dtype: str = ""
    torch_version: str = ""
    num_params: int = 0
    flops_per_token: int = 0
    tokens_per_step: int = 0
    wall_time_s: float = 0.0
    # Where the ranks ran: hosts, and the nodes each parallel group spanned against the placement
    # rule (trainer/contract/topology.py: placement).
    placement: dict[str, Any] = field(default_factory=dict)
    # A mixture of experts only: {"routing": "learned" | "balanced", "imbalance": {layer id: [max /
    # mean tokens per expert over the global batch, per step]}, "aux_loss": [the load-balancing
    # loss added (coefficient included, summed over layers), per step]}; with token drop also
    # "capacity_factor" and "dropped": {layer id: [the share of its assignments dropped over
    # capacity, per step]}. Absent for dense models.
    moe: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def measured(self) -> bool:
        """The throughput fields hold a measurement (a full one, or a pruned trial's partial one)."""
        return self.status in ("ok", "pruned")

    def to_dict(self) -> dict[str, Any]:
        """`moe` only for a mixture of experts: a dense model's result keeps its keys."""
        data = dataclasses.asdict(self)
        if not data["moe"]:
            del data["moe"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchmarkResult:
        return from_dict(cls, data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> BenchmarkResult:
        return cls.from_dict(json.loads(text))


# The layouts this trainer does not build, by rule: a trial of one is refused (trainer_problems)
# and a study's space rejects it (tuner/space.py), with the same (rule, message).
RULE_QK_NORM_PROJ = "qk_norm 'proj' needs tp 1"
RULE_TP_COL_HEADS = "tp_col > 1 needs the plain attention heads"


def layout_not_built(model: ModelConfig, p: ParallelConfig) -> Violations:
    """(rule, message) for each reason this trainer does not build layout `p` of `model`, which the
    contract allows (ParallelConfig.problems)."""
    out = []
    if model.qk_norm == "proj" and p.tp * p.tp_col > 1:
        out.append((
            RULE_QK_NORM_PROJ,
            f"qk_norm 'proj' (one norm over all heads' q and k, OLMoE) needs tp 1, got tp {p.tp}"
            + (f" x tp_col {p.tp_col}" if p.tp_col > 1 else "")
            + ": a tensor-parallel rank holds only its heads",
        ))  # fmt: skip
    if p.tp_col > 1 and (model.qk_norm != "none" or model.attention_head_dim is not None):
        out.append((
            RULE_TP_COL_HEADS,
            f"tp_col ({p.tp_col}) > 1 with qk_norm {model.qk_norm!r} or attention_head_dim "
            f"{model.attention_head_dim} is not built in the trainer (2D tensor parallelism splits "
            "heads by hidden/heads); use tp_col 1",
        ))  # fmt: skip
    elif p.tp_col > 1 and model.attention_kind.latent:
        out.append((
            RULE_TP_COL_HEADS,
            f"tp_col ({p.tp_col}) > 1 with attention {model.attention!r} (latent) is not built in the trainer "
            "(trainer/tp2d.py splits plain q, k and v heads); use tp_col 1",
        ))  # fmt: skip
    return out


def trainer_problems(cfg: BenchmarkConfig) -> list[str]:
    """What the contract allows but this trainer does not build (a trial of it is "invalid" with
    these reasons), beside the layout's own rules (ParallelConfig.problems): the model's, the
    layout's (layout_not_built) and the trial's (compile)."""
    model, p, out = cfg.model, cfg.parallel, []
    out += [message for _, message in layout_not_built(model, p)]
    if model.moe and cfg.compile:
        out.append(
            "compile with a mixture of experts is not supported: dropless routing gives every step other "
            "shapes (tokens per expert); set compile false"
        )
    if p.cp > 1 and cfg.compile:
        out.append(
            f"compile with cp ({p.cp}) > 1 is not supported: the K/V all-gather is an autograd function "
            "around a process-group collective, which fullgraph compile of a block refuses; set compile false"
        )
    return out
