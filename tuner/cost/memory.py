"""The analytic memory model: bytes on a layout's fullest device as the trainer (trainer/) holds
them, at the peak of the phase of a step that holds the most: the assembly of a rank's bytes from
each axis's part (the layer's activations and parameters: layer.py; the pipeline's layers, in-flight
micro-batches and schedule: pipeline.py; data parallelism's shards: data.py; context parallelism's
gathered K/V and masks: context.py; a mixture of experts' rank: experts.py). step.estimate uses
it; `fits` compares it with the device's memory.

The terms are the trainer's tensors, checked against its build on fake tensors (the memory
oracle: trainer/memcheck.py, bench/memory_oracle.py; docs/perfmodel.md says where they differ
from Megatron-LM's): ZeRO's model states (Rajbhandari et al. 2020) as FSDP2 keeps them, the
activations one layer stores (Korthikanti et al. 2022, table 2, for this trainer's modules), the
micro-batches in flight of each pipeline schedule (Narayanan et al. 2021 sec. 2.2; Korthikanti
sec. 4.2.3), and what torch's pipelining and FSDP2 keep besides. What no tensor shows (allocator
fragmentation and reserve, communication buffers, the CUDA context) is the calibrated part:
workspace_bytes and memory_scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.contract.blocks import ce_chunk_rows
from trainer.contract.parallel import ParallelConfig
from trainer.contract.rules import V_SCHEDULES
from tuner.cost.context import gathered_kv_bytes, mask_bytes
from tuner.cost.data import expert_shards, weight_shards
from tuner.cost.experts import expert_rank, local_expert_params
from tuner.cost.layer import (
    activation_bytes_per_token,
    attention_tensors,
    flow_bytes,
    layer_params,
    norm_2d_bytes,
    norm_input_bytes,
    weight_output_bytes_per_token,
)
from tuner.cost.pipeline import chunk_shares, in_flight, interleaved_moments, stage_layers, v_moments

if TYPE_CHECKING:
    from tuner.cost.case import Case

PARTS = ("weights", "grads", "optimizer", "activations")


def memory(case: Case) -> dict[str, float]:
    """Bytes on the fullest device: the first or the last pipeline rank in its fullest phase,
    times memory_scale, plus workspace_bytes; split into weights (fp32 master and compute-dtype
    working copies), gradients, optimizer state (AdamW's m and v) and activations (with
    pipeline buffers, logits, the batch and the rotary buffer). The case's `device`: the ranks'
    kind (ClusterSpec.device_kind), whose kernels keep what they keep. A mixture of experts: its
    routed experts' state over ep and (sharded) the expert data parallelism, its routed
    activations on the busiest rank at the case's `moe_imbalance` (experts.py)."""
    c = case.constants
    phases = [
        parts for stage in sorted({0, case.layout.pp - 1}) for parts in phase_bytes(case, stage).values()
    ]
    worst = max(phases, key=lambda parts: sum(parts.values()))
    return {
        "memory_bytes": sum(worst.values()) * c.memory_scale + c.workspace_bytes,
        **{f"{k}_bytes": v for k, v in worst.items()},
        "workspace_bytes": c.workspace_bytes,
    }


