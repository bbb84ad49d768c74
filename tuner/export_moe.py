"""What the exports (tuner/export.py, tuner/export_model.py) add for the attention variants and the
mixtures of experts of trainer/contract/model.py's ModelConfig: wide heads and q/k norms (Qwen3, OLMoE),
DeepSeek's latent attention, and routed experts over expert parallelism (ParallelConfig.ep).

Megatron-LM (megatron-core 0.19.2; every flag is one of its parser's, tests/tuner/megatron_flags.txt,
and scripts/check-megatron-export.py runs validate_args and builds its TransformerConfig):
- experts: --num-experts, --moe-router-topk, --moe-ffn-hidden-size, a shared expert's
  --moe-shared-expert-intermediate-size, the dense first layers as a --moe-layer-freq pattern,
  --moe-grouped-gemm and the all-to-all dispatcher (--moe-token-dispatcher-type alltoall), the
  one our trainer runs (issue 27: all_to_all_single);
- the router: --moe-router-score-function; softmax with the top-k weights renormalised is
  Megatron's default (softmax over the top-k logits: the same weights), unnormalised (OLMoE) is
  --moe-router-pre-softmax; sigmoid scores are always renormalised (megatron/core/transformer/moe/
  moe_utils.py: topk_routing_with_score_function), so sigmoid without renormalising is refused;
  --moe-router-topk-scaling-factor, group-limited routing (--moe-router-num-groups,
  --moe-router-group-topk), the auxiliary-loss-free expert bias (--moe-router-enable-expert-bias,
  --moe-router-bias-update-rate; Megatron takes it with sigmoid scores only);
- load balancing: ModelConfig.moe_aux_loss_coef is the sequence-wise auxiliary loss (its comment in
  trainer/contract/model.py), Megatron's seq_aux_loss; none without it; --moe-router-force-load-balancing
  for a study measured with balanced routing (BenchmarkConfig.moe_routing);
- parallelism: --expert-model-parallel-size ep and --expert-tensor-parallel-size 1 (experts are
  never split over tp: trainer/contract/rules.py, ep_rules); Megatron's expert grid
  ETP x EP x EDP x PP then has the trainer's expert data parallelism (edp = dp x cp x tp / ep);
- attention: --kv-channels for heads wider than hidden / heads, --qk-layernorm for per-head q/k
  norms (OLMoE's norms over the whole projections have no Megatron flag: refused), and
  --multi-latent-attention with its ranks and widths, plain RoPE (--rope-type rope; Megatron's
  latent attention defaults to YaRN, whose fused kernel is YaRN only: --no-rope-fusion) and
  --qk-layernorm for the q and kv latents' norms.
torchtitan: see the torchtitan section below.
"""

from __future__ import annotations

import shlex

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig


def describe_moe(m: ModelConfig) -> str:
    """The attention and expert fields beyond the dense families, for the header: '' for those."""
    parts = []
    if m.attention == "mla":
        parts.append(
            f"latent attention (q rank {m.q_lora_rank}, kv rank {m.kv_lora_rank}, heads of {m.qk_nope_head_dim} + "
            f"{m.qk_rope_head_dim} rotary for q/k, {m.v_head_dim} for v)"
        )
    elif m.attention_head_dim:
        parts.append(f"heads of {m.attention_head_dim}")
    if m.qk_norm != "none":
        parts.append(
            {"head": "q/k norms per head", "proj": "q/k norms over the whole projections"}[m.qk_norm]
        )
    if m.moe:
        experts = f"{m.num_experts} experts of {m.expert_ffn_size}, top {m.moe_top_k}"
        if m.moe_shared_ffn_hidden_size:
            experts += f", a shared expert of {m.moe_shared_ffn_hidden_size}"
        if m.moe_dense_layers:
            experts += f", {m.moe_dense_layers} dense first layer(s)"
        router = f"{m.moe_router_score} router" + (
            " renormalised" if m.moe_norm_topk else " not renormalised"
        )
        if m.moe_route_scale != 1:
            router += f" x{m.moe_route_scale:g}"
        if m.moe_groups > 1:
            router += f", {m.moe_topk_groups} of {m.moe_groups} groups"
        if m.moe_bias_update_rate:
            router += f", expert bias rate {m.moe_bias_update_rate:g}"
        if m.moe_aux_loss_coef:
            router += f", auxiliary loss {m.moe_aux_loss_coef:g}"
        parts.append(f"{experts} ({router})")
    return "; ".join(parts)


