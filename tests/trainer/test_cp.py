"""Context parallelism (trainer/context_parallel.py): the head-tail split, attention over the
gathered K/V, the layout rules, and (gloo, `distributed`) loss and gradient-norm parity with one
process for cp alone and composed with TP + SP, FSDP2, a pipeline, activation checkpointing, GQA
and expert parallelism, plus the memory oracle on a cp layout.
"""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.trainer.helpers import (
    GLOBAL_BATCH,
    LLAMA,
    MODELS,
    TINY,
    assert_oracle_peaks,
    assert_valid_result,
    tiny_config,
)
from tests.trainer.test_parity import REL_TOL, assert_parity, reference_of
from trainer import model as model_module
from trainer.benchmark import run
from trainer.context_parallel import (
    CPComm,
    head_tail_chunks,
    local_positions,
    released_after,
    sequence_order,
    shard_sequence,
)
from trainer.contract.parallel import ParallelConfig
from trainer.contract.result import BenchmarkConfig, trainer_problems
from trainer.contract.topology import axis_strides, groups
from trainer.launch import run_local
from trainer.memcheck import memcheck
from trainer.model import GPT, cross_entropy_loss

P = ParallelConfig


def _comm(cp: int, rank: int, seq_len: int) -> CPComm:
    """A rank's CPComm without a process group (attention and positions only)."""
    return CPComm(group=None, size=cp, rank=rank, seq_len=seq_len)  # type: ignore[arg-type]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_head_tail_split_covers_the_sequence_and_balances_causal_work(cp: int) -> None:
    seq = 32
    positions = [local_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(positions).tolist()) == list(range(seq))
    assert all(len(p) == seq // cp for p in positions)
    # Query i scores i + 1 keys under the causal mask: every rank the same number of pairs.
    work = {int((p + 1).sum()) for p in positions}
    assert len(work) == 1
    if cp == 2:
        assert head_tail_chunks(0, 2) == (0, 3) and head_tail_chunks(1, 2) == (1, 2)
        assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
        assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    tokens = torch.arange(seq).repeat(3, 1)
    for r, p in enumerate(positions):
        assert torch.equal(shard_sequence(tokens, cp, r), tokens[:, p])


def test_a_plain_split_would_not_balance() -> None:
    """The reason for head-tail: contiguous quarters give the last rank 6.3 x the first's pairs
    (2cp - 1 = 7 x as the chunks grow)."""
    seq, cp = 32, 4
    quarters = [torch.arange(r * seq // cp, (r + 1) * seq // cp) for r in range(cp)]
    work = [int((q + 1).sum()) for q in quarters]
    assert work == [36, 100, 164, 228]


@pytest.mark.parametrize("cp", [2, 4])
def test_gathered_chunks_go_back_in_sequence_order_and_attention_is_causal(cp: int) -> None:
    """Each rank's local queries against the gathered K/V equal rows of full causal attention."""
    torch.manual_seed(0)
    seq = 32
    q, k, v = (torch.randn(2, 3, seq, 8) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    gathered = torch.stack([shard_sequence(k, cp, r, dim=2) for r in range(cp)])
    assert torch.equal(sequence_order(gathered), k)
    for r in range(cp):
        pos = local_positions(seq, cp, r)
        got = _comm(cp, r, seq).attention(q[:, :, pos], k, v, 0.0)
        assert torch.allclose(got, want[:, :, pos], atol=1e-6), r


@pytest.mark.parametrize("model", [TINY, LLAMA], ids=["learned", "rope"])
def test_positions_follow_the_tokens(model) -> None:
    """A model holding a rank's tokens (set_positions) gives that rank's rows of the whole
    model's logits when attention sees every rank's K/V (here: emulated in one process)."""
    torch.manual_seed(0)
    full = GPT(model)
    full.init_weights(torch.Generator().manual_seed(0))
    x = torch.randint(0, model.vocab_size, (2, model.seq_len))
    want = full(x)
    cp, rank = 2, 1
    pos = local_positions(model.seq_len, cp, rank)
    part = GPT(model)
    part.load_state_dict(full.state_dict())
    part.set_positions(pos)
    # Keys and values of every position: run the full model's k/v through the local attention.
    captured = []
    for block, ref in zip(part.layers.values(), full.layers.values(), strict=True):
        ref.attn.core.register_forward_hook(lambda m, args, out: captured.append(args))
        block.attn.core.cp = _comm(cp, rank, model.seq_len)
    full(x)
    it = iter(captured)

    def core_forward(self, q, k, v):
        _, k_all, v_all = next(it)
        return self.cp.attention(q, k_all, v_all, 0.0)

    original = model_module.CoreAttention.forward
    model_module.CoreAttention.forward = core_forward
    try:
        got = part(x[:, pos])
    finally:
        model_module.CoreAttention.forward = original
    assert torch.allclose(got, want[:, pos], atol=1e-5)


def test_cp_in_the_layout_contract() -> None:
    p = P(cp=2, dp_shard=2, zero_stage=3, micro_batch_size=4)
    assert p.world_size == 4 and p.global_batch_size == 8 and p.edp == 4
    assert p.describe() == "tp1 pp1 dps2(z3) mbs4x1 cp2"
    assert p.to_dict()["cp"] == 2 and P.from_dict(p.to_dict()) == p
    plain = P(dp_shard=2, zero_stage=3, micro_batch_size=4)
    assert "cp" not in plain.to_dict() and plain.describe() == "tp1 pp1 dps2(z3) mbs4x1"
    cfg = tiny_config(p)
    assert cfg.to_dict()["parallel"]["cp"] == 2 and BenchmarkConfig.from_json(cfg.to_json()) == cfg
    assert "cp" not in tiny_config(plain).to_dict()["parallel"]
    # Mesh order [pp, dp_replicate, dp_shard, cp, tp]: cp ranks at stride tp, dp x cp one block.
    q = P(tp=2, cp=2, dp_shard=2, zero_stage=2)
    assert axis_strides(q)["cp"] == 2 and axis_strides(q)["dp_shard"] == 4
    assert groups(q, "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(q, "dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups(q, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(
    ("layout", "model", "message"),
    [
        (P(cp=3), TINY, "cp (3) needs seq_len (32) divisible by 2 x cp (6)"),
        (P(cp=0), TINY, "cp must be >= 1, got 0"),
        (P(cp=2, tp=2, tp_col=2), TINY, "cp (2) > 1 with tp_col (2) > 1 is not implemented"),
        (
            P(cp=2, tp=4, sequence_parallel=True),
            dataclasses.replace(TINY, seq_len=36, num_heads=4),
            "tp (4) must divide seq_len / cp (36 / 2 = 18)",
        ),
        (P(cp=2, ep=8), MODELS["moe"], "ep (8) must divide dp_replicate x dp_shard x cp x tp (2)"),
    ],
)
def test_what_the_layout_rules_refuse(layout: ParallelConfig, model, message: str) -> None:
    problems = layout.problems(model)
    assert any(message in p for p in problems), problems


def test_valid_cp_layouts_have_no_problems() -> None:
    for layout in (P(cp=4), P(cp=2, ep=2), P(cp=2, tp=2, sequence_parallel=True, ep=4)):
        assert layout.problems(MODELS["moe"]) == []


def test_what_the_trainer_refuses() -> None:
    cfg = tiny_config(P(cp=2, micro_batch_size=8), compile=True)
    reason = "compile with cp (2) > 1 is not supported"
    assert any(reason in p for p in trainer_problems(cfg))
    result = run(cfg)
    assert result.status == "invalid" and reason in result.error


def test_the_parity_tolerance_catches_a_wrong_cp_reduction() -> None:
    """K/V gradients left where they were computed instead of sent back to their owners (the
    all_to_all of GatherSequence's backward dropped: each rank keeps the gradient its own queries
    give its own keys) move the step-1 gradient norm far past REL_TOL. Emulated in one process:
    rank r's queries see the other ranks' keys and values detached. The right emulation (nothing
    detached) equals one process's norm, so the emulation itself is faithful. Measured: 0.19 %
    off on gpt-tiny, 19 x REL_TOL."""
    cp, model = 2, TINY
    x = torch.randint(
        0, model.vocab_size, (GLOBAL_BATCH, model.seq_len), generator=torch.Generator().manual_seed(0)
    )
    owner = torch.zeros(model.seq_len, dtype=torch.long)
    for r in range(cp):
        owner[local_positions(model.seq_len, cp, r)] = r

    def norm(emulate: bool, wrong: bool) -> float:
        net = GPT(model)
        net.init_weights(torch.Generator().manual_seed(0))

        def core_forward(self, q, k, v):
            out = torch.empty_like(q)
            for r in range(cp):
                pos = local_positions(model.seq_len, cp, r)
                mine = (owner == r).view(1, 1, -1, 1)
                kr, vr = (torch.where(mine, t, t.detach()) if wrong else t for t in (k, v))
                out[:, :, pos] = _comm(cp, r, model.seq_len).attention(q[:, :, pos], kr, vr, 0.0)
            return out

        original = model_module.CoreAttention.forward
        if emulate:
            model_module.CoreAttention.forward = core_forward
        try:
            cross_entropy_loss(net(x), x).backward()
        finally:
            model_module.CoreAttention.forward = original
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()])))

    right = norm(emulate=False, wrong=False)
    assert abs(norm(emulate=True, wrong=False) - right) / right < 1e-5
    assert abs(norm(emulate=True, wrong=True) - right) / right > 10 * REL_TOL


# (id, model, layout) with global batch 8.
CASES = [
    ("cp2", "gpt", P(cp=2, micro_batch_size=8)),
    ("cp4", "gpt", P(cp=4, micro_batch_size=8)),
    ("llama-cp2-tp2-sp", "llama", P(cp=2, tp=2, sequence_parallel=True, micro_batch_size=8)),
    ("cp2-dps2-zero3", "gpt", P(cp=2, dp_shard=2, zero_stage=3, micro_batch_size=4)),
    # FSDP2 over the cp ranks alone (dp_shard 1), as torchtitan shards over dp_shard x cp
    ("cp2-zero3-over-cp", "gpt", P(cp=2, zero_stage=3, micro_batch_size=8)),
    (
        "llama-cp4-zero2-over-cp-pp2",
        "llama",
        P(cp=4, pp=2, zero_stage=2, micro_batch_size=2, num_microbatches=4),
    ),
    ("llama-cp2-pp2", "llama", P(cp=2, pp=2, micro_batch_size=2, num_microbatches=4)),
    ("cp2-ac-full", "gpt", P(cp=2, activation_checkpoint="full", micro_batch_size=8)),
    # activation offload: the gathered keys and values make the round trip, the cached masks stay
    ("llama-cp2-offload", "llama", P(cp=2, activation_checkpoint="offload", micro_batch_size=8)),
    ("llama-cp2-gqa-ac-selective", "llama", P(cp=2, activation_checkpoint="selective", micro_batch_size=8)),
    ("moe-cp2-ep2", "moe", P(cp=2, ep=2, micro_batch_size=8)),
    # replicated over the flattened dp_replicate x cp axis, all-reduced once after accumulation
    ("cp2-dpr2-accum2", "gpt", P(cp=2, dp_replicate=2, micro_batch_size=2, num_microbatches=2)),
    # HSDP over cp alone: FSDP2 shards over the cp ranks, replicated over dp_replicate (a 2D mesh)
    ("llama-hsdp-dpr2-cp2-zero3", "llama", P(cp=2, dp_replicate=2, zero_stage=3, micro_batch_size=4)),
    # ep folded over cp x tp: each expert's tokens come from both cp halves and both SP quarters
    ("moe-cp2-tp2-sp-ep4", "moe", P(cp=2, tp=2, sequence_parallel=True, ep=4, micro_batch_size=8)),
    # DeepSeek's router: the sequence-wise auxiliary loss counted over the cp x tp ranks of each
    # sequence, the expert bias from the stage's dp x cp x tp counts
    ("moe-ds-cp2-tp2-sp-ep2", "moe-ds", P(cp=2, tp=2, sequence_parallel=True, ep=2, micro_batch_size=8)),
]


@pytest.mark.distributed
@pytest.mark.usefixtures("forked_ranks")
@pytest.mark.parametrize(("name", "model", "layout"), CASES, ids=[c[0] for c in CASES])
def test_context_parallel_parity(name: str, model: str, layout: ParallelConfig, tmp_path: Path) -> None:
    assert layout.global_batch_size == GLOBAL_BATCH
    cfg = tiny_config(layout, MODELS[model])
    result = run_local(cfg, tmp_path, timeout_s=300)
    assert_valid_result(result, cfg)
    reference = reference_of(model)
    assert_parity(name, result, reference)
    if "aux_loss" in reference.moe:  # the auxiliary loss of whole sequences, over the cp x tp ranks
        assert result.moe["aux_loss"] == pytest.approx(reference.moe["aux_loss"], rel=REL_TOL)


# The oracle on cp layouts: the gathered K/V and their all_to_all backward, and a pipeline's stage
# boundary of seq_len / cp tokens (trainer/fakeworld.py). Equal to the byte on every rank (also
# measured: cp2 + FSDP2 zero3 + full AC and cp2 + tp2 + sp, docs/parallelism.md).
ORACLE = [
    ("cp2", P(cp=2, micro_batch_size=2, num_microbatches=2)),
    ("cp2-pp2", P(cp=2, pp=2, micro_batch_size=1, num_microbatches=4)),
]


@pytest.mark.distributed
@pytest.mark.usefixtures("forked_ranks")
@pytest.mark.parametrize(("name", "parallel"), ORACLE, ids=[c[0] for c in ORACLE])
def test_the_oracle_equals_a_real_cp_runs_peak(name: str, parallel: ParallelConfig, tmp_path: Path) -> None:
    cfg = tiny_config(parallel, LLAMA, warmup_steps=2, measure_steps=1)
    real = run_local(cfg, tmp_path, timeout_s=300)
    assert real.status == "ok", real.error
    report = memcheck(cfg, ranks=range(parallel.world_size))
    assert_oracle_peaks([r.peak_bytes for r in report.ranks], real.peak_memory_bytes_per_rank)


def _free_on_the_caller(rank: int, store_path: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        late = 0
        for _ in range(300):
            received, sent = torch.empty(2, 64), torch.randn(2, 64)
            freed: list[bool] = []
            weakref.finalize(received.untyped_storage(), freed.append, True)
            with released_after(received, sent):
                dist.all_to_all_single(received, sent)
            del received  # the last reference, if gloo's worker has let go of it
            late += not freed
        # Without the wait about a quarter outlive it (~75 of 300); with it, 1 of 300 still did on
        # 2026-12-05 (a clean-clone make test, and once more beside it): a rarer race the wait's
        # use counts do not see, left open (issue 36's note). 3 keeps the test failing without it.
        assert late <= 3, f"rank {rank}: {late} of 300 buffers outlived the call on gloo's worker thread"
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_a_collectives_buffers_are_freed_by_the_caller(tmp_path: Path) -> None:
    """gloo's worker thread wakes the caller before it drops its references to a collective's
    tensors (about a quarter of all_to_all calls on this VM); a temporary the caller then drops
    would be freed on that thread whenever it runs, and a CPU rank's measured peak would depend
    on the scheduler (a CI run's cp2-pp2 oracle test: one rank 2 KiB over). The CP gather waits
    for them (trainer/context_parallel.py released_after)."""
    torch.multiprocessing.spawn(_free_on_the_caller, args=(str(tmp_path / "store"),), nprocs=2)
