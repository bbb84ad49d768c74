"""The mixtures of experts for torchtitan 0.3.0: a flavor of the MoE model their family registers
(Family.torchtitan_moe, trainer/contract/families/): its qwen3 (experts on grouped-query attention)
or deepseek_v3; a family that registers none is refused.

A mixture of experts on the Llama block is a flavor of torchtitan's qwen3 model (models/qwen3:
per-head q/k norms or none, rotary halves as our trainer and Hugging Face rotate them), its
layers from torchtitan's own builders, the router, load balancing, shared expert and dense first
layers set on them; latent attention is a flavor of its deepseek_v3 model (models/deepseek_v3,
plain RoPE: no YaRN). Expert parallelism is `expert_parallel_degree`; torchtitan folds it into
data_parallel_shard x context x tensor parallelism (distributed/parallel_dims.py: efsdp =
dp_shard x cp x tp / ep), so a layout whose ep takes dp_replicate ranks is refused. torchtitan's
MoE has no auxiliary loss (its balancing is the expert bias, `load_balance_coeff`): said in a note.
"""

from __future__ import annotations

from trainer.contract.families import family_of
from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig


def torchtitan_moe_flavor(m: ModelConfig) -> str | None:
    """The torchtitan model a mixture of experts is written as a flavor of: its family's
    (Family.torchtitan_moe: "qwen3" or "deepseek_v3"), unless torchtitan_moe_unsupported refuses the
    model; None for a dense model, which is models.py's."""
    if not m.moe or m.qk_norm == "proj":  # qwen3 normalises each head (torchtitan_moe_unsupported)
        return None
    return family_of(m).torchtitan_moe


def torchtitan_moe_unsupported(m: ModelConfig, config: ParallelConfig) -> list[str]:
    if not m.moe:  # the experts' refusals: a mixture of experts only
        return []
    reasons = []
    family = family_of(m)
    if family.torchtitan_moe is None:
        reasons.append(
            f"a mixture of experts on a {family.name} block: torchtitan's MoE models (qwen3, deepseek_v3) are "
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
    if family.torchtitan_moe == "deepseek_v3" and m.moe_shared_ffn_hidden_size % m.expert_ffn_size:
        reasons.append(
            f"a shared expert of {m.moe_shared_ffn_hidden_size}: torchtitan's deepseek_v3 builds it as whole "
            f"experts of {m.expert_ffn_size}"
        )
    return reasons


def torchtitan_moe_imports(m: ModelConfig) -> list[str]:
    if torchtitan_moe_flavor(m) == "deepseek_v3":
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
    rate = balance_coeff(m)
    why = ("the expert bias's update rate, as measured" if m.moe_bias_update_rate else
           "torchtitan's default expert bias in place of the auxiliary loss it lacks" if rate else "no balancing, as measured")  # fmt: skip
    lines.append(f"        layer.moe.load_balance_coeff = {rate!r}  # {why}")
    return lines


# torchtitan 0.3.0's MoE.Config.load_balance_coeff default (models/common/moe.py): the expert bias's
# update rate, its only load balancing (it has no auxiliary loss).
TORCHTITAN_BALANCE_COEFF = 1e-3


def balance_coeff(m: ModelConfig) -> float | None:
    """load_balance_coeff for the export: the model's expert-bias rate; where the model balances
    with an auxiliary loss only (Mixtral, Qwen3, OLMoE), torchtitan's default bias instead of none,
    which would train the experts unbalanced; None for a model with no balancing at all."""
    if m.moe_bias_update_rate:
        return m.moe_bias_update_rate
    return TORCHTITAN_BALANCE_COEFF if m.moe_aux_loss_coef else None


def torchtitan_moe_model(m: ModelConfig, flavor: str, fn: str, embedding_init: str) -> list[str]:
    """The lines after the imports: torchtitan's helpers, BASE, FLAVOR, the model function and its
    registration (as torchtitan_model does for a Llama: models.py)."""
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
    if torchtitan_moe_flavor(m) == "deepseek_v3":
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
    """The experts' ParallelismConfig field: a mixture of experts only."""
    return [f"expert_parallel_degree = {config.ep}"] if m.moe else []


def torchtitan_moe_notes(m: ModelConfig, config: ParallelConfig, routing: str) -> list[str]:
    if not m.moe:  # the experts' notes: a mixture of experts only
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
            "the expert bias, load_balance_coeff"
            + (
                ""
                if m.moe_bias_update_rate
                else f", set to its default {TORCHTITAN_BALANCE_COEFF:g} so the experts are balanced at all"
            )
            + "): the loss differs from the measured one, the layout does not."
        )
    if routing == "balanced":
        notes.append(
            "config.debug.moe_force_load_balance: routing forced balanced (round robin), as measured."
        )
    if torchtitan_moe_flavor(m) == "deepseek_v3":
        notes.append(
            "RoPE: torchtitan's deepseek_v3 rotates adjacent pairs (ComplexRoPE), our trainer the two halves: the "
            "same model up to a fixed order of the rotary rows; no YaRN (the preset's pre-training context)."
        )
    return notes
