"""Loads torchtitan config modules with torchtitan's own ConfigManager, as `torchtitan.train`
does, and prints what it parsed as JSON: tests/tuner/test_export.py runs this in a process of its
own, because loading a config imports triton and registers torchtitan's operators with torch.

    python tests/tuner/torchtitan_parse.py DIR CONFIG_FN MODULE:NUM_LAYERS...

For each MODULE (a file DIR/MODULE.py) one JSON object: the version of torchtitan, and either
`error` (what torchtitan refused) or the parsed `parallelism`, `training` and `compile` sections,
the activation checkpointing policy, the tokenizer and dataset paths it reads (and whether the
tokenizer is found from DIR), the gradient accumulation steps as the trainer derives them,
with pp > 1 the layers of each pipeline stage as torchtitan's pipeline splits a model of
NUM_LAYERS layers, and the `model` (model_facts): the model the config selects, checked against
the layout as torchtitan's trainer checks it and built on the meta device. With context parallelism
(context_parallel_degree > 1) also `cp_positions`: the token positions each cp rank holds, as
torchtitan's own cp_shard cuts a sequence with the config's load balancer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import io
import json
import os
import re
import sys
from types import SimpleNamespace


def stage_layers(parallelism, num_layers: int) -> list[list[int]]:
    """The layer indices of each pipeline stage, from torchtitan's own split (pipeline_llm)."""
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _get_pipeline_metadata,
    )

    dims = SimpleNamespace(pp=parallelism.pipeline_parallel_degree)
    stages, layers, first, last = _get_pipeline_metadata(
        dims, parallelism, SimpleNamespace(layers=[None] * num_layers)
    )
    parts = _generate_llm_fqn_per_model_part(stages, layers, first, last)
    return [
        [int(m.group(1)) for name in part if (m := re.fullmatch(r"layers\.(\d+)", name))] for part in parts
    ]


def moe_facts(config) -> dict:
    """model_facts of a mixture of experts (torchtitan's qwen3 or deepseek_v3): the shape, the
    attention, the experts and their router as the config holds them."""
    spec, model = config.model_spec, config.model_spec.model
    layers = model.layers
    moe = [layer.moe for layer in layers if getattr(layer, "moe", None) is not None]
    attention = layers[0].attention
    router = moe[0].router
    shared = moe[0].shared_experts
    norms = {model.norm.eps} | {n.eps for layer in layers for n in (layer.attention_norm, layer.ffn_norm)}
    facts = {
        "name": spec.name, "flavor": spec.flavor, "dim": model.dim, "vocab_size": model.vocab_size,
        "loss_vocab_size": config.loss.loss_fn.global_vocab_size, "n_layers": len(layers),
        "n_dense_layers": len(layers) - len(moe), "n_heads": attention.n_heads,
        "dense_hidden_dim": sorted({layer.feed_forward.w1.out_features for layer in layers
                                    if getattr(layer, "moe", None) is None}),
        "num_experts": sorted({m.num_experts for m in moe}),
        "moe_hidden_dim": sorted({m.routed_experts.inner_experts.hidden_dim for m in moe}),
        "top_k": sorted({m.router.top_k for m in moe}),
        "router": {name: getattr(router, name) for name in ("score_func", "route_norm", "route_scale",
                                                            "num_expert_groups", "num_limited_groups")},
        "load_balance_coeff": sorted({m.load_balance_coeff or 0.0 for m in moe}),
        "shared_hidden_dim": shared.w1.out_features if shared is not None else 0,
        "tied": model.enable_weight_tying if hasattr(model, "enable_weight_tying") else False,
    }  # fmt: skip
    if spec.name == "deepseek_v3":
        norms |= {n.eps for layer in layers for n in (layer.attention.q_norm, layer.attention.kv_norm)}
        facts["mla"] = {name: getattr(attention, name) for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                                     "qk_rope_head_dim", "v_head_dim")}  # fmt: skip
        facts["rope"] = {"theta": attention.rope.theta, "scaling": attention.rope.scaling}
    else:
        qk = {layer.attention.qk_norm is not None for layer in layers}
        norms |= {layer.attention.qk_norm.eps for layer in layers if layer.attention.qk_norm is not None}
        facts |= {"n_kv_heads": attention.n_kv_heads, "head_dim": attention.head_dim, "qk_norm": sorted(qk),
                  "rope": {"theta": attention.rope.theta}}  # fmt: skip
    facts["norm_eps"] = sorted(norms)
    try:
        model.update_from_config(config=config)
    except (ValueError, NotImplementedError) as e:
        return {"error": str(e)}
    facts["force_load_balance"] = sorted({m.router._debug_force_load_balance for m in moe})
    import torch

    with torch.device("meta"):
        built = model.build()
    facts["num_params"] = sum(p.numel() for p in built.parameters())
    error = check_cp_attention(config, built)
    return {"error": error} if error else facts


