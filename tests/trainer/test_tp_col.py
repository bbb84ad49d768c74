"""2D tensor parallelism (trainer/tp2d.py): the column axis tp_col, alone and with every other
technique, trains the same GPT as one process (loss and gradient-norm parity, test_parity.py's
tolerance), and the Llama family too (RMSNorm, SwiGLU, GQA, q/k/v bias, a tied head); its
collectives are AxoNN's, one all-reduce per layer each way on the right group; its mesh follows the
placement rule (trainer/contract/topology.py)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.trainer.helpers import GLOBAL_BATCH, MODELS, TINY, assert_valid_result, tiny_config
from tests.trainer.test_parity import assert_parity, reference_of
from trainer import tp2d
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from trainer.contract.result import BenchmarkResult
from trainer.contract.topology import expected_spans, groups
from trainer.launch import run_local
from trainer.model import GPT
from trainer.parallel_dims import ParallelDims
from trainer.parallelize import parallelize_gpt

P = ParallelConfig

# (id, layout): global batch 8 everywhere; row x column written tp x tp_col.
LAYOUTS = [
    ("2x2", P(tp=2, tp_col=2, micro_batch_size=8)),
    ("2x2-fsdp2-depth2", P(tp=2, tp_col=2, dp_shard=2, zero_stage=3, micro_batch_size=4)),
    ("col2-pp2", P(tp_col=2, pp=2, micro_batch_size=2, num_microbatches=4)),
    ("col2-ac-full", P(tp_col=2, activation_checkpoint="full", micro_batch_size=8)),
    ("col2-replicate2", P(tp_col=2, dp_replicate=2, micro_batch_size=4)),
    ("col4", P(tp_col=4, micro_batch_size=8)),
]
# (id, model, layout): the Llama family (tests/trainer/helpers.py MODELS), global batch 8.
FAMILY_LAYOUTS = [
    ("llama-2x2", "llama", P(tp=2, tp_col=2, micro_batch_size=8)),  # one KV head per row rank
    # q/k/v bias; the tied head's two copies on the first and last stage, column-split like the embedding
    ("qwen-tied-col2-pp2", "qwen-tied", P(tp_col=2, pp=2, micro_batch_size=2, num_microbatches=4)),
    # the tied head as one Parameter under 2D and FSDP2
    ("llama-tied-col2-fsdp2", "llama-tied", P(tp_col=2, dp_shard=2, zero_stage=3, micro_batch_size=4)),
]
CASES = [(name, "gpt", layout) for name, layout in LAYOUTS] + FAMILY_LAYOUTS
_CASES = {name: (model, layout) for name, model, layout in CASES}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, BenchmarkResult] = {}

    def get(name: str) -> BenchmarkResult:
        if name not in cache:
            model, layout = _CASES[name]
            cfg = tiny_config(layout, MODELS[model])
            cache[name] = run_local(cfg, tmp_path_factory.mktemp(name), timeout_s=300)
        return cache[name]

    return get


@pytest.mark.distributed
@pytest.mark.usefixtures("forked_ranks")
@pytest.mark.parametrize(("name", "model", "layout"), CASES, ids=[n for n, _, _ in CASES])
def test_loss_parity(name: str, model: str, layout: ParallelConfig, measured) -> None:
    assert layout.global_batch_size == GLOBAL_BATCH
    result = measured(name)
    assert_valid_result(result, tiny_config(layout, MODELS[model]))  # also: a peak memory for every rank
    assert result.parallel["tp_col"] == layout.tp_col
    assert_parity(name, result, reference_of(model))
    assert result.placement["tp_inside_node"] and result.placement["axes"]["tensor"]["size"] == (
        layout.tp * layout.tp_col
    )


@pytest.mark.distributed
@pytest.mark.usefixtures("forked_ranks")
def test_column_split_holds_less_per_rank(measured) -> None:
    """Weights, gradients, Adam state and the block's activations are split 4 ways."""
    assert measured("col4").peak_memory_bytes < 0.9 * reference_of("gpt").peak_memory_bytes