@dataclass(frozen=True)
class RankBytes:
    """What one pipeline rank holds, in bytes (see phase_bytes)."""

    params: float  # its parameters, after tp, before dp sharding
    d: int  # how many ways FSDP2 shards them (1: replicated)
    cb: int  # bytes per value of the compute dtype
    whole: float  # compute-dtype copies of every parameter
    root: float  # ... of the root unit (embedding, head), never resharded between passes
    unit: float  # ... of one layer
    layer: float  # one micro-batch's activations in one layer
    layers: float  # ... in all its layers (and the stage's kept output)
    vocab_grad: float  # the vocab-parallel embedding's gradient beyond its shard (DTensor: whole)
    head: float  # one micro-batch's on the last stage: the head's input, the fp32 log-softmax
    flow: float  # gradients flowing back inside a layer, with recompute its activations
    loss: float  # the loss's transient (fp32 chunks or copies of the logits, their gradient)
    buffers: float  # the batch's micro-batches (and the rotary and mask buffers), all step long
    boundary: float  # what a stage sends the next per micro-batch (and gets back as its gradient)
    experts: float = 0.0  # a mixture of experts' routed experts on the rank (E / ep a MoE layer)
    ed: int = 1  # how many ways FSDP2 shards them (the expert data parallelism; 1: replicated)
    chunks: tuple[float, ...] = (1.0,)  # each local stage's share of the rank's layers (interleaved)
    loop_grads: float = 0.0  # the CPU's loop over experts: its weight gradients' whole-tensor transients
    output_held: float = 0.0  # the last stage's logits, which torch's schedule holds through its backward
    offloaded: float = 0.0  # activation offload: one micro-batch's saved activations the stage sends to host
    unpacked: float = 0.0  # ... and what its biggest backward (the MLP's or attention's) brings back
    first_grads: float = 0.0  # ... and the gradients its last layer to run a backward (and the root) land
    # FSDP2's reduce-scatter input held in a layer's backward (see rank_bytes), and the head's
    # gradient in the compute dtype, which the root's post-backward reduces only at the backward's end
    reduce_held: float = 0.0
    head_grad: float = 0.0
    # the embedding's gradient as its backward gives it (compute dtype; a vocab-parallel one whole),
    # beside the fp32 one FSDP2's post-backward accumulates it into
    embed_grad: float = 0.0
    # A V schedule's split backward: what its input half keeps for its weight half, one
    # micro-batch's in all the rank's layers (and the head's, on the last stage)
    weight_outputs: float = 0.0
    head_weight_outputs: float = 0.0
    # Bytes a parameter's gradient takes while accumulated whole without a sync: fp32, or bf16 where
    # FSDP2 / replicate manage it with reduce_dtype bf16 (grad_reduce_dtype; the dense parameters
    # with dp x cp > 1, a mixture of experts' always: its experts are wrapped over edp, even of 1).
    accumulated_bytes: float = 4.0
    expert_accumulated_bytes: float = 4.0


def phase_bytes(case: Case, stage: int) -> dict[str, dict[str, float]]:
    """Tensor bytes of the rank at pipeline coordinate `stage` at the peak of each phase of a step
    (trainer/memcheck.py's PHASES: forward and backward; the optimizer step) as
    {phase: {PARTS: bytes}}."""
    p = case.layout
    r = rank_bytes(case, stage)
    master, adam, grads = 4 * r.params / r.d, 8 * r.params / r.d, 4 * r.params / r.d
    if r.experts:  # experts: fp32 master, AdamW's m and v, fp32 gradients over their own shards
        master, adam, grads = (
            master + 4 * r.experts / r.ed,
            adam + 8 * r.experts / r.ed,
            grads + 4 * r.experts / r.ed,
        )
    weights, grads_fb, acts = forward_backward(p, r, stage, grads)
    fb = {"weights": master + weights, "grads": grads_fb, "optimizer": adam,
          "activations": acts + r.buffers}  # fmt: skip
    # fused AdamW (trainer/benchmark.py): in place, no temporary
    step = {"weights": master, "grads": grads, "optimizer": adam, "activations": r.buffers}
    return {"forward_backward": fb, "optimizer": step}