# --- Megatron-LM ---


def megatron_attention_unsupported(m: ModelConfig) -> list[str]:
    if m.qk_norm == "proj":
        return [
            "qk_norm 'proj' (OLMoE's RMSNorm over the whole q and k projections): Megatron-LM's "
            "--qk-layernorm normalises each head"
        ]
    return []


def megatron_attention_args(m: ModelConfig) -> list[tuple[str, object]]:
    """Flags for the attention beyond multi-head / grouped-query attention of hidden / heads."""
    if m.attention == "mla":
        args: list[tuple[str, object]] = [("--multi-latent-attention", None)]
        if m.q_lora_rank:
            args.append(("--q-lora-rank", m.q_lora_rank))
        return [
            *args, ("--kv-lora-rank", m.kv_lora_rank), ("--qk-head-dim", m.qk_nope_head_dim),
            ("--qk-pos-emb-head-dim", m.qk_rope_head_dim), ("--v-head-dim", m.v_head_dim),
            ("--qk-layernorm", None), ("--rope-type", "rope"), ("--no-rope-fusion", None),
        ]  # fmt: skip
    args = [("--kv-channels", m.attention_head_dim)] if m.attention_head_dim else []
    if m.qk_norm == "head":
        args.append(("--qk-layernorm", None))
    return args


def megatron_moe_unsupported(m: ModelConfig) -> list[str]:
    if not m.moe:
        return []
    reasons = []
    if m.moe_router_score == "sigmoid" and not m.moe_norm_topk and m.moe_top_k > 1:
        reasons.append(
            "sigmoid router scores without renormalising the top-k (moe_norm_topk false): Megatron-LM "
            "always renormalises sigmoid scores"
        )
    if m.moe_router_score == "softmax" and m.moe_norm_topk and m.moe_top_k == 1:
        reasons.append(
            "softmax top-1 routing renormalised (a weight of 1): Megatron-LM needs --moe-router-pre-softmax "
            "for top-1, which keeps the softmax probability instead"
        )
    if m.moe_bias_update_rate and m.moe_router_score != "sigmoid":
        reasons.append(
            f"the expert bias (moe_bias_update_rate {m.moe_bias_update_rate:g}) with "
            f"{m.moe_router_score!r} scores: Megatron-LM's --moe-router-enable-expert-bias takes sigmoid scores only"
        )
    return reasons


def moe_layer_pattern(m: ModelConfig) -> str:
    """--moe-layer-freq's pattern for the dense first layers: '([0]*3+[1]*58)' (1: experts)."""
    return f"([0]*{m.moe_dense_layers}+[1]*{m.num_moe_layers})"