class _Recorder:
    """dist.all_reduce as trainer/tp2d.py calls it, recording (group ranks, shape) of each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.real = dist.all_reduce

    def __call__(self, tensor, *args, group=None, **kwargs):
        self.calls.append((tuple(dist.get_process_group_ranks(group)), tuple(tensor.shape)))
        return self.real(tensor, *args, group=group, **kwargs)

    def take(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        calls, self.calls = self.calls, []
        return sorted(calls)


@pytest.mark.parametrize("name", ["gpt", "qwen"])
def test_block_collectives_are_axonns_schedule(name: str) -> None:
    """One block on rank 1 of a 2x2 grid (torch's fake process group, one process): forward
    all-reduces Y over the column group (q, k, v, MLP-up) or the row group (the transposed
    out-proj and MLP-down) and the norms' statistics over the column group; backward all-reduces
    dX over the other group, q, k and v's once for the three (and SwiGLU's gate and fc once for
    the two). Nothing else communicates (no DTensor redistribution). The Llama block (Qwen2's:
    with a q/k/v bias) communicates the same, k and v at their GQA width."""
    cfg = MODELS[name]
    layout = P(tp=2, tp_col=2)
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        dims = ParallelDims.from_config(layout, 4)
        model = GPT(cfg)
        parallelize_gpt(model, dims.build_mesh("cpu"), dims, layout, param_dtype=torch.float32)
        b, t, h = 2, cfg.seq_len, cfg.hidden_size
        x = torch.randn(b, t, h // 2, requires_grad=True)  # this rank's column of the residual stream
        rec = _Recorder()
        row, col = (1, 3), (0, 1)  # rank 1 = (row coordinate 0, column coordinate 1)
        with mock.patch.object(tp2d.dist, "all_reduce", rec), CommDebugMode() as comm:
            y = model.layers["0"](x, model.rope)
            forward = rec.take()
            y.sum().backward()
            backward = rec.take()
        # LayerNorm reduces sum(x) and sum(x^2), RMSNorm sum(x^2); hidden is also q's width h / tp
        stats = (2, b, t) if cfg.norm == "layernorm" else (b, t)
        hidden, kv, ffn = (b, t, h // 2), (b, t, cfg.kv_size // 2), (b, t, cfg.ffn_size // 2)
        up = 2 if cfg.mlp == "swiglu" else 1  # SwiGLU's gate and fc
        # forward: norms; q, k, v and MLP-up over the column group; out-proj and MLP-down over rows
        assert forward == sorted(
            [(col, stats)] * 2
            + [(col, hidden), (col, kv), (col, kv)]
            + [(col, ffn)] * up
            + [(row, hidden)] * 2
        )
        # backward: norms; dX of q, k, v (summed: one all-reduce, AxoNN's fused QKV) and of MLP-up
        # over rows; of out-proj and MLP-down over columns
        assert backward == sorted([(col, stats)] * 2 + [(row, hidden)] * 2 + [(col, hidden), (col, ffn)])
        assert comm.get_total_counts() == len(forward) + len(backward)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "layout",
    [P(tp=2, tp_col=2, dp_shard=2, zero_stage=3), P(tp_col=4, pp=2, micro_batch_size=1, num_microbatches=2)],
    ids=lambda p: p.describe(),
)
def test_mesh_follows_the_placement_rule(layout: P) -> None:
    """tp_col is the innermost mesh axis, next to tp: a row x column group is neighbouring ranks."""
    world = layout.world_size
    for rank in (0, world - 1):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            dims = ParallelDims.from_config(layout, world)
            mesh = dims.build_mesh("cpu")
            assert mesh.mesh_dim_names[-1] == "tp_col"
            for axis in dims.enabled_axes:
                mine = next(g for g in groups(layout, axis) if rank in g)
                assert dist.get_process_group_ranks(mesh.get_group(axis)) == mine, (axis, rank)
            tensor = sorted(dist.get_process_group_ranks(mesh[dims.tensor_axes]._flatten().get_group()))
            assert tensor == next(g for g in groups(layout, "tensor") if rank in g)
        finally:
            dist.destroy_process_group()
    t = layout.tp * layout.tp_col
    assert expected_spans(layout, ranks_per_node=t)["tensor"] == 1
    assert expected_spans(layout, ranks_per_node=t // 2)["tensor"] == 2


def test_layout_rules_and_keys() -> None:
    assert P(tp=2, tp_col=2).world_size == 4 and P(tp=2, tp_col=2).describe().startswith("tp2x2 ")
    assert "tp_col" not in P(tp=2).to_dict()  # old layouts keep their keys
    assert P.from_dict(P(tp_col=2).to_dict()) == P(tp_col=2)
    model = ModelConfig(num_layers=2, hidden_size=48, num_heads=4, vocab_size=256, seq_len=16)
    rules = {rule for rule, _ in P(tp_col=32).violations(model)}
    assert rules == {"tp_col must divide hidden_size"}
    rules = {rule for rule, _ in P(tp=2, tp_col=2, sequence_parallel=True).violations(TINY)}
    assert rules == {"sequence_parallel needs tp_col 1"}
    assert {rule for rule, _ in P(tp_col=0).violations(TINY)} == {"tp_col must be >= 1"}
