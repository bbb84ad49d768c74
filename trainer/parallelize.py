"""Apply tensor, context, expert and data parallelism, activation checkpointing and compile to a GPT.

The order is fixed (torchtitan's): TP first (1D Megatron-LM, or 2D over tp x tp_col), because it
turns parameters into DTensors on the tensor-parallel axes; then CP, which gives each attention
its context-parallel group and the model its tokens' positions (before activation checkpointing
wraps the attention core); then EP, which splits a mixture of experts' routed experts over the ep
axis of the sparse mesh (ParallelDims.build_sparse_mesh); then activation checkpointing, which
wraps the (already parallel) blocks; then compile of each block; then FSDP2 / replicate on the dp
axes (the experts over edp), which must see the final module tree. With cp > 1 the data-parallel
mesh is dp x cp (ParallelDims.weight_axes): the cp ranks hold the same weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.context_parallel import CPComm
from trainer.contract.parallel import ParallelConfig
from trainer.contract.rules import ACTIVATION_CHECKPOINTS, RECOMPUTE_MODULES, gathers_norms_again
from trainer.model import GPT, LatentAttention
from trainer.moe import MoEComm, local, moe_layers
from trainer.offload import offload_activations
from trainer.parallel_dims import ParallelDims
from trainer.tp2d import apply_tp_2d


def parallelize_gpt(
    model: GPT,
    mesh: DeviceMesh | None,
    dims: ParallelDims,
    parallel: ParallelConfig,
    *,
    param_dtype: torch.dtype,
    compile: bool = False,
    sparse_mesh: DeviceMesh | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> GPT:
    """Parallelise one model (or one pipeline stage of it) in place; returns it. A mixture of
    experts on several ranks needs `sparse_mesh` (ParallelDims.build_sparse_mesh). `reduce_dtype`:
    FSDP2's and replicate's for the gradients (BenchmarkConfig.grad_reduce_dtype): what they are
    reduced in and, without a sync (a pipeline's earlier micro-batches, no_sync), accumulated in."""
    if dims.tp_col > 1:  # 2D: row x column groups (trainer/tp2d.py)
        apply_tp_2d(model, mesh[dims.tensor_axes])
    elif dims.tp > 1:
        apply_tp(model, mesh["tp"], sequence_parallel=parallel.sequence_parallel)
    if dims.cp > 1:
        apply_cp(model, mesh["cp"])
    if sparse_mesh is not None:
        apply_ep(model, mesh, sparse_mesh, dims)
    if gathers_norms_again(parallel) and dims.tp_col == 1:
        for block in model.layers.values():
            block.gather_norms_again = True
    if parallel.activation_checkpoint != "none":
        apply_ac(model, parallel.activation_checkpoint)
    if compile:
        apply_compile(model)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if sparse_mesh is not None:
        apply_expert_dp(model, sparse_mesh["edp"], parallel.zero_stage, mp_policy)
    if dims.weight_axes:
        dp_mesh = mesh[dims.weight_axes]
        if parallel.zero_stage > 0 and dims.dp_shard == 1 and dims.cp > 1 and dims.dp_replicate > 1:
            dp_mesh = mesh["dp_replicate", "cp"]  # HSDP over cp alone: replicas x the cp shards
        if parallel.zero_stage > 0:  # FSDP2 (over dp_shard x cp, or cp alone), or HSDP with dp_replicate
            apply_fsdp(model, dp_mesh, reshard_after_forward=parallel.zero_stage == 3, mp_policy=mp_policy)
        else:
            apply_replicate(model, dp_mesh, mp_policy=mp_policy)
    return model


def apply_tp(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Megatron-LM tensor parallelism (Shoeybi et al. 2019) with optional sequence parallelism
    (Korthikanti et al. 2022): q/k/v and MLP-up column-parallel, out-proj and MLP-down
    row-parallel, embedding and head vocab-parallel, logits left vocab-sharded for loss_parallel.

    Llama's block splits the same way (torchtitan's plan): k and v column-parallel over whole KV
    heads (tp divides num_kv_heads, a layout rule), so each rank's query heads find their KV head
    on the same rank; SwiGLU's gate column-parallel like the fc it multiplies; a q/k/v bias sharded
    with its weight's rows; RMSNorm like LayerNorm. Rotary positions need nothing: every rank
    holds whole heads of full head_dim, and attention sees whole sequences.

    Between blocks activations are replicated (plain tensors), or with sequence parallelism
    sharded on the sequence dim: norms run on 1/tp of the tokens and each all-reduce becomes a
    reduce-scatter + all-gather pair."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, object] = {}
    if model.embed is not None:
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sequence_parallel:  # slice the summed embeddings to this rank's tokens (no comm)
            plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.head is not None:
        plan["head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if model.cfg.tie_embeddings and model.embed is not None and model.head is not None:
        # parallelize_module gave the embedding and the head a DTensor Parameter each, cut from the
        # one weight: tie them again. Both are vocab rows sharded on dim 0 (RowwiseParallel on an
        # embedding, ColwiseParallel on a linear layer), so the embedding's shard is the head's.
        model.head.weight = model.embed.tok.weight

    for block in model.layers.values():
        latent = isinstance(block.attn, LatentAttention)
        if latent:  # q's and kv's heads split, the latents whole on every rank
            up = ["attn.wq"] if block.attn.wq is not None else ["attn.wq_b"]
            layer_plan: dict[str, object] = {name: ColwiseParallel() for name in [*up, "attn.wkv_b"]}
            layer_plan["attn.wo"] = RowwiseParallel(output_layouts=seq)
            block.attn.tp_mesh = tp_mesh
        else:
            layer_plan = {
                "attn.wq": ColwiseParallel(),
                "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=seq),
            }
        if block.mlp is not None:
            layer_plan |= {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=seq)}
            if block.mlp.gate is not None:  # SwiGLU
                layer_plan["mlp.gate"] = ColwiseParallel()
        if sequence_parallel:
            # The attention's second input, the rotary table (or None), is left as it is.
            gather = PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None))
            gather_mlp = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            layer_plan |= {"attn_norm": SequenceParallel(), "attn": gather, "mlp_norm": SequenceParallel()}
            if block.mlp is not None:
                layer_plan["mlp"] = gather_mlp
            else:  # experts: each rank routes its own tokens (a DTensor of them, Shard(1))
                layer_plan["moe"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(seq,))
        parallelize_module(block, tp_mesh, layer_plan)
        # Replicated weights used on this rank's heads (q/k norms per head) or tokens (router,
        # shared expert): their gradients are partial sums over tp (DTensor Partial, reduced).
        parts = [] if latent else [block.attn.q_norm, block.attn.k_norm]
        if block.moe is not None:
            parts += [block.moe.router, block.moe.shared]
        for part in parts:
            if part is not None:
                _replicate_params(part, tp_mesh)


