"""The memory oracle (trainer/memcheck.py): equal to a real CPU run's live-tensor peak on every
rank, and its micro-batch extrapolation equal to a full simulation."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tests.trainer.helpers import LATE_FREE_BYTES, TINY, assert_oracle_peaks, tiny_config
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.launch import run_local
from trainer.memcheck import (
    CATEGORIES,
    RankMemory,
    Simulation,
    Simulator,
    _cuda_kernels,
    default_ranks,
    extrapolation_points,
    memcheck,
    rank_of,
)
from trainer.metrics import LiveBytesTracker
from trainer.model import GPT, cross_entropy_loss

P = ParallelConfig

# Each layout on 2 or 4 ranks; together: TP with SP, 1F1B and interleaved pipelines, FSDP2 zero 3,
# replicated DP, full and selective checkpointing, gradient accumulation. (Not pp2 + zero 3 without
# recompute: there a real run's peak sometimes holds one more FSDP all-gather buffer, as gloo's
# thread finishes the previous all-gather late: +33,792 B on one rank in one of two runs.)
LAYOUTS = {
    "tp2-sp": P(tp=2, sequence_parallel=True, micro_batch_size=2, num_microbatches=2),
    "pp2-zero3-full-ac": P(
        pp=2, dp_shard=2, zero_stage=3, activation_checkpoint="full", micro_batch_size=2, num_microbatches=4
    ),
    "tp2-pp2-interleaved-sp": P(
        tp=2,
        pp=2,
        sequence_parallel=True,
        activation_checkpoint="selective",
        micro_batch_size=1,
        num_microbatches=4,
        pp_schedule="interleaved_1f1b",
        virtual_stages=2,
    ),
    "tp2-dp2-replicated": P(tp=2, dp_replicate=2, micro_batch_size=2, num_microbatches=2),
    # 2D tensor parallelism: the column-split stream crosses the pipeline boundary (b, s, h/tp_col)
    "col2-pp2": P(tp_col=2, pp=2, micro_batch_size=1, num_microbatches=4),
    "dp2-selective": P(
        dp_replicate=2, activation_checkpoint="selective", micro_batch_size=2, num_microbatches=2
    ),
}
# GPT's block on every layout but the last; the Llama block (RMSNorm, SwiGLU, rotary positions,
# GQA with one KV head per tp rank) on a 1D and a 2D tensor-parallel plan, a pipeline with FSDP2
# and full recompute, and replicated DP with selective recompute.
REAL_RUNS = [pytest.param("gpt-tiny", LAYOUTS[name], id=name) for name in list(LAYOUTS)[:-1]] + [
    pytest.param("llama-tiny", LAYOUTS[name], id=f"llama-{name}")
    for name in ("tp2-sp", "pp2-zero3-full-ac", "col2-pp2", "dp2-selective")
]


@pytest.mark.distributed
@pytest.mark.usefixtures("forked_ranks")
@pytest.mark.parametrize(("model", "parallel"), REAL_RUNS)
def test_the_oracle_equals_a_real_cpu_runs_peak_on_every_rank(
    model: str, parallel: ParallelConfig, tmp_path: Path
) -> None:
    cfg = tiny_config(parallel, model=MODEL_PRESETS[model], warmup_steps=2, measure_steps=1)
    real = run_local(cfg, tmp_path, timeout_s=300)
    assert real.status == "ok", real.error
    report = memcheck(cfg, ranks=range(parallel.world_size))
    assert_oracle_peaks([r.peak_bytes for r in report.ranks], real.peak_memory_bytes_per_rank)
    assert 0 <= real.peak_memory_bytes - report.peak_bytes <= LATE_FREE_BYTES


def test_the_breakdown_sums_to_the_peak_of_each_phase() -> None:
    cfg = tiny_config(
        P(pp=2, dp_shard=2, zero_stage=2, micro_batch_size=2, num_microbatches=2), device="cuda"
    )
    report = memcheck(cfg)
    assert [r.rank for r in report.ranks] == default_ranks(cfg.parallel) == [0, 2]
    for rank in report.ranks:
        assert set(rank.breakdown) == set(CATEGORIES)
        assert (
            rank.peak_bytes
            == sum(rank.breakdown.values())
            == max(sum(b.values()) for b in rank.phases.values())
        )
        assert rank.breakdown["parameters"] > 0 and rank.breakdown["optimizer"] > 0
    assert all(set(rank.phases) == {"forward_backward", "optimizer"} for rank in report.ranks)


@pytest.mark.oracle
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_a_micro_batch_more_adds_only_its_batch_rows(schedule: str) -> None:
    """trainer/pipeline.py: receive buffers live from their receive to their micro-batch's
    backward (torch allocates one per micro-batch and neighbour for the whole run), the last
    stage's losses let their graph go after their backward, and the interleaved schedule lets
    each send go once its receiver has it (torch: at the step's end). Past the warm-up a micro-
    batch more adds its rows of the batch (x and y, int64) and its loss (fp32), nothing else, on
    every rank: 4 more added 69 KiB (1F1B, last rank) and 397 KiB (interleaved) before. (So the
    last stage keeps no logits of finished micro-batches either: torch's schedule.step keeps them
    all to return them concatenated unless told not to, 331 GiB on a 1T layout with 1024 micro-
    batches; the trainer asks for none.)"""
    v = 2 if schedule == "interleaved_1f1b" else 1
    peaks = {}
    for n in (6, 8):  # past the warm-up: 3 pp interleaved, 2 pp - 1 with 1F1B (extrapolation_points)
        p = P(pp=2, micro_batch_size=2, num_microbatches=n, pp_schedule=schedule, virtual_stages=v)
        peaks[n] = [r.peak_bytes for r in memcheck(tiny_config(p, device="cuda"), ranks=[0, 1]).ranks]
    rows = 2 * 8 * 2 * TINY.seq_len  # x and y of a micro-batch of 2
    assert [b - a for a, b in zip(peaks[6], peaks[8], strict=True)] == [2 * rows, 2 * (rows + 4)]


@pytest.mark.oracle
@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param(P(pp=2, dp_shard=2, zero_stage=3, micro_batch_size=2, num_microbatches=6), id="1f1b"),
        pytest.param(
            P(
                pp=2,
                dp_replicate=2,
                micro_batch_size=1,
                num_microbatches=10,
                pp_schedule="interleaved_1f1b",
                virtual_stages=2,
            ),
            id="interleaved",
        ),
        pytest.param(
            P(
                dp_shard=2,
                zero_stage=2,
                activation_checkpoint="selective",
                micro_batch_size=1,
                num_microbatches=5,
            ),
            id="accumulation",
        ),
    ],
)
def test_extrapolated_microbatches_equal_a_full_simulation(parallel: ParallelConfig) -> None:
    """Each layout's count is two micro-batches past the second one simulated (extrapolation_points:
    (3, 4), (6, 8), (2, 3)): the extrapolation adds micro-batches it did not see, every phase of
    every step equal to the full simulation's."""
    cfg = tiny_config(parallel, device="cuda")
    assert extrapolation_points(parallel) is not None

    class Seen(Simulator):  # which simulations the extrapolation ran
        def run(self, sims: Sequence[Simulation]) -> list[RankMemory]:
            self.sims = list(sims)
            return super().run(sims)

    seen = Seen()
    extended, full = memcheck(cfg, extrapolate=True, simulator=seen), memcheck(cfg)
    assert extended.microbatches_simulated == extrapolation_points(parallel)
    n1, n2 = extended.microbatches_simulated
    # the second count for its first step only: later steps grow as the first did
    assert {(s.cfg.parallel.num_microbatches, s.steps) for s in seen.sims} == {(n1, 2), (n2, 1)}
    assert [r.phases for r in extended.ranks] == [r.phases for r in full.ranks]


