"""The sampler contract, run over all seven samplers."""

from __future__ import annotations

import gc
import math
import tempfile
from pathlib import Path

import pytest

from trainer.contract.model import ModelConfig
from tuner.hardware import cluster_preset
from tuner.outcome import FailureKind, Outcome
from tuner.perfconstants import ModelConstants
from tuner.perfmodel import estimate
from tuner.pricing import Pricing
from tuner.samplers import SAMPLERS, make_sampler
from tuner.space import SearchSpace
from tuner.spec import ClusterSpec, SpaceSpec

# optuna's GP sampler refits its Gaussian process on every ask (~20 s for a small space here).
# GP and deephyper's CBO refit their surrogate on every ask (seconds a drive): in make test only.
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in ("gp", "cbo") else n for n in SAMPLERS]
# GP's drives are shorter (each ask refits, seconds each on 2 cores), still well past its 5 random
# startup trials (tuner/samplers/external.py), so the surrogate proposes most of them.
LONG = {"gp": 12}

MODEL = ModelConfig(num_layers=8, hidden_size=256, num_heads=8, vocab_size=1024, seq_len=128)
CLUSTER = ClusterSpec(**{**cluster_preset("a100-80gb"), "device_memory_gb": 0.4, "num_nodes": 1})
SPACE = SpaceSpec(tp=[1, 2, 4], pp=[1, 2], micro_batch_size=[1, 2, 4], zero_stage=[0, 2, 3],
                  activation_checkpoint=["none", "full"], sequence_parallel=[False, True], pp_schedule=["1f1b"])  # fmt: skip
CANDIDATES = SearchSpace(MODEL, 8, 8, 16, SPACE).enumerate().valid
SMALL = [
    c
    for c in CANDIDATES
    if c.zero_stage == 0 and c.activation_checkpoint == "none" and not c.sequence_parallel
]
# The "truth" the samplers face: the model with other constants, and a memory limit that the
# uncalibrated model does not know about (OOM above it).
TRUTH = ModelConstants(
    compute_efficiency=0.3, comm_efficiency=0.4, layer_floor_s=5e-4, microbatch_overhead_s=1e-3
)
MEMORY_LIMIT = sorted(estimate(MODEL, c, CLUSTER, "bf16", TRUTH).memory_bytes for c in CANDIDATES)[
    len(CANDIDATES) // 2
]


def run_trial(config) -> Outcome:
    est = estimate(MODEL, config, CLUSTER, "bf16", TRUTH)
    if est.memory_bytes > MEMORY_LIMIT:
        return Outcome.failed(FailureKind.OOM, "out of memory")
    return Outcome(ok=True, tokens_per_s=est.tokens_per_s, step_time_s=est.step_time_s)


def make(name: str, candidates=CANDIDATES, seed: int = 0):
    return make_sampler(
        name, candidates, seed=seed, pricing=Pricing(MODEL, CLUSTER, "bf16", ModelConstants())
    )


def drive(sampler, n: int) -> list:
    out = []
    for _ in range(n):
        c = sampler.ask()
        if c is None:
            break
        out.append(c)
        sampler.tell(c, run_trial(c))
    return out


def test_space_is_big_enough_to_mean_something() -> None:
    assert len(CANDIDATES) > 100 and 6 <= len(SMALL) <= 20


@pytest.mark.parametrize("name", NAMES)
def test_valid_and_never_repeated(name: str) -> None:
    n = LONG.get(name, 25)
    proposed = drive(make(name), n)
    assert len(proposed) == n and len(set(proposed)) == n
    assert all(c in CANDIDATES for c in proposed)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_per_seed(name: str) -> None:
    n = 9 if name in LONG else 12
    assert drive(make(name, seed=3), n) == drive(make(name, seed=3), n)


@pytest.mark.parametrize("name", NAMES)
def test_exhausts_a_small_space_exactly(name: str) -> None:
    # optuna's GP refits at every ask: half the space (all 16 took 46 s of make test's 2 cores)
    space = SMALL[::2] if name in LONG else SMALL
    sampler = make(name, space)
    proposed = drive(sampler, len(space) + 5)
    assert sorted(map(str, proposed)) == sorted(map(str, space))
    assert sampler.ask() is None


@pytest.mark.parametrize("name", NAMES)
def test_replayed_oom_layouts_are_never_proposed_again(name: str) -> None:
    """A sampler rebuilt from the database after a restart: finished trials (OOMs included) and
    pending ones are never proposed again."""
    first = make(name)
    history = drive(first, 10)
    pending = first.ask()
    ooms = [c for c in history if not run_trial(c).ok]
    rebuilt = make(name)
    for c in history:
        rebuilt.replay(c, run_trial(c))
    rebuilt.replay(pending, None)
    later = drive(rebuilt, 6 if name in LONG else 15)
    assert not set(later) & (set(history) | {pending})
    assert not set(later) & set(ooms)


def _surprised(sampler, factor: float, n: int) -> list[float]:
    """Tell `sampler` n results `factor` times the speed it predicted; its sigma after each."""
    sigmas = []
    for _ in range(n):
        c = sampler.ask()
        tokens_per_s = math.exp(sampler.log_tps[c]) * factor
        step_time_s = c.global_batch_size * MODEL.seq_len / tokens_per_s
        sampler.tell(c, Outcome(ok=True, tokens_per_s=tokens_per_s, step_time_s=step_time_s))
        sigmas.append(sampler.sigma)
    return sigmas


def test_model_exploration_bonus_shrinks_as_the_model_stops_being_surprised() -> None:
    """sigma pools the prior spread with each trial's surprise (measured / predicted before it):
    right predictions shrink it, wrong ones grow it."""
    from tuner.samplers.model import PRIOR_SIGMA

    right = _surprised(make("model"), 1.0, 8)
    assert right == sorted(right, reverse=True) and right[-1] < PRIOR_SIGMA / 2
    wrong = _surprised(make("model"), 2.0, 1)
    assert wrong[0] > PRIOR_SIGMA


def test_model_starts_from_the_device_kinds_defaults() -> None:
    from tuner.perfconstants import CPU_CONSTANTS, default_constants

    cpu = ClusterSpec(**{**cluster_preset("cpu-local"), "gpus_per_node": 8, "cores_per_node": 2})
    sampler = make_sampler("model", CANDIDATES, pricing=Pricing(MODEL, cpu, "fp32", default_constants(cpu)))
    assert sampler.initial.constants == CPU_CONSTANTS
    assert make("model").initial.constants == ModelConstants()


def test_cbo_removes_its_log_directory_when_dropped() -> None:
    """The sampler's own directory (not a scan of the shared temp dir, where another process's
    sampler may be making one at the same moment: a clean clone's make test once found two)."""
    sampler = make("cbo")
    made = Path(sampler._log_dir.name)
    assert made.is_dir() and made.parent == Path(tempfile.gettempdir()) and made.name.startswith("cbo-")
    del sampler
    gc.collect()
    assert not made.exists()