def apply_cp(model: GPT, cp_mesh: DeviceMesh) -> None:
    """Context parallelism (trainer/context_parallel.py): this rank holds two head-tail chunks of
    every sequence; positions (RoPE, learned) follow them and each attention gathers K/V over the
    cp group."""
    comm = CPComm(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank(), model.cfg.seq_len)
    model.set_positions(comm.positions)
    for block in model.layers.values():
        block.attn.cp = comm
        block.attn.core.cp = comm


def _replicate_params(module: nn.Module, mesh: DeviceMesh) -> None:
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            sub.register_parameter(name, nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()])))


def apply_ep(model: GPT, mesh: DeviceMesh | None, sparse_mesh: DeviceMesh, dims: ParallelDims) -> None:
    """Expert parallelism: each MoE layer's routed experts split whole over the ep axis (Shard(0)
    of each [E, ...] weight: E / ep per rank; no expert-TP, docs/parallelism.md), tokens sent to
    their experts' ranks and back by all-to-all (trainer/moe.py). The layers also get the groups
    over which they count tokens: the tensor-parallel group (sequence-wise auxiliary loss) and
    the stage's dp x cp x tp ranks (the global batch's load, for the expert bias and imbalance)."""
    dp = dims.dp_replicate * dims.dp_shard * dims.cp  # the dense weights' gradient: a mean over dp x cp
    ep_mesh = sparse_mesh["ep"]
    comm = MoEComm(
        ep_group=ep_mesh.get_group() if dims.ep > 1 else None,
        ep_size=dims.ep,
        ep_rank=ep_mesh.get_local_rank() if dims.ep > 1 else 0,
        tp_group=_sequence_group(mesh, dims),
        tp_size=dims.cp * dims.tp,
        stage_group=sparse_mesh["stage"].get_group() if dims.stage_size > 1 else None,
        # The experts' gradient is reduced by a mean over edp replicas, each of which summed the
        # contributions of all dp x cp x tp ranks' tokens; the dense weights' is a mean over dp x cp.
        expert_grad_scale=dims.edp / dp,
    )
    for moe in moe_layers([model]):
        moe.comm = comm
        if dims.ep > 1:
            experts = moe.experts
            for name, param in list(experts.named_parameters()):
                experts.register_parameter(
                    name, nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]))
                )


