"""Study specs: what to tune, on what, within what budget. Pydantic at the edge (YAML files in
studies/, JSON bodies, CLI flags); the tuner works on trainer/contract/s frozen dataclasses inside."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from trainer.contract.axes import AXES, Axis
from trainer.contract.devices import DEVICES, Device, DeviceKind, Dtype, device_kind, find_device
from trainer.contract.model import (
    ATTENTIONS,
    AUX_LOSSES,
    MLP_KINDS,
    NORMS,
    POSITIONS,
    QK_NORMS,
    ROUTER_SCORES,
    ModelConfig,
)
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig
from tuner.hardware import cluster_preset
from tuner.hfconfig import HFConfigError, read_hf_config

Precision = Literal["bf16", "fp16", "fp32"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"]
SAMPLERS = ("grid", "random", "tpe", "gp", "nsga2", "cbo", "model")


# Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by (default 128)
# times tp (megatron/training/tokenizer: _vocab_size_with_padding), so that the embedding and the
# head split evenly over the tensor-parallel ranks and their GEMMs stay aligned.
VOCAB_DIVISIBLE_BY = 128


def padded_vocab(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """The vocabulary a layout with tensor parallelism `tp` builds: `vocab_size` rounded up to a
    multiple of divisible_by * tp (50257 -> 50304 at tp 1, 51200 at tp 8; 51200 stays 51200)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@functools.lru_cache(maxsize=1024)  # every layout of a plan asks it again (frozen, hashable models)
def padded_model(model: ModelConfig, tp: int) -> ModelConfig:
    """`model` with the vocabulary padded for tensor parallelism `tp`: what the trainer builds and
    what the performance model prices. `model.vocab_size` is the tokenizer's, as the user gave it."""
    vocab = padded_vocab(model.vocab_size, tp)
    return model if vocab == model.vocab_size else dataclasses.replace(model, vocab_size=vocab)


def slug(name: str) -> str:
    """A file-system and job-name safe form of a user's name: [A-Za-z0-9_.-] only, never '..' or a
    leading dot, plus a short hash of the original so that different names stay apart."""
    import hashlib

    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).replace("..", "_").strip("._-")[:60] or "study"
    if safe == name:
        return name
    return f"{safe}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def model_preset(name: str) -> dict[str, Any]:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {sorted(MODEL_PRESETS)}")
    return {"preset": name, **MODEL_PRESETS[name].to_dict()}


def default_tp(model: ModelConfig) -> list[int]:
    """space.tp when the spec leaves it out: 1 to 8 (a node of 8 GPUs), and for a model with
    grouped-query attention also the powers of two above up to num_heads. The query heads would
    allow those, the KV heads rule them out (ParallelConfig: "tp must divide num_kv_heads"), and a
    plan counts them among its rejections with that reason instead of never offering them."""
    tps = [1, 2, 4, 8]
    while model.kv_heads < model.num_heads and tps[-1] * 2 <= model.num_heads:
        tps.append(tps[-1] * 2)
    return tps