def test_ranks_are_numbered_as_the_mesh_places_them() -> None:
    p = P(tp=2, pp=3, dp_shard=2, zero_stage=3, num_microbatches=3)
    assert rank_of(p, pp=2, dp_shard=1, tp=1) == 2 * 4 + 1 * 2 + 1
    assert default_ranks(p) == [0, 8] and default_ranks(p, all_stages=True) == [0, 4, 8]


def test_a_layout_the_trainer_refuses_is_refused() -> None:
    with pytest.raises(ValueError, match="tp \\(3\\) must divide num_heads"):
        memcheck(tiny_config(P(tp=3)))
    with pytest.raises(ValueError, match="extrapolate needs device 'cuda'"):
        memcheck(dataclasses.replace(tiny_config(P(pp=2, num_microbatches=8))), extrapolate=True)


class _Recounting(LiveBytesTracker):
    """Checks the incremental total against a recount after every op."""

    def _update(self) -> None:
        assert self._live == self._recount()
        super()._update()


def test_the_trackers_incremental_total_equals_a_recount() -> None:
    model = GPT(TINY)
    x = torch.randint(TINY.vocab_size, (2, TINY.seq_len))
    with _Recounting() as tracker:
        cross_entropy_loss(model(x), x).backward()
        buffer = torch.empty(1024)
        before = tracker.live_bytes()
        buffer.untyped_storage().resize_(0)  # how FSDP2 frees its all-gather buffers
        assert tracker.live_bytes() == before - 4096 == tracker._recount()
    assert tracker.peak_bytes > 0


