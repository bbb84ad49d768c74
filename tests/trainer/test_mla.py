"""Latent attention under tensor parallelism, parameter by parameter: two gloo ranks holding half
the heads each give every weight the gradient one process gives it. The latents (wq_a, wkv_a and
their norms) are computed whole on each rank, so their gradients must be whole too: the
column-parallel up-projections all-reduce their inputs' gradients, and the rotary key that every
head shares all-reduces its own (trainer/model.py LatentAttention). Loss parity (test_moe.py's
mla cases) cannot see that last reduction at this size: left out, the step-1 gradient norm moves
by 6e-7 relative (measured), far under REL_TOL; here wkv_a's gradient is 74 % off (measured) and what feeds it too."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.trainer.helpers import MODELS
from trainer.model import GPT
from trainer.parallelize import apply_tp


def _loss(logits: torch.Tensor) -> torch.Tensor:
    """A loss of every logit (a rank's vocab shard under tp: the shards' losses add up)."""
    weights = torch.linspace(-1, 1, logits.shape[-1])  # the whole vocabulary's
    if isinstance(logits, DTensor):  # Shard(-1): this rank's columns
        logits = logits.to_local()
        weights = weights.chunk(dist.get_world_size())[dist.get_rank()]
    return (logits.float() * weights).sum()


def _grads(rank: int, store: str, sequence_parallel: bool, out: str, reduce_key: bool) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        cfg = MODELS["mla-dense"]
        net = GPT(cfg)
        net.init_weights(torch.Generator().manual_seed(0))
        net.init_buffers()
        with torch.no_grad():  # weights large enough for attention far from uniform
            gen = torch.Generator().manual_seed(1)
            for name, p in net.named_parameters():
                if "attn.w" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        reference = copy.deepcopy(net)
        idx = torch.randint(cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(2))
        _loss(reference(idx)).backward()
        apply_tp(
            net, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=sequence_parallel
        )
        if not reduce_key:  # the rotary key's gradient left as this rank's heads' share
            for block in net.layers.values():
                block.attn.tp_mesh = None
        _loss(net(idx)).backward()
        worst = {}
        for (name, p), (_, want) in zip(net.named_parameters(), reference.named_parameters(), strict=True):
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            worst[name] = float((got - want.grad).abs().max() / want.grad.abs().max())
        if rank == 0:
            torch.save(worst, out)
    finally:
        dist.destroy_process_group()


def _worst(tmp_path: Path, sequence_parallel: bool, reduce_key: bool = True) -> dict[str, float]:
    out = tmp_path / "worst.pt"
    args = (str(tmp_path / "store"), sequence_parallel, str(out), reduce_key)
    torch.multiprocessing.spawn(_grads, args=args, nprocs=2)
    return torch.load(out)


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_every_gradient_under_tp_is_one_processs(tmp_path: Path, sequence_parallel: bool) -> None:
    worst = _worst(tmp_path, sequence_parallel)
    assert max(worst.values()) < 1e-4, {k: v for k, v in worst.items() if v >= 1e-4}


@pytest.mark.distributed
def test_the_shared_rotary_keys_reduction_is_seen(tmp_path: Path) -> None:
    """Without the rotary key's all-reduce the test above fails on wkv_a (and what feeds it)."""
    worst = _worst(tmp_path, False, reduce_key=False)
    assert worst["layers.0.attn.wkv_a.weight"] > 0.1, worst


def test_mla_up_proj_needs_latent_attention_and_cp_1() -> None:
    """Megatron's mla_up_proj recomputes latent attention's q, k and v: refused, with the reason, for
    plain attention and with context parallelism (whose gathered keys and values stay kept)."""
    from trainer.contract.parallel import ParallelConfig
    from trainer.contract.presets import MODEL_PRESETS

    up = ParallelConfig(activation_checkpoint="mla_up_proj", micro_batch_size=8)
    assert up.violations(MODELS["deepseek"]) == []
    assert [r for r, _ in up.violations(MODEL_PRESETS["llama-tiny"])] == [
        "mla_up_proj needs latent attention"
    ]
    cp = ParallelConfig(activation_checkpoint="mla_up_proj+moe_act", cp=2, micro_batch_size=8)
    assert "mla_up_proj needs cp 1" in [r for r, _ in cp.violations(MODELS["deepseek"])]


def test_mla_up_proj_trains_the_same_and_keeps_no_q_k_v() -> None:
    """One process: the recomputed q, k and v give the same loss and gradients, bit for bit, and
    the saved tensors are fewer by at least q, k and v (CPU: v padded to q's width) of every layer."""
    import copy

    from trainer.model import cross_entropy_loss

    cfg = MODELS["deepseek"]
    plain = GPT(cfg)
    plain.init_weights(torch.Generator().manual_seed(0))
    plain.init_buffers()
    up = copy.deepcopy(plain)
    for block in up.layers.values():
        block.attn.recompute_up = True
    idx = torch.randint(cfg.vocab_size, (4, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    saved = {}
    for name, net in (("plain", plain), ("up", up)):
        storages: set[int] = set()
        nbytes = [0]

        def pack(t, storages=storages, nbytes=nbytes):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                storages.add(t.untyped_storage().data_ptr())
                nbytes[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = cross_entropy_loss(net(idx), idx)
        loss.backward()
        saved[name] = (loss.item(), nbytes[0])
    assert saved["up"][0] == saved["plain"][0]
    for a, b in zip(plain.parameters(), up.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    qk = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    per_layer = 4 * cfg.seq_len * 3 * qk * 4  # q, k and padded v, fp32
    # at least q, k and v of every layer (the recomputed part's own intermediates go too; what the
    # checkpoint keeps of its inputs is packed by its own hooks: the memory oracle counts it all,
    # tests/tuner/test_moe_model.py test_latent_attention_matches_the_oracle)
    assert saved["plain"][1] - saved["up"][1] >= cfg.num_layers * per_layer