def _expand_preset(value: Any, expand) -> Any:
    """'name' -> the preset; {'preset': 'name', **overrides} -> the preset with overrides."""
    if isinstance(value, str):
        return expand(value)
    if isinstance(value, dict) and value.get("preset") is not None:
        base = expand(value["preset"])
        return {**base, **{k: v for k, v in value.items() if k in base}} | (
            {k: v for k, v in value.items() if k not in base and k != "preset"}
        )
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """The model: a preset's name, a preset with overrides, or every field (trainer.contract.model.ModelConfig:
    the GPT defaults, or the fields of another family)."""

    preset: str | None = None
    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_heads: PositiveInt
    # The tokenizer's vocabulary (GPT-2: 50257). Each layout pads it as Megatron-LM does
    # (padded_vocab: to a multiple of 128 x tp); trials, predictions and plans carry the padded size.
    vocab_size: PositiveInt = 50304
    seq_len: PositiveInt = 2048
    ffn_hidden_size: PositiveInt | None = None
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    num_kv_heads: PositiveInt | None = None  # None: num_heads (multi-head attention); fewer: GQA
    norm: Literal[NORMS] = "layernorm"  # type: ignore[valid-type]
    norm_eps: PositiveFloat = 1e-5
    mlp: Literal[MLP_KINDS] = "gelu"  # type: ignore[valid-type]
    positions: Literal[POSITIONS] = "learned"  # type: ignore[valid-type]
    rope_theta: PositiveFloat = 10000.0
    rope_scaling_factor: PositiveFloat | None = None
    rope_low_freq_factor: PositiveFloat = 1.0
    rope_high_freq_factor: PositiveFloat = 4.0
    rope_original_max_positions: PositiveInt = 8192
    tie_embeddings: bool = False
    qkv_bias: bool = False
    attention_head_dim: PositiveInt | None = None
    qk_norm: Literal[QK_NORMS] = "none"  # type: ignore[valid-type]
    attention: Literal[ATTENTIONS] = "mha"  # type: ignore[valid-type]
    q_lora_rank: NonNegativeInt = 0
    kv_lora_rank: NonNegativeInt = 0
    qk_nope_head_dim: NonNegativeInt = 0
    qk_rope_head_dim: NonNegativeInt = 0
    v_head_dim: NonNegativeInt = 0
    num_experts: NonNegativeInt = 0  # 0: dense; else a mixture of experts (trainer/contract/model.py)
    moe_top_k: NonNegativeInt = 0
    moe_ffn_hidden_size: PositiveInt | None = None
    moe_shared_ffn_hidden_size: NonNegativeInt = 0
    moe_dense_layers: NonNegativeInt = 0
    moe_router_score: Literal[ROUTER_SCORES] = "softmax"  # type: ignore[valid-type]
    moe_norm_topk: bool = True
    moe_route_scale: PositiveFloat = 1.0
    moe_groups: PositiveInt = 1
    moe_topk_groups: PositiveInt = 1
    moe_aux_loss_coef: NonNegativeFloat = 0.0
    moe_bias_update_rate: NonNegativeFloat = 0.0
    moe_aux_loss: Literal[AUX_LOSSES] = "sequence"  # type: ignore[valid-type]
    moe_router_fp32: bool = False

    @model_validator(mode="after")
    def _a_model(self) -> ModelSpec:
        try:  # the cross-field rules (heads divide hidden, KV heads divide heads, ...) are ModelConfig's
            self.as_model_config()
        except ValueError as e:
            raise ValueError(str(e).removeprefix("ModelConfig: ").replace("ModelConfig.", "")) from None
        return self

    def as_model_config(self, seq_len: int | None = None) -> ModelConfig:
        fields = self.model_dump(exclude={"preset"})
        if seq_len is not None:
            fields["seq_len"] = seq_len
        return ModelConfig(**fields)

    gpt = as_model_config  # its name before other families shared it; kept for one release