def _sequence_group(mesh: DeviceMesh | None, dims: ParallelDims) -> dist.ProcessGroup | None:
    """The ranks holding parts of the same sequences: tp under sequence parallelism, cp, or both
    (the sequence-wise auxiliary loss counts each sequence's tokens over them)."""
    axis = {(True, True): "cp_tp", (True, False): "cp", (False, True): "tp"}.get((dims.cp > 1, dims.tp > 1))
    return mesh[axis].get_group() if axis else None


def apply_expert_dp(
    model: GPT, edp_mesh: DeviceMesh, zero_stage: int, mp_policy: MixedPrecisionPolicy
) -> None:
    """The experts' data parallelism over edp (the ranks holding the same experts): FSDP2 when the
    layout shards (zero_stage 2 or 3), else replicated. Applied before the dense FSDP2, which then
    leaves the experts' parameters to these (torchtitan's per-parameter meshes). FSDP2 shards a
    rank's [E / ep, ...] expert weights on the expert dim when edp divides E / ep, else on their
    next dim (torchtitan's rule too): one expert a rank over 8 edp ranks would otherwise leave it
    whole on the first and nothing on the others (FSDP2 pads an uneven dim 0)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    edp = edp_mesh.size()
    for moe in moe_layers([model]):
        if zero_stage > 0:
            local_experts = local(moe.experts.w1).shape[0]  # E / ep after expert parallelism
            dim = 0 if local_experts % edp == 0 else 1
            fully_shard(
                moe.experts, mesh=edp_mesh, reshard_after_forward=zero_stage == 3, mp_policy=mp_policy,
                shard_placement_fn=lambda param, dim=dim: Shard(dim),
            )  # fmt: skip
        else:
            replicate(moe.experts, mesh=edp_mesh, mp_policy=mp_policy)


def _expert_params(module: nn.Module) -> set[nn.Parameter] | None:
    """The experts' parameters when no expert data parallelism manages them (edp 1): the dense
    FSDP2 / replicate must leave them alone (they are split over ep, not replicated over dp)."""
    params = {q for m in moe_layers([module]) if not hasattr(m.experts, "set_requires_gradient_sync")
              for q in m.experts.parameters()}  # fmt: skip
    return params or None


def apply_ac(model: GPT, mode: str) -> None:
    """full: recompute whole blocks in backward. selective: recompute only the attention core
    (QK^T, softmax, @V), which holds the O(s^2) activations and no collective. moe_act: the routed
    experts' activation, as Megatron-LM's --recompute-modules moe_act (trainer/moe.py
    recompute_without_output); layernorm: the norms' outputs; mla_up_proj: latent attention's q, k
    and v, computed again from the latents (trainer/model.py LatentAttention), and their "+"
    combinations. op: torchtitan's op-level selective checkpointing of each block
    (op_sac_policy), as torchtitan's SelectiveAC. offload: nothing recomputed, each block's saved
    activations wait in host memory for its backward (trainer/offload.py)."""
    preserve_rng = model.cfg.dropout > 0
    for name, block in list(model.layers.named_children()):
        if mode == "full":
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=preserve_rng))
        elif mode == "selective":
            block.attn.core = checkpoint_wrapper(block.attn.core, preserve_rng_state=preserve_rng)
        elif mode == "op":
            model.layers.register_module(name, op_sac_wrap(block, preserve_rng))
        elif mode == "offload":
            offload_activations(block)
        elif set(mode.split("+")) <= set(RECOMPUTE_MODULES):  # Megatron's recompute modules
            modules = mode.split("+")
            block.recompute_norms = "layernorm" in modules
            if isinstance(block.attn, LatentAttention):
                block.attn.recompute_up = "mla_up_proj" in modules
            for layer in moe_layers([block]):
                layer.experts.recompute_act = "moe_act" in modules
        else:
            raise ValueError(f"activation_checkpoint {mode!r} is not one of {ACTIVATION_CHECKPOINTS}")


def _op_sac_saved() -> set:
    """The ops whose outputs op-level checkpointing keeps, as torchtitan 0.3.0 lists them
    (torchtitan/distributed/activation_checkpoint.py, _get_default_save_ops): the partitioner's
    compute-intensive ops (mm, addmm, bmm, the CUDA SDPA kernels; not the CPU's SDPA kernel nor
    the grouped GEMM), the other SDPA kernels, max, linear, topk, and the functional reduce-scatter
    and all-to-all. Resolved when first asked: an op this build lacks is left out."""
    from torch._functorch.partitioners import get_default_op_list

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    names = [
        (aten, "_scaled_dot_product_cudnn_attention"), (aten, "_scaled_dot_product_attention_math"),
        (aten, "_scaled_dot_product_fused_attention_overrideable"), (aten, "max"), (aten, "linear"),
        (aten, "topk"), (c10d, "reduce_scatter_tensor"), (c10d, "all_to_all_single"),
    ]  # fmt: skip
    saved = {op.default for op in get_default_op_list().compute_intensive_ops}
    return saved | {getattr(ns, name).default for ns, name in names if hasattr(ns, name)}


def op_sac_policy(saved: set, counts: dict, recomputed_shapes: set):
    """torchtitan's SelectiveAC policy (0.3.0): keep the outputs of the saved ops and of
    device-to-host copies, recompute everything else (norms, activations, rotations, casts,
    all-gathers, all-reduces) in backward; of the matmuls (mm, linear) every second one of a
    block's forward is recomputed too (counted apart in the forward and the recompute, so both
    choose alike), and those with a router's weight shape always (force_recompute_mm_shapes_by_fqns'
    default, "moe.router.gate")."""
    from torch.utils.checkpoint import CheckpointPolicy

    mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)

    def policy(ctx, op, *args, **kwargs):
        if (
            op == torch.ops.aten._to_copy.default
            and args[0].device.type == "cuda"
            and str(kwargs.get("device")) == "cpu"
        ):
            return CheckpointPolicy.MUST_SAVE
        key = "recompute" if ctx.is_recompute else "forward"
        if op in mm_ops:
            shape = tuple(args[1].shape)
            if (shape[::-1] if op == torch.ops.aten.linear.default else shape) in recomputed_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[key] += 1
        if op in saved:
            if op in mm_ops and counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_sac_wrap(block: nn.Module, preserve_rng: bool) -> nn.Module:
    """A block under op-level checkpointing, torchtitan's way: a fresh matmul count for each
    forward, no early stop of the recompute."""
    from torch.utils import checkpoint

    # FSDP2's hooks on a module inside the block (the experts' own FSDP2) mark their work with
    # record_function, a different number of times in forward and recompute: profiler marks keep
    # no tensor, so selective checkpointing lets them pass uncounted (as it does detach)
    profiler = torch.ops.profiler
    checkpoint.SAC_IGNORED_OPS.update(
        {
            profiler._record_function_enter_new.default,
            profiler._record_function_exit.default,
            profiler._record_function_exit._RecordFunction,
        }
    )
    saved = _op_sac_saved()
    # the router's mm as the policy sees it: (in, out) of its weight
    routers = {
        tuple(m.weight.shape[::-1]) for name, m in block.named_modules() if name.endswith("router.gate")
    }

    def contexts():
        counts = {"forward": 0, "recompute": 0}
        return checkpoint.create_selective_checkpoint_contexts(op_sac_policy(saved, counts, routers))

    return checkpoint_wrapper(block, preserve_rng_state=preserve_rng, context_fn=contexts, early_stop=False)


def apply_compile(model: GPT) -> None:
    """Compile each block on its own: blocks are identical, so one graph serves all of them."""
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, fullgraph=True))


def apply_fsdp(
    model: GPT, dp_mesh: DeviceMesh, *, reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy
) -> None:
    """FSDP2 per block, then the root. zero_stage 3 reshards each block after its forward;
    zero_stage 2 keeps it gathered until its backward (docs/parallelism.md). The root keeps the
    default (no reshard): its head runs backward right after forward."""
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                    ignored_params=_expert_params(block))  # fmt: skip
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=_expert_params(model))


def apply_replicate(model: GPT, dp_mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy) -> None:
    """Plain data parallelism: whole replicas, gradients all-reduced per block as backward
    reaches it. FSDP2's replicate, because the DDP wrapper does not take DTensor (TP) modules."""
    # Imported here: older torch releases (e.g. 2.11 on some GPU images) lack this module, and
    # layouts without replicated DP should still run there.
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in model.layers.values():
        replicate(block, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=_expert_params(block))
    replicate(model, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=_expert_params(model))


def data_parallel_modules(model: nn.Module) -> list[nn.Module]:
    """Modules that own gradient synchronisation (FSDP2 / replicate roots)."""
    return [m for m in model.modules() if hasattr(m, "set_requires_gradient_sync")]
