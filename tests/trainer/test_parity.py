"""Loss parity: every layout trains the same model on the same global batch, so its losses and
gradient norm must match one process holding everything. This is what proves the parallelism is
real: a rank that skipped its share of a reduction, a wrong shard or a lost micro-batch moves
these numbers far beyond fp32 rounding.

Multi-rank layouts run for real: `python -m trainer.benchmark` under torchrun, gloo on CPU. The GPT
runs every layout; the Llama family (tests/trainer/helpers.py MODELS) the layouts that split it
differently: GQA's KV heads under TP, SwiGLU, rotary positions under SP and pipelining, a tied
head under TP, FSDP2 and across pipeline stages, Qwen2's q/k/v bias.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.trainer.helpers import GLOBAL_BATCH, MODELS, assert_valid_result, tiny_config
from trainer.benchmark import run
from trainer.contract.parallel import ParallelConfig
from trainer.contract.result import BenchmarkResult
from trainer.launch import run_local

REL_TOL = 1e-4
P = ParallelConfig

# (id, layout): global batch 8 everywhere.
LAYOUTS = [
    ("tp2", P(tp=2, micro_batch_size=8)),
    ("tp2-sp", P(tp=2, sequence_parallel=True, micro_batch_size=8)),
    ("pp2-gpipe", P(pp=2, pp_schedule="gpipe", micro_batch_size=2, num_microbatches=4)),
    ("pp2-1f1b", P(pp=2, pp_schedule="1f1b", micro_batch_size=2, num_microbatches=4)),
    (
        "pp2-interleaved-v2",
        P(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2, micro_batch_size=2, num_microbatches=4),
    ),
    # the V schedules (two stages a rank, the backward split in its input and weight halves) under
    # FSDP2: the weight half finds the unsharded weights (trainer/pipeline.py graph_params)
    (
        "pp2-zbv-dp2-zero3",
        P(
            pp=2,
            dp_shard=2,
            zero_stage=3,
            pp_schedule="zbv",
            virtual_stages=2,
            micro_batch_size=1,
            num_microbatches=4,
        ),
    ),
    ("dp2-replicate", P(dp_replicate=2, micro_batch_size=4)),
    ("dp2-replicate-accum2", P(dp_replicate=2, micro_batch_size=2, num_microbatches=2)),
    ("dp2-shard-zero2", P(dp_shard=2, zero_stage=2, micro_batch_size=4)),
    # ZeRO-2 over two micro-batches: reduce-scatters each, gathers again each (test_gathers.py)
    ("dp2-shard-zero2-accum2", P(dp_shard=2, zero_stage=2, micro_batch_size=2, num_microbatches=2)),
    ("dp2-shard-zero3", P(dp_shard=2, zero_stage=3, micro_batch_size=4)),
    ("tp2-pp2", P(tp=2, pp=2, micro_batch_size=2, num_microbatches=4)),
    ("tp2-dp2", P(tp=2, dp_shard=2, zero_stage=2, micro_batch_size=4)),
    ("pp2-dp2", P(pp=2, dp_replicate=2, micro_batch_size=1, num_microbatches=4)),
    ("hsdp-2x2", P(dp_replicate=2, dp_shard=2, zero_stage=3, micro_batch_size=2)),
    ("tp2-pp2-dp2", P(tp=2, pp=2, dp_shard=2, zero_stage=3, micro_batch_size=2, num_microbatches=2)),
    (
        "tp2-pp2-dp2-sp-full",
        P(
            tp=2,
            pp=2,
            dp_shard=2,
            zero_stage=3,
            sequence_parallel=True,
            activation_checkpoint="full",
            micro_batch_size=2,
            num_microbatches=2,
        ),
    ),
    # activation offload: tensor parallelism's DTensors and FSDP2's gathered weights under its
    # saved-tensor hooks (trainer/offload.py; the gathered weights stay, the rest makes the round trip)
    (
        "tp2-dp2-sp-zero3-offload",
        P(
            tp=2,
            dp_shard=2,
            zero_stage=3,
            sequence_parallel=True,
            activation_checkpoint="offload",
            micro_batch_size=4,
        ),
    ),
    ("ac-full", P(activation_checkpoint="full", micro_batch_size=8)),
    ("ac-selective", P(activation_checkpoint="selective", micro_batch_size=8)),
    ("ac-op", P(activation_checkpoint="op", micro_batch_size=8)),  # torchtitan's op-level policy
    # op-level over tp: the reduce-scatters kept, the all-gathers run again
    (
        "tp2-dp2-sp-ac-op",
        P(
            tp=2,
            dp_shard=2,
            zero_stage=3,
            sequence_parallel=True,
            activation_checkpoint="op",
            micro_batch_size=4,
        ),
    ),
    ("accum4-vs-big-batch", P(micro_batch_size=2, num_microbatches=4)),
]
# (id, model, layout): the Llama family (llama-tiny: 4 query heads, 2 KV heads), global batch 8.
FAMILY_LAYOUTS = [
    ("llama-tp2", "llama", P(tp=2, micro_batch_size=8)),  # one KV head per rank
    # ... on a pipeline (refused until issue 37: its saved-tensor hook kept a micro-batch's graph)
    (
        "llama-pp2-ac-layernorm",
        "llama",
        P(pp=2, activation_checkpoint="layernorm", micro_batch_size=4, num_microbatches=2),
    ),
    # Megatron's layernorm recompute: the norms' all-gathered outputs left out, gathered again
    (
        "llama-tp2-dp2-sp-ac-layernorm",
        "llama",
        P(
            tp=2,
            dp_shard=2,
            zero_stage=2,
            sequence_parallel=True,
            activation_checkpoint="layernorm",
            micro_batch_size=4,
        ),
    ),
    ("qwen-tp2-sp", "qwen", P(tp=2, sequence_parallel=True, micro_batch_size=8)),  # bias split with its rows
    (
        "llama-tp2-sp-pp2-interleaved-v2",
        "llama",
        P(
            tp=2,
            sequence_parallel=True,
            pp=2,
            pp_schedule="interleaved_1f1b",
            virtual_stages=2,
            micro_batch_size=2,
            num_microbatches=4,
        ),
    ),
    (
        "llama-fsdp2-zero3-ac-full",
        "llama",
        P(dp_shard=2, zero_stage=3, activation_checkpoint="full", micro_batch_size=4),
    ),
    ("llama-ac-selective", "llama", P(activation_checkpoint="selective", micro_batch_size=8)),
    (
        "llama-tp2-pp2-ac-op",
        "llama",
        P(tp=2, pp=2, activation_checkpoint="op", micro_batch_size=2, num_microbatches=4),
    ),
    # Latent attention without experts (DeepSeek's with experts: tests/trainer/test_moe.py): tp
    # without sequence parallelism, the latents' input a plain tensor
    ("mla-dense-tp2-dps2", "mla-dense", P(tp=2, dp_shard=2, zero_stage=3, micro_batch_size=4)),
    # A tied head: one Parameter under TP and FSDP2; across stages a copy on the first and the last,
    # their gradients summed (and counted once in the norm), also when interleaved.
    ("llama-tied-tp2-fsdp2", "llama-tied", P(tp=2, dp_shard=2, zero_stage=2, micro_batch_size=4)),
    ("llama-tied-pp2", "llama-tied", P(pp=2, micro_batch_size=2, num_microbatches=4)),
    ("llama-tied-pp4", "llama-tied", P(pp=4, micro_batch_size=2, num_microbatches=4)),  # a group of 2 of 4
    # a V schedule: the tied copies on one rank (the first and the last stage)
    (
        "llama-tied-pp2-dualpipev",
        "llama-tied",
        P(pp=2, pp_schedule="dualpipev", virtual_stages=2, micro_batch_size=2, num_microbatches=4),
    ),
    (
        "llama-tied-tp2-pp2-interleaved-v2",
        "llama-tied",
        P(
            tp=2,
            pp=2,
            pp_schedule="interleaved_1f1b",
            virtual_stages=2,
            micro_batch_size=2,
            num_microbatches=4,
        ),
    ),
]
# Every case as (id, model, layout).
CASES = [(name, "gpt", layout) for name, layout in LAYOUTS] + FAMILY_LAYOUTS
_CASES = {name: (model, layout) for name, model, layout in CASES}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory):
    """Run a named case once per module; later tests reuse the result."""
    cache: dict[str, BenchmarkResult] = {}

    def get(name: str) -> BenchmarkResult:
        if name not in cache:
            model, layout = _CASES[name]
            cfg = tiny_config(layout, MODELS[model])
            work = tmp_path_factory.mktemp(name)
            if cfg.parallel.world_size == 1:  # same code path, no launcher needed
                cache[name] = run(cfg, work / "result.json")
            else:
                cache[name] = run_local(cfg, work, timeout_s=300)
        return cache[name]

    return get


@functools.cache
def reference_of(model: str) -> BenchmarkResult:
    """One process, the whole global batch in one micro-batch (once per test session)."""
    result = run(tiny_config(P(micro_batch_size=GLOBAL_BATCH), MODELS[model]))
    assert result.status == "ok", result.error
    return result


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_reference_trains(model: str) -> None:
    losses = reference_of(model).losses
    assert losses[0] > losses[1] > losses[2]


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def assert_parity(name: str, result: BenchmarkResult, reference: BenchmarkResult) -> None:
    """Every step's loss and the step-1 gradient norm within REL_TOL of one process's."""
    for step, (got, want) in enumerate(zip(result.losses, reference.losses, strict=True), start=1):
        assert _relative(got, want) < REL_TOL, f"{name}: loss at step {step} is {got}, reference {want}"
    assert _relative(result.grad_norms[0], reference.grad_norms[0]) < REL_TOL, (
        f"{name}: step-1 gradient norm {result.grad_norms[0]}, reference {reference.grad_norms[0]}"
    )


@pytest.mark.distributed
@pytest.mark.usefixtures("forked_ranks")
@pytest.mark.parametrize(("name", "model", "layout"), CASES, ids=[n for n, _, _ in CASES])
def test_loss_parity(name: str, model: str, layout: ParallelConfig, measured) -> None:
    assert layout.global_batch_size == GLOBAL_BATCH
    cfg = tiny_config(layout, MODELS[model])
    result = measured(name)
    assert_valid_result(result, cfg)
    assert_parity(name, result, reference_of(model))


@pytest.mark.distributed
@pytest.mark.usefixtures("forked_ranks")
@pytest.mark.parametrize(
    ("smaller", "larger"),
    [
        ("dp2-shard-zero3", "dp2-replicate"),  # parameters, gradients and Adam state sharded
        ("pp2-1f1b", "pp2-gpipe"),  # 1F1B holds at most pp micro-batches of activations
        ("ac-full", "ac-selective"),  # full recompute keeps only block inputs
        ("ac-full", "ac-op"),  # op-level keeps half the matmuls' outputs besides
        ("ac-op", "ac-selective"),  # ... and no norm, activation or rotation
    ],
)
def test_peak_memory_follows_the_layout(smaller: str, larger: str, measured) -> None:
    """The CPU memory measurement sees what each technique saves."""
    assert measured(smaller).peak_memory_bytes < measured(larger).peak_memory_bytes


def test_cpu_peak_memory_is_repeatable_and_covers_training_state(tmp_path) -> None:
    cfg = tiny_config(P(micro_batch_size=GLOBAL_BATCH))
    a, b = run(cfg), run(cfg)
    assert a.peak_memory_bytes == b.peak_memory_bytes
    # fp32 params + grads + two AdamW moments = 16 bytes per parameter, plus activations.
    assert a.peak_memory_bytes > 16 * cfg.model.num_params


@pytest.mark.distributed
@pytest.mark.usefixtures("forked_ranks")
def test_bf16_gradient_reduction_trains_close_to_fp32(tmp_path: Path) -> None:
    """BenchmarkConfig.grad_reduce_dtype bf16 (Megatron's --grad-reduce-in-bf16): replicated data
    parallelism accumulating two micro-batches reduces and accumulates in bf16. The first step's
    loss is the same (no update yet); the gradient norm and the later losses within bf16's
    rounding of the fp32 reduction's (a relative 1e-2), not equal to them."""
    layout = P(dp_replicate=2, micro_batch_size=2, num_microbatches=2)
    runs = {}
    for dtype in ("fp32", "bf16"):
        cfg = tiny_config(layout, grad_reduce_dtype=dtype)
        runs[dtype] = run_local(cfg, tmp_path / dtype, timeout_s=300)
        assert runs[dtype].status == "ok", runs[dtype].error
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert bf16.losses[0] == fp32.losses[0]
    assert 0 < _relative(bf16.grad_norms[0], fp32.grad_norms[0]) < 1e-2
    assert all(_relative(a, b) < 1e-2 for a, b in zip(bf16.losses, fp32.losses, strict=True))