def rank_bytes(case: Case, stage: int) -> RankBytes:
    """What the rank at pipeline coordinate `stage` holds, part by part."""
    m, p, c, device = case.model, case.layout, case.constants, case.device
    cb = case.value_bytes  # compute dtype: activations, FSDP2's gathered parameters
    low = cb < 4
    dp = case.replicas  # ranks holding the same weights (FSDP2 and replicate span context parallelism's)
    residual = 4 if low and dp == 1 else cb  # autocast (no FSDP2) leaves the residual adds in fp32
    s, h, v, n, t = m.seq_len, m.hidden_size, m.vocab_size, p.num_microbatches, p.tp
    s_local = s // p.cp  # a rank's tokens of each sequence (context.py)
    held = p.stages_of(stage)
    first, last = 0 in held, p.num_stages - 1 in held
    k = p.tp_col  # 2D: every weight over tp x tp_col, the residual stream over tp_col
    # The token embedding (and learned positions) on the first stage, the final norm and the head
    # on the last. A tied head is the embedding's weight: one with the two on one stage, a copy
    # on each with a pipeline (trainer/pipeline.py splits a deep copy).
    embed = (v * h / t + (s * h if m.positions_kind.learned else 0)) / k if first else 0.0
    head_weight = 0.0 if m.tie_embeddings and first else v * h / t
    head = (head_weight + m.norm_params) / k if last else 0.0
    params = stage_layers(m.num_layers, p, stage) * layer_params(m, t, k) + embed + head
    moe = expert_rank(m, p, cb, stage, case.moe_imbalance, device) if m.moe else None  # the experts' part
    if moe is not None:
        params = moe.dense_params + embed + head
    tokens, shard = case.tokens_mb, t if p.sequence_parallel else k
    boundary = tokens * h / shard * residual  # what one stage sends the next per micro-batch
    sending = sum(i < p.num_stages - 1 for i in held)  # ... with a next (receive gradients)
    layer = activation_bytes_per_token(m, p, cb, c, residual, device) * tokens + gathered_kv_bytes(m, p, cb)
    if m.positions_kind.rotary and dp > 1 and low:
        # FSDP2's and replicate's mixed precision casts every block's floating inputs, the cos/sin
        # buffer too: each layer keeps its bf16 copy (rotary's multiplications save it).
        layer += 2 * s_local * m.rope_dim * cb
    # A received input is its receive buffer, allocated at its receive and dropped after its
    # backward (trainer/pipeline.py OnDemandStage): the first layer's input, counted there; a
    # stage's output is kept for its backward (held by its send when interleaved:
    # pipeline.interleaved_moments).
    own = sending * boundary if p.virtual_stages == 1 else 0.0
    layers = layer * stage_layers(m.num_layers, p, stage) + own
    if moe is not None:
        layers += moe.num_moe * moe.act_per_token * tokens
    offloaded = unpacked = first_grads = 0.0
    if p.activation_checkpoint == "offload":  # trainer/offload.py: every saved activation of the
        # stage's layers to host memory and back (on a CPU rank host memory is the device: kept)
        offloaded = layers - own
        # What comes back for the layer's biggest backward beyond the gradients `flow` counts: the
        # MLP's kept tensors (at its activation's backward), or attention's (q, the keys and values
        # it saw, gathered under cp, its output, the log-sum-exp) and their gradients, beside the
        # residual stream's two
        saved_attention = (attention_tensors(m, device) * cb + 4 * m.num_heads) / t * tokens
        saved_attention += gathered_kv_bytes(m, p, cb)
        stream_grads = tokens * 2 * h / k * residual
        unpacked = max(
            m.mlp_kind.kept * m.ffn_size / t * cb * tokens,
            stream_grads + 2 * saved_attention - flow_bytes(m, p, cb, residual, tokens),
        )
        # the gradients the stage's last layer to run its backward (and the root) have yet to land
        sharded = weight_shards(case) if p.zero_stage > 0 else 1
        grad_bytes = 2.0 if dp > 1 and case.grad_reduce_dtype == "bf16" else 4.0
        first_grads = grad_bytes * (layer_params(m, t, k) + embed + head) / sharded
        if device != "cpu":
            layers = own
    logits = tokens * v / t  # per micro-batch, vocab-sharded
    recompute = 0.0
    if p.activation_checkpoint in ("full", "op"):  # recomputing a layer brings its activations back
        plain = ParallelConfig(**{**p.to_dict(), "activation_checkpoint": "none"})
        recompute = activation_bytes_per_token(m, plain, cb, c, residual, device) * tokens
        recompute += gathered_kv_bytes(m, plain, cb)
        if moe is not None and moe.num_moe:
            recompute += expert_rank(m, plain, cb, stage, case.moe_imbalance, device).act_per_token * tokens
        if p.activation_checkpoint == "op":  # less what it kept: the recompute reuses those outputs
            recompute -= (layer - residual * h / (t if p.sequence_parallel else 1) * tokens) + (
                moe.act_per_token * tokens if moe is not None and moe.num_moe else 0.0
            )
    if t == 1:  # whole logits: trainer/model.py ChunkedCrossEntropy keeps them (cb) and a fp32
        # log-sum-exp a token (`head`); transient: one fp32 chunk of rows, and in the backward the
        # gradient, in the logits' dtype
        kept_logits = cb * logits + 4 * tokens
        loss = 4 * min(ce_chunk_rows(v), tokens) * v + cb * logits
    else:
        # vocab-sharded (loss_parallel): the fp32 log-softmax is kept; transient: the fp32 copy of
        # the bf16 logits (forward), or the log-softmax's gradient computed in place (backward),
        # beside the logits, the stage's output, which a pipeline's schedule holds until the loss
        # is computed (torch's forward cache kept them to the backward until issue 37)
        kept_logits = 4 * logits
        loss = (4 + (cb if cb < 4 else 0)) * logits + (cb * logits if p.pp > 1 else 0.0)
    # The final norm keeps its input and output (the head's input); RMSNorm's CPU composite more.
    final_norm = tokens * h * (1 / shard + 1) * residual
    final_norm += tokens * h * (norm_input_bytes(m, residual, device) - residual) / shard
    # Rotary positions: every stage module holds the cos/sin buffer, (2, s, rope_dim) in fp32.
    rope = 2 * s_local * m.rope_dim * 4 * p.virtual_stages if m.positions_kind.rotary else 0
    unit = cb * layer_params(m, t, k)
    flow = flow_bytes(m, p, cb, residual, tokens) + recompute
    if moe is not None:
        params_all = params + moe.experts
        unit = max(unit, cb * moe.layer_params) if moe.num_moe else unit
        flow += moe.flow_per_token * tokens
        layer = max(layer, layer + moe.act_per_token * tokens) if moe.num_moe else layer
    else:
        params_all = params
    bf16_grads = case.grad_reduce_dtype == "bf16"
    # FSDP2's reduce-scatter input, flat in the reduce dtype, kept until the next module's
    # post-backward (torch's reduce_scatter_max_input_buffers, 1): in a layer's MLP or experts'
    # backward, the layer after's (a MoE layer's dense part: its experts' reduce came before)
    reduce_held = 0.0
    if p.zero_stage > 0 and weight_shards(case) > 1:
        local_experts = moe.experts / moe.num_moe if moe is not None and moe.num_moe else 0.0
        dense_part = (moe.layer_params - local_experts) if local_experts else layer_params(m, t, k)
        reduce_held = (2 if bf16_grads else 4) * dense_part
    weight_outputs = 0.0
    if p.pp_schedule in V_SCHEDULES:
        per_token = weight_output_bytes_per_token(m, p, cb, residual)
        weight_outputs = per_token * tokens * stage_layers(m.num_layers, p, stage)
        if moe is not None:
            weight_outputs += moe.num_moe * moe.weight_outputs_per_token * tokens
    return RankBytes(
        offloaded=offloaded, unpacked=unpacked, first_grads=first_grads, weight_outputs=weight_outputs,
        head_weight_outputs=cb * logits if last else 0.0,
        params=params, d=weight_shards(case), cb=cb,
        accumulated_bytes=2.0 if bf16_grads and dp > 1 else 4.0,
        expert_accumulated_bytes=2.0 if bf16_grads and moe is not None else 4.0,
        # FSDP2's copies, or autocast's weight cache (which 2D's local views of the weights bypass)
        whole=cb * params_all if dp > 1 or (low and k == 1) else 0.0,
        root=cb * (embed + head), unit=unit, layer=layer, layers=layers,
        # 2D: the embedding looks up its local block, its gradient is local too
        vocab_grad=4 * v * h * (1 - 1 / t) if first and k == 1 else 0.0,
        # ... and what the loss keeps of the logits (above)
        head=(final_norm if k == 1 else tokens * (8 + norm_2d_bytes(m, residual)) * h / k)
        + kept_logits if last else 0.0,
        flow=flow, loss=loss,
        buffers=2 * 8 * n * tokens + rope + mask_bytes(m, p, cb),
        boundary=boundary,
        experts=moe.experts if moe is not None else 0.0, ed=expert_shards(case),
        chunks=chunk_shares(m.num_layers, p, stage),
        # Each expert's slice of a weight gets its gradient as a whole-weight tensor (autograd's
        # select backward), summed into the one before: three whole (E / ep) x h x f gradients at a
        # time, in the compute dtype, during a MoE layer's backward (GPU kernels: none).
        loop_grads=3 * local_expert_params(m, p.ep) / m.mlp_matrices * cb
        if moe is not None and moe.num_moe and device == "cpu" else 0.0,
        # torch's schedules keep a forward's output in a local variable until the next forward:
        # through the micro-batch's backward, after the loss has let its logits go
        output_held=cb * logits if last and p.pp > 1 else 0.0,
        reduce_held=reduce_held,
        head_grad=cb * v * h / t / k if last and dp > 1 and low else 0.0,
        embed_grad=cb * v * h / (t * k if k > 1 else 1) if first and dp > 1 and low else 0.0,
    )  # fmt: skip