def model_facts(config) -> dict:
    """The model of the config's model_spec: its name and flavor, its shape as the config holds it,
    the vocabulary the loss is sized for, and the parameters of the model built on the meta device
    (tied weights once); or `error`, torchtitan's refusal of this model in this layout
    (update_from_config, which the trainer runs before it builds the model)."""
    import torch

    spec, model = config.model_spec, config.model_spec.model
    layers = model.layers
    if any(getattr(layer, "moe", None) is not None for layer in layers):
        return moe_facts(config)
    attention = layers[0].attention
    rope = attention.rope  # before update_from_config sets max_seq_len to the training seq_len
    facts = {
        "name": spec.name,
        "flavor": spec.flavor,
        "dim": model.dim,
        "vocab_size": model.vocab_size,
        "loss_vocab_size": config.loss.loss_fn.global_vocab_size,
        "n_layers": len(layers),
        "n_heads": attention.n_heads,
        "n_kv_heads": attention.n_kv_heads or attention.n_heads,
        "hidden_dim": sorted({layer.feed_forward.w1.out_features for layer in layers}),
        "tied": model.enable_weight_tying,
        "norm_eps": sorted({model.norm.eps} | {n.eps for layer in layers for n in (layer.attention_norm, layer.ffn_norm)}),
        "qkv_bias": sorted({layer.attention.qkv_linear.wqkv.bias for layer in layers}),
        "rope": {name: getattr(rope, name) for name in ("theta", "scaling", "scaling_factor", "low_freq_factor",
                                                        "high_freq_factor", "original_max_position_embeddings",
                                                        "max_seq_len")},
    }  # fmt: skip
    try:
        model.update_from_config(config=config)
    except (ValueError, NotImplementedError) as e:
        return {"error": str(e)}
    with torch.device("meta"):
        built = model.build()
    facts["num_params"] = sum(p.numel() for p in built.parameters())
    error = check_cp_attention(config, built)
    return {"error": error} if error else facts


def check_cp_attention(config, model) -> str | None:
    """torchtitan's own check of the attention a model runs under context parallelism
    (distributed/full_dtensor.py: validate_config, which its parallelize functions call under the
    default spmd_types backend): its refusal, or None."""
    from torchtitan.distributed.full_dtensor import validate_config
    from torchtitan.distributed.parallel_dims import ParallelDims

    par = config.parallelism
    if par.context_parallel_degree == 1 or par.spmd_backend == "partial_dtensor":
        return None
    world = (par.data_parallel_replicate_degree * par.data_parallel_shard_degree * par.context_parallel_degree
             * par.tensor_parallel_degree * par.pipeline_parallel_degree)  # fmt: skip
    dims = ParallelDims(dp_replicate=par.data_parallel_replicate_degree, dp_shard=par.data_parallel_shard_degree,
                        cp=par.context_parallel_degree, tp=par.tensor_parallel_degree,
                        pp=par.pipeline_parallel_degree, ep=par.expert_parallel_degree, world_size=world,
                        spmd_backend=par.spmd_backend)  # fmt: skip
    try:
        validate_config(dims, model)
    except NotImplementedError as e:
        return str(e)
    return None