class ClusterSpec(_Strict):
    name: str = "custom"
    # The device model, a row of trainer/contract/devices.py's table ("A100", "H100", "MI250X", "cpu", ...):
    # its fp32 peak and memory bandwidth. None: only peak_tflops is known.
    device: str | None = None
    gpus_per_node: PositiveInt
    num_nodes: PositiveInt = 1
    device_memory_gb: PositiveFloat
    peak_tflops: PositiveFloat = Field(description="dense bf16/fp16 TFLOP/s per device")
    intra_node_gbps: PositiveFloat = Field(description="per-device bandwidth to peers in its node, GB/s")
    inter_node_gbps: PositiveFloat = Field(description="per-node network bandwidth, GB/s")
    intra_node_latency_us: NonNegativeFloat = 5.0
    inter_node_latency_us: NonNegativeFloat = 10.0
    # Set when a node's devices share fewer compute units than there are devices (CPU ranks on a
    # few cores): the step then takes at least the node's total busy time over its cores. May be a
    # fraction: 4 emulated nodes on one 2-core machine have 0.5 cores each.
    cores_per_node: PositiveFloat | None = None
    # The scale-up domain: devices joined by the fast fabric (NVLink / NVSwitch, Infinity Fabric) at
    # intra_node_gbps. None: a node (an HGX / DGX board of 8); a rack of nodes where the fabric
    # spans it (GB200 / GB300 NVL72: 72 GPUs on 18 trays of 4), a multiple of gpus_per_node. Groups
    # inside it (tp, ep, cp, dp) talk at intra_node_gbps; past it, over the nodes' network.
    scaleup_domain: PositiveInt | None = Field(
        None, description="devices on the fast fabric (NVL72: 72); default: a node (gpus_per_node)"
    )
    # A fabric that is a full mesh of point-to-point links (AMD's Infinity Fabric boards: 7 links a
    # GPU) instead of a switch: each pair's own link, GB/s per direction. A group of k then reaches
    # (k - 1) links, at most intra_node_gbps. None: a switch (NVSwitch), every group at intra_node_gbps.
    intra_node_peer_gbps: PositiveFloat | None = Field(
        None, description="per-pair link of a full-mesh fabric (MI300X: 64 GB/s); default: a switch"
    )

    @model_validator(mode="after")
    def _domain_of_whole_nodes(self) -> ClusterSpec:
        if self.scaleup_domain is not None and self.scaleup_domain % self.gpus_per_node:
            raise ValueError(
                f"scaleup_domain ({self.scaleup_domain}) must be a multiple of gpus_per_node ({self.gpus_per_node}): "
                "the fast fabric joins whole nodes"
            )
        return self

    @property
    def domain_size(self) -> int:
        """Devices on one scale-up fabric: scaleup_domain, or a node's."""
        return self.scaleup_domain or self.gpus_per_node

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str | None) -> str | None:
        if v is not None and find_device(v) is None:
            raise ValueError(f"unknown device {v!r}; valid: {[d.name for d in DEVICES] + ['cpu']}")
        return v

    @property
    def device_kind(self) -> DeviceKind:
        """'cpu' for ranks sharing CPU cores (cores_per_node set, as on cpu-local), else 'gpu'
        (trainer/contract/devices.py's one rule). It decides where trials run (StudySpec.device) and the
        performance model's default constants (tuner.perfconstants.default_constants)."""
        return device_kind(self.cores_per_node)

    @property
    def device_row(self) -> Device | None:
        return find_device(self.device) if self.device else None

    def peak_tflops_for(self, dtype: Dtype) -> float:
        """The dense peak in the dtype trials compute in: the device's fp32 peak for fp32 (a GPU's
        plain fp32 is 8-16x below its tensor cores), else peak_tflops."""
        row = self.device_row
        if dtype == "fp32" and row is not None and self.device_kind == "gpu":
            return row.peak_tflops_fp32
        return self.peak_tflops

    @property
    def total_devices(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def device_memory_bytes(self) -> float:
        return self.device_memory_gb * 1e9


class TrainingSpec(_Strict):
    global_batch_size: PositiveInt
    seq_len: PositiveInt | None = None  # None: the model's
    precision: Precision = "bf16"
    # The planned training run's length: with it, a study reports the device-hours its best layout
    # saves over the whole run (tuner/payoff.py).
    total_tokens: PositiveInt | None = None
    # A mixture of experts' routing in trials (BenchmarkConfig.moe_routing): "learned" (the
    # router's top-k, dropless) or "balanced" (forced balance, as published MoE figures run), and
    # the load imbalance the performance model prices for learned routing: the busiest expert's
    # tokens over the mean (tuner/cost/experts.py: imbalance_factor). Neither matters to a dense model.
    moe_routing: Literal["learned", "balanced"] = "learned"
    moe_imbalance: float = 1.3
    # Token drop (BenchmarkConfig.moe_capacity_factor, Megatron-LM's --moe-expert-capacity-factor):
    # each expert takes at most this factor x its mean share of a rank's assignments, the rest are
    # dropped; priced as an imbalance of at most the factor. None: dropless.
    moe_capacity_factor: float | None = None
    # The gradients' reduce and no-sync accumulation dtype (BenchmarkConfig.grad_reduce_dtype):
    # fp32 (Megatron-LM's bf16 default), or bf16 (its --grad-reduce-in-bf16; Megatron-Bridge's
    # MoE recipes): half the bytes of the gradients a pipeline accumulates whole, and of the reduce.
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"

    @field_validator("moe_imbalance")
    @classmethod
    def _imbalance_at_least_one(cls, v: float) -> float:
        if not v >= 1.0:
            raise ValueError(
                f"training.moe_imbalance is the busiest expert's tokens over the mean, so it must be >= 1 "
                f"(1: perfectly balanced), got {v}"
            )
        return v

    @field_validator("moe_capacity_factor")
    @classmethod
    def _capacity_positive(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(
                f"training.moe_capacity_factor is each expert's capacity over its mean share of the tokens, so it "
                f"must be > 0 (Megatron's recipes use 1.0; omit it for dropless routing), got {v}"
            )
        return v


class _SpaceRules(_Strict):
    """What a study searches besides the axes' values: the device counts, and where groups may
    span nodes. SpaceSpec adds one list per searched axis of the axis table (trainer/contract/axes.py)."""

    num_gpus: list[PositiveInt] | None = Field(
        None, description="device counts to try (a scaling study); default: the study's num_gpus"
    )
    # tp larger than a node runs (Megatron-LM does, slowly: Narayanan et al. 2021 fig. 13) and is
    # priced over the inter-node link; false excludes it from the study.
    allow_cross_node_tp: bool = True
    # An ep group is ep neighbouring ranks; across nodes its all-to-alls cross the network on
    # every MoE layer (tuner/cost/experts.py prices them), so by default ep stays inside a node.
    allow_cross_node_ep: bool = False
    # A cp group is cp ranks tp apart; across nodes its K/V gathers cross the network on every
    # layer (priced), which long sequences can afford: allowed by default.
    allow_cross_node_cp: bool = True

    @field_validator("pp_schedule", mode="before", check_fields=False)
    @classmethod
    def _schedule_aliases(cls, v: Any) -> Any:
        return [s.replace("-", "_") if isinstance(s, str) else s for s in v] if isinstance(v, list) else v

    @field_validator("*")
    @classmethod
    def _non_empty_unique(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        if not v:
            raise ValueError("needs at least one value")
        return sorted(set(v), key=v.index)


def _space_field(axis: Axis) -> tuple[Any, Any]:
    """An axis's SpaceSpec field: a list of its values (a Literal of what a spec may list, or any
    positive int), defaulting to the table's list; None where the space computes the default
    from the model and the GPUs (ep, cp: tuner.space)."""
    allowed = axis.space_choices or axis.choices
    item = bool if axis.type is bool else Literal[allowed] if allowed else PositiveInt  # type: ignore[valid-type]
    if axis.space_auto is not None:
        return list[item] | None, Field(
            None, description=f"{axis.help}; default: computed from the model and the GPUs"
        )
    return list[item], Field(list(axis.space_default), description=axis.help)


# Allowed values of each axis; dp is what the GPUs leave, num_microbatches what the batch does.
SpaceSpec = create_model(
    "SpaceSpec", __base__=_SpaceRules, __module__=__name__,
    **{axis.name: _space_field(axis) for axis in AXES if axis.searched},
)  # fmt: skip
SpaceSpec.__doc__ = (
    "Allowed values of each knob; dp is what the GPUs leave, num_microbatches what the batch does."
)


class BudgetSpec(_Strict):
    max_trials: PositiveInt = 20  # trials that run (pruned ones do not count)
    max_wall_time_s: PositiveFloat | None = None
    max_device_hours: PositiveFloat | None = None
    trials_in_flight: PositiveInt = 1
    # Stop early when this many finished trials in a row did not beat the best by more than
    # early_stop_min_improvement (relative); None: never.
    early_stop_trials: PositiveInt | None = None
    early_stop_min_improvement: float = Field(0.01, ge=0.0)


class TrialSpec(_Strict):
    """How each trial runs: the trainer's warm-up and measured steps, and its wall-clock limit."""

    warmup_steps: PositiveInt = 2
    measure_steps: PositiveInt = Field(5, description="the most measured steps (fewer: stable or pruned)")
    # Adaptive measurement (trainer/stopping.py), from min_measure_steps on: stop once the ~95 %
    # confidence interval of the mean step time is within stable_rel_ci of the mean; stop a trial
    # slower than prune_running_fraction x the best tokens/s measured so far at its device count
    # (PRUNED, its partial measurement kept and told). None disables either.
    min_measure_steps: PositiveInt = 3
    stable_rel_ci: PositiveFloat | None = 0.02
    prune_running_fraction: float | None = Field(0.5, gt=0, le=1)
    timeout_s: PositiveFloat = 600.0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_retries: int = Field(2, ge=0, description="re-runs after an infrastructure failure")
    crash_retries: int = Field(
        1, ge=0, description="re-runs after a crash; a crash that repeats makes the layout infeasible"
    )
    # A failed submission (sbatch exits non-zero or times out, the controller is unreachable) puts
    # the trial back in the queue, retried after dispatch_backoff_s x 2^(n-1) (capped at 5 min);
    # after max_dispatch_failures in a row the study is handed back (PENDING) for
    # dispatch_pause_s, never failed.
    dispatch_backoff_s: PositiveFloat = 2.0
    max_dispatch_failures: PositiveInt = 5
    dispatch_pause_s: PositiveFloat = 60.0


# Values that end up as Slurm options: Slurm's own name syntax, nothing a shell or sbatch could
# read as more than one word. Partitions may be a comma list; constraints use & | , [ ] * :.
_SLURM_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.,-]*$"
_SLURM_CONSTRAINT = r"^[A-Za-z0-9_.,&|\[\]*:-]+$"
_MODULE = r"^[A-Za-z0-9][A-Za-z0-9_.+/-]*$"
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class SlurmSpec(_Strict):
    """Where and how trials run on a Slurm cluster. Site-wide defaults come from settings
    (TUNER_SLURM_*); what a spec sets wins. Raw shell lines for the job preamble are a site
    setting only (TUNER_SLURM_SETUP), never part of a spec a user submits."""

    account: str | None = Field(None, pattern=_SLURM_NAME, max_length=64)
    partition: str | None = Field(None, pattern=_SLURM_NAME, max_length=128)
    qos: str | None = Field(None, pattern=_SLURM_NAME, max_length=64)
    constraint: str | None = Field(None, pattern=_SLURM_CONSTRAINT, max_length=128)
    modules: list[str] = Field([], description="`module load` each, in order")
    env: dict[str, str] = Field({}, description="exported in the job (values are quoted)")
    cpus_per_task: PositiveInt | None = None
    gpus_per_node: int | None = Field(None, ge=0, description="default: the cluster's, on cuda")
    mode: Literal["job-per-trial", "allocation"] = "job-per-trial"
    allocation_nodes: PositiveInt | None = Field(None, description="allocation mode; default: the study's")
    allocation_minutes: PositiveInt = 60
    allocation_margin_s: PositiveFloat = Field(
        60.0, description="allocation mode: trials still running this long before the end are re-queued"
    )

    @field_validator("modules")
    @classmethod
    def _modules(cls, v: list[str]) -> list[str]:
        for m in v:
            if not re.match(_MODULE, m):
                raise ValueError(f"module name {m!r} must match {_MODULE}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not re.match(_ENV_NAME, k):
                raise ValueError(f"environment variable name {k!r} must match {_ENV_NAME}")
        return v


class StudySpec(_Strict):
    # Any printable name: it is data. Paths and job names use slug(name), never the name itself.
    name: str = Field("study", min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$")
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    num_gpus: PositiveInt | None = None  # devices the study may use; None: the whole cluster
    space: SpaceSpec = SpaceSpec()
    budget: BudgetSpec = BudgetSpec()
    trial: TrialSpec = TrialSpec()
    prune_predicted_oom: bool = True  # layouts the model says cannot fit are PRUNED, never run
    sampler: Literal[SAMPLERS] = "model"  # type: ignore[valid-type]
    seed: int = 0
    backend: Literal["local", "slurm", "dry-run"] = "local"
    slurm: SlurmSpec = SlurmSpec()

    @model_validator(mode="before")
    @classmethod
    def _default_tp(cls, data: Any) -> Any:
        """space.tp from the model when the spec leaves it out (default_tp)."""
        space = data.get("space", {}) if isinstance(data, dict) else None
        if not isinstance(space, dict) or "tp" in space:
            return data
        try:
            model = ModelSpec.model_validate(
                _expand_preset(data.get("model"), model_preset)
            ).as_model_config()
        except ValueError:  # a bad model: its own field reports it
            return data
        return {**data, "space": {**space, "tp": default_tp(model)}}

    @field_validator("model", mode="before")
    @classmethod
    def _model_preset(cls, v: Any) -> Any:
        if isinstance(v, dict) and "hf_config" in v:
            raise ValueError(
                "hf_config: a path is read where a spec file is read (tuner run/submit/plan, relative to "
                "the file's folder) and replaced by the model's fields; a spec sent as data (the API) "
                "must give the fields: the server reads no files"
            )
        return _expand_preset(v, model_preset)

    @field_validator("cluster", mode="before")
    @classmethod
    def _cluster_preset(cls, v: Any) -> Any:
        return _expand_preset(v, cluster_preset)

    @model_validator(mode="after")
    def _consistent(self) -> StudySpec:
        c, gpus = self.cluster, self.devices
        if gpus > c.total_devices:
            raise ValueError(
                f"num_gpus ({gpus}) exceeds the cluster's {c.num_nodes} x {c.gpus_per_node} = {c.total_devices}"
            )
        if self.space.num_gpus and max(self.space.num_gpus) > gpus:
            raise ValueError(f"space.num_gpus {self.space.num_gpus} exceeds the study's num_gpus ({gpus})")
        if gpus % c.gpus_per_node and c.gpus_per_node % gpus:
            raise ValueError(
                f"num_gpus ({gpus}) must be a multiple of gpus_per_node ({c.gpus_per_node}) or divide it "
                f"(whole nodes, or a part of one node)"
            )
        model = self.as_model_config()
        heads, what = (
            (model.kv_heads, "num_kv_heads")
            if model.kv_heads < model.num_heads
            else (model.num_heads, "num_heads")
        )
        # The default space (default_tp) reaches past the heads on purpose: those of its values
        # that do not divide are rejected layout by layout, with the rule, in the plan. Any other
        # value that does not divide is a mistake in the spec, as is a space with none that does.
        bad = [t for t in self.space.tp if heads % t]
        defaults = default_tp(model)
        strays = [t for t in bad if t not in defaults]
        if strays or len(bad) == len(self.space.tp):
            valid = [t for t in range(1, heads + 1) if heads % t == 0]
            raise ValueError(
                f"space.tp: {strays or bad} do not divide the model's {what} ({heads}); valid tp values: {valid}"
            )
        return self

    @property
    def devices(self) -> int:
        return self.num_gpus or self.cluster.total_devices

    @property
    def seq_len(self) -> int:
        return self.training.seq_len or self.model.seq_len

    def as_model_config(self) -> ModelConfig:
        return self.model.as_model_config(self.seq_len)

    gpt = as_model_config  # its name before other families shared it; kept for one release

    @property
    def device(self) -> Literal["cpu", "cuda"]:
        """Where trials run: trial.device, with `auto` = the CPU on a cluster of CPU ranks
        (cluster.device_kind), a GPU elsewhere."""
        if self.trial.device != "auto":
            return self.trial.device
        return "cpu" if self.cluster.device_kind == "cpu" else "cuda"

    @property
    def trial_dtype(self) -> Dtype:
        """The dtype trials compute in, the one rule for the trainer's config (benchmark_config)
        and the pricing (tuner.pricing.Pricing.for_study): CPU ranks run fp32, GPUs bf16 mixed
        precision (fp16 studies too: the trainer has no fp16 loss scaling), fp32 studies fp32."""
        return "fp32" if self.training.precision == "fp32" or self.device == "cpu" else "bf16"

    @property
    def moe_imbalance(self) -> float:
        """The imbalance the pricing assumes: 1 under forced-balance routing, else
        training.moe_imbalance; with token drop at most training.moe_capacity_factor
        (tuner/cost/experts.py priced_imbalance)."""
        from tuner.cost.experts import priced_imbalance

        routed = 1.0 if self.training.moe_routing == "balanced" else self.training.moe_imbalance
        return priced_imbalance(routed, self.training.moe_capacity_factor)


def benchmark_config(
    spec: StudySpec, config: ParallelConfig, best_tokens_per_s: float | None = None
) -> BenchmarkConfig:
    """What the trainer runs for `config` in this study: the one derivation used by the runner,
    the allocation runner and the exports. The device is StudySpec.device, the dtype
    StudySpec.trial_dtype (the pricing's too); the trainer reports OOM above the cluster's device
    memory. The model has the vocabulary padded for the layout's tp (padded_model), as Megatron-LM pads it.
    `best_tokens_per_s` (the best measured so far at this layout's device count) sets the floor
    below which the trial prunes itself while running."""
    t, device, dtype = spec.trial, spec.device, spec.trial_dtype
    floor = (
        t.prune_running_fraction * best_tokens_per_s
        if t.prune_running_fraction and best_tokens_per_s
        else None
    )
    return BenchmarkConfig(
        model=padded_model(spec.as_model_config(), config.tp), parallel=config, warmup_steps=t.warmup_steps, measure_steps=t.measure_steps,
        min_measure_steps=t.min_measure_steps, stable_rel_ci=t.stable_rel_ci, abandon_below_tokens_per_s=floor,
        seed=spec.seed, device=device, dtype=dtype, max_memory_bytes=int(spec.cluster.device_memory_bytes),
        moe_routing=spec.training.moe_routing, moe_capacity_factor=spec.training.moe_capacity_factor,
        grad_reduce_dtype=spec.training.grad_reduce_dtype,
    )  # fmt: skip


def validation_problems(errors) -> list[dict[str, str]]:
    """pydantic errors (ValidationError.errors(), or a request's) -> [{"field", "message"}]: the one
    formatter of bad input for spec files, the CLI, HTTP bodies and settings."""
    problems = []
    for e in errors:
        field = ".".join(str(p) for p in e["loc"])
        msg = re.sub(r"^(Value|Assertion) error, ", "", e["msg"])
        got = f" (got {e['input']!r})" if e["type"] not in ("value_error", "missing") and "input" in e else ""
        problems.append({"field": field, "message": msg + got})
    return problems


def format_validation_error(err: ValidationError) -> str:
    """One line per problem: 'field.path: message (got value)'; a cross-field rule names its
    fields in its message."""
    return "\n".join(f"{p['field']}: {p['message']}" if p["field"] else p["message"]
                     for p in validation_problems(err.errors()))  # fmt: skip


class SpecError(ValueError):
    """A study spec that does not validate; the message names every bad field."""


def parse_spec(data: Any, origin: str = "spec") -> StudySpec:
    try:
        return StudySpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"{origin}: invalid study spec\n{format_validation_error(e)}") from None


def resolve_hf_config(data: Any, base_dir: Path, origin: str = "spec") -> Any:
    """The spec (as data) with `model: {hf_config: path, **overrides}` replaced by the fields read
    from that config.json (tuner/hfconfig.py; a relative path is relative to `base_dir`, the spec
    file's folder), the overrides on top as on a preset's. Done where a spec file is read, so that
    what is stored or sent to a server holds the fields, never a path."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or "hf_config" not in model:
        return data
    overrides = {k: v for k, v in model.items() if k != "hf_config"}
    path = model["hf_config"]
    try:
        if overrides.get("preset") is not None:
            raise HFConfigError(f"give hf_config or preset ({overrides['preset']!r}), not both")
        if not isinstance(path, str) or not path:
            raise HFConfigError(f"expected the path of a config.json, got {path!r}")
        fields = read_hf_config(base_dir / Path(path).expanduser())
    except HFConfigError as e:
        raise SpecError(f"{origin}: invalid study spec\nmodel.hf_config: {e}") from None
    return {**data, "model": fields | overrides}


def read_spec_file(path: str | Path) -> Any:
    """A spec file's data, its model's hf_config read (resolve_hf_config)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from None
    return resolve_hf_config(data, path.parent, str(path))


def load_spec(path: str | Path) -> StudySpec:
    return parse_spec(read_spec_file(path), str(path))