def forward_backward(
    p: ParallelConfig, r: RankBytes, stage: int, sharded_grads: float
) -> tuple[float, float, float]:
    """(working copies, gradients, activations) at the forward/backward peak: the largest of a
    few moments of a micro-batch's passes."""
    # Gradients accumulate whole, in fp32, across micro-batches without synchronising: pipeline
    # stages (torch's pipelining syncs only the last backward), replicated DP (the trainer's
    # no_sync), no DP; FSDP2 reduce-scatters each micro-batch otherwise.
    accumulates = p.pp > 1 or p.zero_stage == 0
    accumulated = (
        r.accumulated_bytes * r.params + r.vocab_grad + r.expert_accumulated_bytes * r.experts
        if accumulates
        else sharded_grads
    )
    working = r.root + 2 * r.unit if p.zero_stage == 3 else r.whole  # zero 3 prefetches the next layer
    # FSDP2's gathered weights are in the compute dtype, so are the gradients autograd gives them:
    # one layer's, until its post-backward folds them into the fp32 gradients. (Autocast's casts
    # hand theirs straight back to the fp32 parameters.)
    fresh = (r.unit if p.dp * p.cp > 1 and r.cb < 4 else 0.0) + r.loop_grads
    # bf16 accumulation: the last backward's reduce lands the gradients in fp32 (sharded, or whole
    # when replicated) while its last layer still holds its activations; the other layers' working
    # copies are resharded by then (each module's post-backward), the root's stay
    bf16_accumulated = accumulates and min(r.accumulated_bytes, r.expert_accumulated_bytes) < 4
    landed = (r.root + r.unit, sharded_grads + fresh, r.layer + r.flow) if bf16_accumulated else None
    if p.virtual_stages > 1:
        walk = v_moments if p.pp_schedule in V_SCHEDULES else interleaved_moments
        walked = walk(p, r, stage, accumulated, working, fresh)
        return max(walked, landed, key=sum) if bf16_accumulated else walked
    n, inflight = p.num_microbatches, in_flight(p, stage)
    # A backward's received gradient (OnDemandStage: from its receive to the backward's end)
    flow = r.flow + (r.boundary if stage < p.pp - 1 else 0.0)
    # Every forward before the first backward (GPipe; 1F1B on a stage with n <= pp - stage; one
    # micro-batch): the peak can precede any gradient.
    first_backward = inflight >= n
    grads = 0.0 if first_backward else accumulated
    held = r.layers + r.head
    moments = [  # (working copies, gradients, activations)
        (
            working,
            grads + fresh,
            held * (inflight - 1) + r.layers + flow + r.output_held,
        ),  # in a layer's backward
    ]
    if r.reduce_held and not accumulates:  # FSDP2 reduce-scatters each layer's gradients: in a
        # layer's backward (its recompute's activations there) the layer after's flat input is
        # still held, and the head's gradient; the layer's own gradients are mostly yet to come
        moments.append((working, grads + r.head_grad,
                        held * (inflight - 1) + r.layers + flow + r.output_held + r.reduce_held))  # fmt: skip
    if r.embed_grad:  # the first stage's backward ends in the embedding's: its gradient in the
        # compute dtype (vocab-parallel: whole, then its shard split off), the head's still there,
        # the last layer's reduce-scatter input held (a pipeline's stage reduces at its step's end)
        embed = r.embed_grad * (1 + 1 / p.tp) if p.tp > 1 and p.tp_col == 1 else r.embed_grad
        moments.append((r.root if p.zero_stage == 3 else r.whole, accumulated + r.head_grad + embed,
                        held * (inflight - 1) + (0.0 if accumulates else r.reduce_held)))  # fmt: skip
    if r.head:  # the loss, every layer's activations still there
        moments.append((r.root if p.zero_stage == 3 else r.whole, grads, held * inflight + r.loss))
    if first_backward and n > 1:  # GPipe: the next backward, with the first's gradients
        moments.append((working, accumulated + fresh, held * (inflight - 2) + r.layers + flow))
        if r.head:  # ... and its loss, the later micro-batches' logits still there
            moments.append((r.whole, accumulated, held * (inflight - 1) + r.loss))
    if bf16_accumulated:
        moments.append(landed)
    if r.offloaded:  # offloaded activations (trainer/offload.py): the peak is the MLP's or
        # attention's backward in the stage's last layer to run it, its saved tensors back from host
        # memory, every other layer's gradients there (all of them once a micro-batch has
        # accumulated them) and their compute-dtype weights gone (FSDP2's and replicate's resharded
        # at each post-backward, autocast's casts let go by the nodes that saved them), unless
        # another micro-batch's graph is in flight and holds them
        landed_grads = accumulated if accumulates and not first_backward else accumulated - r.first_grads
        gathered = r.root + r.unit if inflight <= 1 else working
        moments.append((gathered, landed_grads + fresh, held * (inflight - 1) + r.layers + flow + r.unpacked))
    if p.zero_stage == 3 and p.pp > 1:  # a backward that does not sync leaves its layers
        # gathered until their next forward: all of them at its last layer
        moments.append((r.whole, accumulated + fresh, held * (inflight - 1) + r.layer + flow))
    return max(moments, key=sum)