def megatron_moe_args(m: ModelConfig, config: ParallelConfig, routing: str) -> list[tuple[str, object]]:
    """The experts' flags, after the model's (megatron_model_args), and the expert layout."""
    if not m.moe:
        return []
    args: list[tuple[str, object]] = [
        ("--num-experts", m.num_experts), ("--moe-router-topk", m.moe_top_k),
        ("--moe-ffn-hidden-size", m.expert_ffn_size),
    ]  # fmt: skip
    if m.moe_shared_ffn_hidden_size:
        args.append(("--moe-shared-expert-intermediate-size", m.moe_shared_ffn_hidden_size))
    if m.moe_dense_layers:
        args.append(("--moe-layer-freq", shlex.quote(moe_layer_pattern(m))))
    args.append(("--moe-router-score-function", m.moe_router_score))
    if m.moe_router_score == "softmax" and not m.moe_norm_topk:
        args.append(("--moe-router-pre-softmax", None))  # softmax over all experts, top-k weights as they are
    if m.moe_route_scale != 1:
        args.append(("--moe-router-topk-scaling-factor", f"{m.moe_route_scale:g}"))
    if m.moe_groups > 1:
        args += [("--moe-router-num-groups", m.moe_groups), ("--moe-router-group-topk", m.moe_topk_groups)]
    if m.moe_bias_update_rate:
        args += [("--moe-router-enable-expert-bias", None),
                 ("--moe-router-bias-update-rate", f"{m.moe_bias_update_rate:g}")]  # fmt: skip
    if m.moe_aux_loss_coef:
        args += [("--moe-router-load-balancing-type", "seq_aux_loss"),
                 ("--moe-aux-loss-coeff", f"{m.moe_aux_loss_coef:g}")]  # fmt: skip
    else:
        args.append(("--moe-router-load-balancing-type", "none"))
    if routing == "balanced":
        args.append(("--moe-router-force-load-balancing", None))
    return [
        *args, ("--moe-grouped-gemm", None), ("--moe-token-dispatcher-type", "alltoall"),
        ("--expert-model-parallel-size", config.ep), ("--expert-tensor-parallel-size", 1),
    ]  # fmt: skip


def megatron_moe_notes(m: ModelConfig, config: ParallelConfig, routing: str) -> list[str]:
    notes = []
    if m.attention == "mla":
        notes.append(
            "latent attention with plain RoPE (--rope-type rope), as the trainer builds it; Megatron's fused "
            "RoPE for latent attention is YaRN only (--no-rope-fusion)."
        )
    if not m.moe:
        return notes
    c = config
    ranks, sizes = (
        ("dp x cp x tp", f"dp {c.dp} x cp {c.cp} x tp {c.tp}")
        if c.cp > 1
        else ("dp x tp", f"dp {c.dp} x tp {c.tp}")
    )
    notes.append(
        f"experts: ep {c.ep} x etp 1 over the {ranks} ranks of each stage, so expert data parallelism is "
        f"{c.edp} ({sizes} / ep {c.ep}), as measured; dropless routing (no capacity factor)."
    )
    if m.moe_aux_loss_coef:
        notes.append(
            f"load balancing: the sequence-wise auxiliary loss (seq_aux_loss) x {m.moe_aux_loss_coef:g}, "
            "ModelConfig.moe_aux_loss_coef."
        )
    notes.append(
        "--moe-router-force-load-balancing: routing forced balanced, as the study measured it."
        if routing == "balanced"
        else "routing learned (dropless), as measured: per-expert load follows the router."
    )
    if c.zero_stage == 3 and c.ep > 1 and c.pp == 1:
        notes.append(
            "zero_stage 3 with ep > 1: Megatron's --use-torch-fsdp2 does not combine with expert "
            "parallelism, so this uses the distributed optimizer: parameters are not sharded and memory "
            "per GPU is higher than measured."
        )
    return notes


# --- torchtitan 0.3.0: a flavor of its qwen3 (experts on grouped-query attention) or deepseek_v3 ---
#
# A mixture of experts on the Llama block is a flavor of torchtitan's qwen3 model (models/qwen3:
# per-head q/k norms or none, rotary halves as our trainer and Hugging Face rotate them), its
# layers from torchtitan's own builders, the router, load balancing, shared expert and dense first
# layers set on them; latent attention is a flavor of its deepseek_v3 model (models/deepseek_v3,
# plain RoPE: no YaRN). Expert parallelism is `expert_parallel_degree`; torchtitan folds it into
# data_parallel_shard x context x tensor parallelism (distributed/parallel_dims.py: efsdp =
# dp_shard x cp x tp / ep), so a layout whose ep takes dp_replicate ranks is refused. torchtitan's
# MoE has no auxiliary loss (its balancing is the expert bias, `load_balance_coeff`): said in a note.


def torchtitan_moe_builds(m: ModelConfig) -> bool:
    """Whether the export writes the model as a flavor of torchtitan's qwen3 or deepseek_v3."""
    return m.moe and (m.family == "deepseek" or (m.family == "llama" and m.qk_norm != "proj"))


