"""The plain model and the pipeline split (single process)."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.helpers import MODELS, TINY
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.model import GPT, Attention, Block, LatentAttention, cross_entropy_loss
from trainer.pipeline import split_model, stage_layer_ranges


@pytest.mark.parametrize("name", MODELS)
def test_param_count_matches_config(name: str) -> None:
    """A tied head is one Parameter: counted once by the model and by the config."""
    cfg = MODELS[name]
    assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.num_params


def test_latent_attention_is_built_as_latent_attention() -> None:
    """DeepSeek-V3's layers get LatentAttention (on the meta device: nothing allocated), whose
    weights are the ones the contract counts; plain Attention refuses a latent config rather than
    building multi-head attention in its place."""
    cfg = MODEL_PRESETS["deepseek-v3"]
    with torch.device("meta"):
        block = Block(cfg, layer_id=cfg.moe_dense_layers)
        assert isinstance(block.attn, LatentAttention)
        assert (
            sum(p.numel() for p in block.attn.parameters())
            == cfg.attention_matmul_params + cfg.attention_norm_params
        )
        with pytest.raises(ValueError, match="LatentAttention's"):
            Attention(cfg)


def test_forward_and_loss() -> None:
    model = GPT(TINY)
    model.init_weights(torch.Generator().manual_seed(0))
    x = torch.randint(TINY.vocab_size, (2, TINY.seq_len))
    logits = model(x)
    assert logits.shape == (2, TINY.seq_len, TINY.vocab_size)
    # Untrained, near-uniform: loss close to ln(V).
    assert abs(cross_entropy_loss(logits, x).item() - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_init_is_deterministic_and_layout_free() -> None:
    a, b = GPT(TINY), GPT(TINY)
    a.init_weights(torch.Generator().manual_seed(3))
    b.init_weights(torch.Generator().manual_seed(3))
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), na


def test_stage_ranges_cover_every_layer_once() -> None:
    for layers, stages in [(4, 2), (5, 2), (7, 4), (96, 8), (4, 4)]:
        ranges = stage_layer_ranges(layers, stages)
        assert [i for r in ranges for i in r] == list(range(layers))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_looped_and_v_stage_placement() -> None:
    looped = ParallelConfig(pp=4, pp_schedule="interleaved_1f1b", virtual_stages=2, num_microbatches=4)
    assert looped.stages_of(1) == [1, 5]
    for schedule in ("zbv", "dualpipev"):
        v = ParallelConfig(pp=4, pp_schedule=schedule, virtual_stages=2, num_microbatches=8)
        assert [v.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


@pytest.mark.parametrize("name", ["gpt", "llama-tied"])
def test_stages_compose_to_the_whole_model(name: str) -> None:
    """Every stage carries the rotary table; a tied head's weight is copied to the last stage."""
    cfg = MODELS[name]
    model = GPT(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    x = torch.randint(cfg.vocab_size, (2, cfg.seq_len))
    h, stages = x, [split_model(model, s, 4) for s in range(4)]
    for s, stage in enumerate(stages):
        assert (stage.embed is None) == (s != 0) and (stage.head is None) == (s != 3)
        assert (stage.rope is None) == (cfg.positions != "rope")
        h = stage(h)
    torch.testing.assert_close(h, model(x))
    if cfg.tie_embeddings:  # two copies, equal, not one Parameter
        first, last = stages[0].embed.tok.weight, stages[-1].head.weight
        assert first is not last and torch.equal(first, last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_is_torchs_and_keeps_the_logits_and_a_log_sum_exp(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer/model.py ChunkedCrossEntropy, four chunks of rows: the loss and the logits' gradient
    of torch's cross_entropy on their fp32 copy, and for the backward only the logits themselves
    and an fp32 log-sum-exp a row (torch's keeps an fp32 log-softmax of the logits' size)."""
    import torch.nn.functional as F

    from trainer.contract import blocks

    monkeypatch.setattr(blocks, "CE_CHUNK_VALUES", 3 * 300)  # 3 rows of 300 a chunk
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 300, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, 300, (2, 6), generator=gen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = cross_entropy_loss(logits, targets)
    (grad,) = torch.autograd.grad(loss, logits)
    want = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
    (want_grad,) = torch.autograd.grad(want, logits)
    assert loss.dtype == torch.float32 and torch.allclose(loss, want, rtol=1e-6, atol=0)
    assert grad.dtype == dtype and torch.allclose(
        grad.float(), want_grad.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-7
    )
    kept = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage()._cdata: t for t in saved}.values())
    assert kept == logits.numel() * logits.element_size() + 12 * 4 + 12 * 8  # + lse fp32, int64 targets