def cp_positions(par, seq_len: int) -> list[list[int]]:
    """The positions of one sequence that each cp rank holds: torchtitan's cp_shard (what
    prepare_context_parallel_input runs on inputs, labels and positions) on a 1-D cp mesh of a fake
    process group, once per cp rank, with the config's load balancer."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed.context_parallel import cp_shard

    cp, out = par.context_parallel_degree, []
    for rank in range(cp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
        try:
            mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
            (shard,), _ = cp_shard(mesh, (torch.arange(seq_len).unsqueeze(0),), None,
                                   par.context_parallel_load_balancer)  # fmt: skip
            out.append(shard[0].tolist())
        finally:
            dist.destroy_process_group()
    return out


def build_meshes(parallel_dims, par) -> None:
    """ParallelDims.build_mesh, as torchtitan's trainer runs it, on a fake process group of the
    layout's world size: its sparse mesh (pp, dp_replicate, efsdp, ep) with efsdp = dp_shard x cp x
    tp / ep is where an ep that does not divide dp_shard x cp x tp is refused."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = (par.data_parallel_replicate_degree * par.data_parallel_shard_degree * par.context_parallel_degree
             * par.tensor_parallel_degree * par.pipeline_parallel_degree)  # fmt: skip
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        parallel_dims(dp_replicate=par.data_parallel_replicate_degree, dp_shard=par.data_parallel_shard_degree,
                      cp=par.context_parallel_degree, tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
                      ep=par.expert_parallel_degree, world_size=world).build_mesh()  # fmt: skip
    finally:
        dist.destroy_process_group()


def parse(module: str, config_fn: str, num_layers: int) -> dict:
    from torchtitan.config import ConfigManager
    from torchtitan.hf_datasets.text_datasets import DATASETS

    try:  # ConfigManager reports any ImportError inside the module as "Cannot import module"
        importlib.import_module(module)
    except ImportError as e:
        return {"error": f"import {module}: {e!r}"}
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            config = ConfigManager().parse_args(["--module", module, "--config", config_fn])
    except (ValueError, ImportError) as e:
        return {"error": str(e)}
    except SystemExit:  # tyro refused the config: its message went to stderr
        return {"error": " ".join(stderr.getvalue().split())}
    from torchtitan.distributed.parallel_dims import ParallelDims

    par, train = config.parallelism, config.training
    if par.expert_parallel_degree > 1 or par.context_parallel_degree > 1:  # its own meshes, on a fake group
        try:
            build_meshes(ParallelDims, par)
        except (ValueError, AssertionError) as e:
            return {"error": str(e)}
    dp = par.data_parallel_replicate_degree * par.data_parallel_shard_degree
    out = {
        "parallelism": dataclasses.asdict(par),
        "training": dataclasses.asdict(train),
        "compile": dataclasses.asdict(config.compile),
        "activation_checkpoint": type(config.activation_checkpoint).__qualname__,
        # Where the run reads its tokenizer and data (hf_datasets: DATASETS), and whether they exist
        # from this working directory, which is not a torchtitan source checkout.
        "hf_assets_path": config.hf_assets_path,
        "dataset": config.dataloader.dataset,
        "dataset_path": config.dataloader.dataset_path or DATASETS[config.dataloader.dataset].path,
        "assets_found": os.path.exists(config.hf_assets_path),
        # torchtitan.trainer.Trainer.__init__: global // (local x data-parallel degree)
        "gradient_accumulation_steps": train.global_batch_size // (train.local_batch_size * dp),
    }
    if par.pipeline_parallel_degree > 1:
        try:
            out["stage_layers"] = stage_layers(par, num_layers)
        except ValueError as e:  # torchtitan's pipeline cannot split this model so
            return {"error": str(e)}
    out["model"] = model_facts(config)
    if "error" in out["model"]:
        return out["model"]
    if par.context_parallel_degree > 1:
        out["cp_positions"] = cp_positions(par, train.seq_len)
    return out


def main() -> None:
    folder, config_fn, *modules = sys.argv[1:]
    os.environ["COLUMNS"] = "1000"  # tyro's error box: one line per message, whatever the terminal
    sys.path.insert(0, folder)
    version = importlib.metadata.version("torchtitan")
    results = {}
    for item in modules:
        module, num_layers = item.split(":")
        results[module] = {"torchtitan": version, **parse(module, config_fn, int(num_layers))}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