def torchtitan_moe_unsupported(m: ModelConfig, config: ParallelConfig) -> list[str]:
    if not m.moe:
        return []
    reasons = []
    if m.family not in ("llama", "deepseek"):
        reasons.append(
            f"a mixture of experts on a {m.family} block: torchtitan's MoE models (qwen3, deepseek_v3) are "
            "RMSNorm, SwiGLU and RoPE"
        )
    if m.qk_norm == "proj":
        reasons.append(
            "qk_norm 'proj' (OLMoE's RMSNorm over the whole q and k projections): torchtitan has no such "
            "flavor (its qwen3 normalises each head)"
        )
    if m.dropout:
        reasons.append(f"dropout {m.dropout:g}: torchtitan's MoE models have no dropout")
    if m.qkv_bias:
        reasons.append("qkv_bias: torchtitan's qwen3 and deepseek_v3 have no bias on q, k and v")
    shard = config.dp_shard * config.cp * config.tp
    if shard % config.ep:
        cp_words = (" x context_parallel", f" x {config.cp}") if config.cp > 1 else ("", "")
        reasons.append(
            f"ep ({config.ep}) must divide data_parallel_shard{cp_words[0]} x tensor_parallel ({config.dp_shard}"
            f"{cp_words[1]} x {config.tp} = {shard}): torchtitan borrows expert ranks from those "
            "(distributed/parallel_dims.py), dp_replicate stays outer"
        )
    if m.attention == "mla" and m.moe_shared_ffn_hidden_size % m.expert_ffn_size:
        reasons.append(
            f"a shared expert of {m.moe_shared_ffn_hidden_size}: torchtitan's deepseek_v3 builds it as whole "
            f"experts of {m.expert_ffn_size}"
        )
    return reasons


def torchtitan_moe_imports(m: ModelConfig) -> list[str]:
    if m.attention == "mla":
        return [
            "from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm",
            "from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_configs, model_registry",
        ]
    return [
        "from torchtitan.models.common import CosSinRoPE, Embedding, Linear",
        *(
            ["from torchtitan.models.common.config_utils import make_ffn_config"]
            if m.moe_shared_ffn_hidden_size
            else []
        ),
        "from torchtitan.models.qwen3 import Qwen3Model, model_registry, qwen3_configs",
    ]


def _moe_lines(m: ModelConfig, first: int) -> list[str]:
    """The loop that sets the router, balancing and shared expert on torchtitan's MoE layers (after
    the `first` dense ones)."""
    layers = f"model.layers[{first}:]" if first else "model.layers"
    lines = [
        f"    for layer in {layers}:  # the router and balancing as measured",
        "        router = layer.moe.router",
        f'        router.score_func, router.route_norm = "{m.moe_router_score}", {m.moe_norm_topk}',
        f"        router.route_scale = {m.moe_route_scale!r}",
    ]
    if m.moe_groups > 1:
        lines.append(
            f"        router.num_expert_groups, router.num_limited_groups = {m.moe_groups}, {m.moe_topk_groups}"
        )
    else:
        lines.append("        router.num_expert_groups = router.num_limited_groups = None")
    rate = f"{m.moe_bias_update_rate!r}" if m.moe_bias_update_rate else "None"
    lines.append(
        f"        layer.moe.load_balance_coeff = {rate}  # the expert bias's update rate (None: no bias)"
    )
    return lines


def torchtitan_moe_model(m: ModelConfig, flavor: str, fn: str, embedding_init: str) -> list[str]:
    """The lines after the imports: torchtitan's helpers, BASE, FLAVOR, the model function and its
    registration (as torchtitan_model does for a Llama: tuner/export_model.py)."""
    base = [
        "",
        "# Data, tokenizer and optimizer: llama3_debugmodel's, whose tokenizer and data are in torchtitan's",
        "# source tree only (see the top), not this model's: for a real run, your config function with",
        f"# the model's tokenizer ({m.vocab_size} tokens).",
        "BASE = llama3_debugmodel",
        f'FLAVOR = "{flavor}"',
        "",
        "",
    ]
    if m.attention == "mla":
        return _deepseek_model(m, base, fn)
    return _qwen3_model(m, base, fn, embedding_init)


