"""Context parallelism: every sequence split over the cp ranks, attention across them.

Applied from outside like the other axes (trainer/parallelize.py: apply_cp); the model keeps no
process group, only a `CPComm` on each attention when cp > 1.

- Load balance (head-tail, torchtitan's "headtail" and Megatron-LM's default): the sequence is cut
  into 2 x cp equal chunks and rank r holds chunks r and 2cp-1-r, so under the causal mask every
  rank scores the same number of query-key pairs ((2cp + 1) x L^2 for chunks of L tokens) where a
  plain split would leave the last rank cp times the first's work.
- K/V all-gathered over the cp group before attention, not passed around a ring: torchtitan's
  current choice (its context-parallel API gathers K/V since pytorch/torchtitan#3086); with GQA
  only the KV heads travel (num_kv_heads, not num_heads). The gathered chunks are put back in
  sequence order, and each local query chunk c attends to the keys of chunks 0..c with a causal
  mask aligned to its lower right: the keys' global positions are their index.
- Backward: each rank's dK/dV covers every rank's keys; they go back to their owners and are summed
  there (a reduce-scatter). gloo has no reduce_scatter, so it is one all_to_all plus a local sum,
  inside a torch.autograd.Function as trainer/moe.py does the experts' all-to-all.
- Positions: RoPE and learned position embeddings use each token's global position
  (`local_positions`); the trainer's batch keeps the rank's two chunks of tokens and targets.
- The loss is each rank's mean over its tokens; the cp ranks hold the same weights and equal
  token counts, so averaging gradients over dp x cp (FSDP2 / replicate on the folded mesh) gives
  the global mean's gradient.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F


def head_tail_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two of 2 x cp sequence chunks rank `cp_rank` holds: r and 2cp-1-r."""
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of this rank's seq_len / cp tokens, in the order it holds them (its first
    chunk, then its second)."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len ({seq_len}) must be divisible by 2 x cp ({2 * cp})")
    size = seq_len // (2 * cp)
    return torch.cat(
        [torch.arange(c * size, (c + 1) * size, device=device) for c in head_tail_chunks(cp_rank, cp)]
    )


def shard_sequence(t: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `t` along `dim` (the sequence), concatenated."""
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for c in head_tail_chunks(cp_rank, cp)], dim=dim)


# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older releases lack the new one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@contextmanager
def released_after(*tensors: torch.Tensor, timeout_s: float = 1.0) -> Iterator[None]:
    """Return from a blocking collective only once the process group has let go of `tensors`.

    gloo runs a collective on a worker thread that wakes the caller and only then drops its own
    reference to the work and the tensors in it: a temporary passed in (a `.contiguous()` copy)
    is freed by whichever of the two threads lets go last, a moment later or much later when the
    worker waits for a core. A CPU rank's peak (trainer/metrics.py LiveBytesTracker) then depends
    on the scheduler (one K copy over the oracle on one rank of a loaded CI run, cp2 pp2).
    Holding the tensors until their use counts are back where they were makes the
    caller the one that frees them. NCCL and the oracle's fake groups keep no CPU tensor past the
    call: nothing to wait for."""
    cpu = [t for t in tensors if t.device.type == "cpu"]
    before = [_uses(t) for t in cpu]
    yield
    deadline = time.monotonic() + timeout_s
    while any(_uses(t) > n for t, n in zip(cpu, before, strict=True)) and time.monotonic() < deadline:
        time.sleep(0)


def _uses(t: torch.Tensor) -> int:
    """References to the tensor and to its storage (a work may hold either: the tensor, or views)."""
    return t._use_count() + torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class GatherSequence(torch.autograd.Function):
    """(B, H, t, d) on each of the cp ranks -> (cp, B, H, t, d), every rank's in rank order.
    Backward: each rank's gradient of rank j's slice goes to rank j (all_to_all) and is summed
    there, a reduce-scatter on gloo."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group = group
        out, x = x.new_empty((size * x.shape[0], *x.shape[1:])), x.contiguous()
        with released_after(out, x):
            _all_gather(out, x, group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        received = torch.empty_like(grad)
        with released_after(received, grad):
            dist.all_to_all_single(received, grad, group=ctx.group)
        return received.sum(0), None, None


def sequence_order(gathered: torch.Tensor) -> torch.Tensor:
    """(cp, B, H, t, d), every rank's two chunks in rank order -> (B, H, cp x t, d) in sequence
    order: chunk c < cp is rank c's first half, chunk 2cp-1-r rank r's second (head-tail)."""
    cp, b, h, t, d = gathered.shape
    halves = gathered.view(cp, b, h, 2, t // 2, d)
    heads = halves[:, :, :, 0].permute(1, 2, 0, 3, 4)
    tails = halves[:, :, :, 1].flip(0).permute(1, 2, 0, 3, 4)
    return torch.cat([heads, tails], dim=2).view(b, h, cp * t, d)


@dataclass
class CPComm:
    """One rank's view of its context-parallel group (set on every attention by apply_cp)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    seq_len: int
    positions: torch.Tensor = field(init=False)  # this rank's tokens' global positions
    # The additive causal masks of the rank's two chunks, made once and shared by every layer and
    # micro-batch (SDPA keeps its mask for backward: made per call, each layer would keep its own).
    masks: dict[tuple, torch.Tensor] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.positions = local_positions(self.seq_len, self.size, self.rank)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's (B, H, t, d) keys or values -> (B, H, seq_len, d) in sequence order."""
        return sequence_order(GatherSequence.apply(x, self.group, self.size))

    def mask(self, half: int, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Query j of a chunk (position c x half + j) sees keys 0 .. c x half + j: a causal mask
        aligned to the lower right (torch's CausalBias does not run under a dispatch mode, which
        the memory oracle is), additive in the queries' dtype (SDPA would convert a boolean one
        to that, a new tensor each call). Cached: (2cp + 1) (s / 2cp)^2 values a rank."""
        key = (half, keys, dtype, device)
        if key not in self.masks:
            allowed = torch.ones(half, keys, dtype=torch.bool, device=device).tril(keys - half)
            mask = torch.zeros(half, keys, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
            mask.shared_by_layers = True  # activation offload leaves it on the device (trainer/offload.py)
            self.masks[key] = mask
        return self.masks[key]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """Causal attention of this rank's queries (B, H, t, d), its two chunks in order, over the
        whole sequence's keys and values (B, KV heads, seq_len, d; SDPA's enable_gqa serves GQA): chunk c sees chunks 0..c, diagonal
        included, so the scores computed are the causal ones and no more."""
        half, gqa = q.shape[2] // 2, k.shape[1] != q.shape[1]
        outs = []
        for i, c in enumerate(head_tail_chunks(self.rank, self.size)):
            keys = (c + 1) * half
            mask = self.mask(half, keys, q.dtype, q.device)
            qc = q[:, :, i * half : (i + 1) * half]
            outs.append(F.scaled_dot_product_attention(qc, k[:, :, :keys], v[:, :, :keys], attn_mask=mask,
                                                       dropout_p=dropout_p, enable_gqa=gqa))  # fmt: skip
        return torch.cat(outs, dim=2)
