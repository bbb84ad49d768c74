"""The old home of the trainer's contract, kept as aliases for one release: import from
trainer/contract/ instead (model, parallel, presets, result). Nothing in this repository imports it."""

from __future__ import annotations

from trainer.contract.model import (  # noqa: F401
    ATTENTIONS,
    MLP_KINDS,
    NORMS,
    POSITIONS,
    QK_NORMS,
    ROUTER_SCORES,
    GPTConfig,
    ModelConfig,
)
from trainer.contract.parallel import ActivationCheckpoint, ParallelConfig, PipelineSchedule  # noqa: F401
from trainer.contract.presets import MODEL_PRESETS  # noqa: F401
from trainer.contract.result import BenchmarkConfig, BenchmarkResult, Status, trainer_problems  # noqa: F401
from trainer.contract.rules import ACTIVATION_CHECKPOINTS, PIPELINE_SCHEDULES, ZERO_STAGES  # noqa: F401