def _qwen3_model(m: ModelConfig, base: list[str], fn: str, embedding_init: str) -> list[str]:
    dense = m.moe_dense_layers
    qk = "qk_norm.eps = " if m.qk_norm == "head" else ""
    layers = [
        "    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=" + f"{m.seq_len}, theta={m.rope_theta!r})",
        "    shape = dict(dim=dim, n_heads=n_heads, n_kv_heads=" + f"{m.kv_heads}, head_dim=head_dim, "
        "attn_backend=attn_backend, rope=rope)",
        f"    dense = _build_qwen3_layers(n_layers={dense}, hidden_dim={m.ffn_size}, **shape)"
        if dense
        else "",
        f"    experts = _build_qwen3_moe_layers(n_layers={m.num_moe_layers}, moe_hidden_dim={m.expert_ffn_size}, "
        f"num_experts={m.num_experts}, top_k={m.moe_top_k}, moe_comm_backend=moe_comm_backend, **shape)",
    ]
    body = [
        "# torchtitan's own helpers for its qwen3 flavors (models/qwen3/__init__.py): layers and inits",
        "from torchtitan.models.qwen3 import (",
        f"    {embedding_init},",
        "    _LINEAR_INIT,",
        *(["    _build_qwen3_layers,"] if dense else []),
        "    _build_qwen3_moe_layers,",
        "    _qwen3_norm,",
        ")",
        *base,
        f'def {fn}(attn_backend: str = "flex", moe_comm_backend: str = "standard") -> Qwen3Model.Config:',
        '    """The study\'s model as a flavor of torchtitan\'s qwen3 model."""',
        f"    dim, n_heads, head_dim, vocab_size = {m.hidden_size}, {m.num_heads}, {m.head_dim}, {m.vocab_size}",
        *[line for line in layers if line],
        "    model = Qwen3Model.Config(",
        "        dim=dim,",
        "        vocab_size=vocab_size,",
        f"        enable_weight_tying={m.tie_embeddings},",
        "        norm=_qwen3_norm(dim),",
        f"        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim, param_init={embedding_init}),",
        "        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_LINEAR_INIT),",
        f"        layers={'dense + experts' if dense else 'experts'},",
        "    )",
        f"    model.norm.eps = {m.norm_eps!r}",
        "    for layer in model.layers:  # torchtitan's qwen3 helpers fix these",
        f"        layer.attention_norm.eps = layer.ffn_norm.eps = {m.norm_eps!r}",
        (
            f"        layer.attention.qk_norm.eps = {m.norm_eps!r}  # per-head q/k norms"
            if qk
            else "        layer.attention.qk_norm = None  # no q/k norms"
        ),
        *_moe_lines(m, dense),
    ]
    if m.moe_shared_ffn_hidden_size:
        body += [
            f"        layer.moe.shared_experts = make_ffn_config(dim=dim, hidden_dim={m.moe_shared_ffn_hidden_size}, "
            "w1_param_init=_LINEAR_INIT, w2w3_param_init=_LINEAR_INIT)",
        ]
    return [
        "",
        *body,
        "    return model",
        "",
        "",
        f"qwen3_configs[FLAVOR] = {fn}  # a flavor of torchtitan's qwen3: model_registry(FLAVOR)",
    ]