def test_a_wrapper_subclass_counts_by_the_tensors_it_wraps() -> None:
    """A functional collective returns an AsyncCollectiveTensor in a real world: its own storage
    holds no data, its `elem` does."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    with LiveBytesTracker() as tracker:
        elem = torch.ones(256)
        wrapped = AsyncCollectiveTensor(elem)
        tracker.track_all([wrapped, wrapped.view(16, 16)])
        assert tracker.live_bytes() == 1024


@pytest.mark.oracle
def test_tensor_parallelism_without_data_parallelism_steps_fused_adamw() -> None:
    """The trainer's AdamW is fused (foreach on CUDA before issue 37); with tp and no dp the
    position embedding stays a plain tensor beside the DTensor shards, which one fused (or foreach)
    list cannot hold. The oracle steps AdamW as the trial does, so it fails where a trial would (it
    did before trainer.benchmark.optimizer_groups)."""
    for parallel in (P(tp=2, micro_batch_size=1, num_microbatches=2), P(tp=2, pp=2, num_microbatches=4)):
        report = memcheck(tiny_config(parallel, device="cuda"))
        assert all(r.breakdown["optimizer"] > 0 for r in report.ranks), parallel.describe()


def test_a_gpu_trials_rms_norm_keeps_what_cudas_fused_kernel_keeps() -> None:
    """On CUDA torch's rms_norm runs `_fused_rms_norm`, whose backward keeps the input, the fp32
    rstd and the weight; the CPU the oracle simulates on runs the composite, which keeps an fp32
    copy of the input and the normalised input besides. The oracle's GPU mode runs FusedRMSNorm:
    the composite's values and gradients, the fused kernel's saved tensors."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    g = torch.randn(2, 5, 16)
    expected = torch.nn.functional.rms_norm(x, [16], w, 1e-5)
    expected_grads = torch.autograd.grad(expected, (x, w), g)
    saved: list[torch.Tensor] = []
    with (
        _cuda_kernels(),
        torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t),
    ):
        out = torch.nn.functional.rms_norm(x, [16], w, 1e-5)
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out, (x, w), g), expected_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [((2, 5, 16), torch.float32), ((2, 5, 1), torch.float32),
                                                          ((16,), torch.float32)]  # fmt: skip
    assert saved[0] is x and saved[2] is w


@pytest.mark.oracle
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_layernorm_recompute_leaves_no_graph_behind_a_pipeline_step(device: str) -> None:
    """Megatron's layernorm recompute on a pipeline's first rank (trainer/moe.py
    recompute_without_output): after the step nothing of a micro-batch is left, as without it.
    While its saved-tensor hook kept the other saved tensors as themselves (not detached), one
    micro-batch's graph outlived the step (2.2 MB of activations at the optimizer step here,
    against 33 KB), so pp > 1 was refused until issue 37."""
    model = dataclasses.replace(MODEL_PRESETS["llama-tiny"], num_layers=4, seq_len=256)
    held = {}
    for ac in ("none", "layernorm"):
        p = P(pp=2, micro_batch_size=2, num_microbatches=2, activation_checkpoint=ac)
        rank = memcheck(tiny_config(p, model, device=device), ranks=[0]).ranks[0]
        held[ac] = [step["optimizer"]["activations"] for step in rank.steps] or [
            rank.phases["optimizer"]["activations"]
        ]
    assert held["layernorm"] == held["none"], held