def _deepseek_model(m: ModelConfig, base: list[str], fn: str) -> list[str]:
    shared = m.moe_shared_ffn_hidden_size // m.expert_ffn_size
    eps = repr(m.norm_eps)
    body = [
        "# torchtitan's own helpers for its deepseek_v3 flavors (models/deepseek_v3/__init__.py)",
        "from torchtitan.models.deepseek_v3 import _EMBEDDING_INIT, _NORM_INIT, _build_dsv3_layers, _output_linear_init",
        *base,
        f'def {fn}(attn_backend: str = "flex", moe_comm_backend: str = "standard", '
        "non_blocking_capacity_factor: float | None = None, num_mtp_layers: int = 0) -> DeepSeekV3Model.Config:",
        '    """The study\'s model as a flavor of torchtitan\'s deepseek_v3 model (no multi-token prediction)."""',
        f"    dim, vocab_size = {m.hidden_size}, {m.vocab_size}",
        "    layers = _build_dsv3_layers(",
        f"        n_layers={m.num_layers}, n_dense_layers={m.moe_dense_layers}, dim=dim, n_heads={m.num_heads},",
        f"        q_lora_rank={m.q_lora_rank}, kv_lora_rank={m.kv_lora_rank}, qk_nope_head_dim={m.qk_nope_head_dim},",
        f"        qk_rope_head_dim={m.qk_rope_head_dim}, v_head_dim={m.v_head_dim}, mscale=1.0,",
        f"        dense_hidden_dim={m.ffn_size}, moe_hidden_dim={m.expert_ffn_size}, num_experts={m.num_experts},",
        f"        num_shared_experts={max(shared, 1)}, router_top_k={m.moe_top_k}, "
        f'router_score_func="{m.moe_router_score}",',
        "        attn_backend=attn_backend, moe_comm_backend=moe_comm_backend,",
        "        non_blocking_capacity_factor=non_blocking_capacity_factor,",
        f'        rope=ComplexRoPE.Config(dim={m.qk_rope_head_dim}, max_seq_len={m.seq_len}, theta={m.rope_theta!r}, scaling="none"),',
        "    )",
        "    model = DeepSeekV3Model.Config(",
        "        vocab_size=vocab_size,",
        "        dim=dim,",
        "        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim, param_init=_EMBEDDING_INIT),",
        f"        norm=RMSNorm.Config(normalized_shape=dim, eps={eps}, param_init=_NORM_INIT),",
        "        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_output_linear_init(dim)),",
        "        layers=layers,",
        "    )",
        "    for layer in model.layers:  # torchtitan's helper leaves the norms at their default eps",
        f"        layer.attention_norm.eps = layer.ffn_norm.eps = {eps}",
        f"        layer.attention.q_norm.eps = layer.attention.kv_norm.eps = {eps}",
        *_moe_lines(m, m.moe_dense_layers),
    ]
    if not shared:
        body.append("        layer.moe.shared_experts = None  # no shared expert")
    return [
        "",
        *body,
        "    return model",
        "",
        "",
        f"deepseekv3_configs[FLAVOR] = {fn}  # a flavor of torchtitan's deepseek_v3: model_registry(FLAVOR)",
    ]


def torchtitan_moe_parallelism(m: ModelConfig, config: ParallelConfig) -> list[str]:
    return [f"expert_parallel_degree = {config.ep}"] if m.moe else []


def torchtitan_moe_notes(m: ModelConfig, config: ParallelConfig, routing: str) -> list[str]:
    if not m.moe:
        return []
    borrowed = (
        "data_parallel_shard x context_parallel x tensor_parallel"
        if config.cp > 1
        else ("data_parallel_shard x tensor_parallel")
    )
    notes = [
        f"experts: expert_parallel_degree {config.ep}, borrowed from {borrowed} "
        f"(efsdp {config.dp_shard * config.cp * config.tp // config.ep}); the experts' FSDP runs over efsdp, "
        "the rest over dp."
    ]
    if m.moe_aux_loss_coef:
        notes.append(
            f"moe_aux_loss_coef {m.moe_aux_loss_coef:g}: torchtitan's MoE has no auxiliary loss (its balancing is "
            "the expert bias, load_balance_coeff): the loss differs from the measured one, the layout does not."
        )
    if routing == "balanced":
        notes.append(
            "config.debug.moe_force_load_balance: routing forced balanced (round robin), as measured."
        )
    if m.attention == "mla":
        notes.append(
            "RoPE: torchtitan's deepseek_v3 rotates adjacent pairs (ComplexRoPE), our trainer the two halves: the "
            "same model up to a fixed order of the rotary rows; no YaRN (the preset's pre-training context)."
        )
    return notes
