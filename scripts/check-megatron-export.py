"""Runs exported Megatron-LM commands (tuner export --format megatron) through Megatron-LM's own
`parse_args` and `validate_args`, with the environment each command sets, and builds the
TransformerConfig pretrain_gpt.py builds from them (its checks of a mixture of experts and of latent
attention); or writes the parser's flag list, which tests/tuner/test_export.py checks every golden
export against (docs/exports.md).

Needs megatron-core >= 0.19 (the first release that ships megatron/training/arguments.py; it
requires Python 3.12) and triton (its MoE kernels are imported with the parser). On Python 3.11,
unpack the wheel instead of installing it; typing.override (3.12) is then taken from
typing_extensions:

    pip download megatron-core==0.19.2 --no-deps --python-version 3.12 --only-binary=:all: -d /tmp/mc
    unzip -q /tmp/mc/megatron_core-0.19.2-*.whl -d /tmp/mc/src
    PYTHONPATH=/tmp/mc/src python scripts/check-megatron-export.py tests/tuner/golden/export_megatron_*.txt
    PYTHONPATH=/tmp/mc/src python scripts/check-megatron-export.py --flags-out tests/tuner/megatron_flags.txt

validate_args asks the GPU's architecture (CUDA_DEVICE_MAX_CONNECTIONS rules differ before
Blackwell); --arch gives it (default 9, Hopper), so the check runs on a machine without a GPU.
Data, tokenizer and iteration arguments, which an export leaves to the user, are added.
--json prints, for each export, what Megatron parsed (MODEL_ARGS and the layout; MOE_ARGS and RECOMPUTE_ARGS from the
TransformerConfig) or its refusal:
tests/tuner/test_export.py compares that with the study's model (it downloads and unpacks the
wheel as above, or takes MEGATRON_SRC, an unpacked copy).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import shlex
import sys
import typing
from pathlib import Path

if not hasattr(typing, "override"):  # Python 3.11: megatron.training uses typing.override (3.12)
    import typing_extensions

    typing.override = typing_extensions.override

# What an export leaves to the user (data, tokenizer, iterations), so that validation can run.
RUN_ARGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257",
            "--train-iters", "10", "--lr", "1e-4"]  # fmt: skip


# The model as Megatron's arguments describe it after validate_args (tests/tuner/test_export.py).
MODEL_ARGS = ["num_layers", "hidden_size", "num_attention_heads", "group_query_attention", "num_query_groups",
              "kv_channels", "ffn_hidden_size", "seq_length", "max_position_embeddings", "normalization",
              "layernorm_epsilon", "swiglu", "position_embedding_type", "rotary_base", "rotary_percent",
              "rotary_interleaved", "use_rope_scaling", "rope_scaling_factor",
              "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias",
              "attention_dropout", "hidden_dropout", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "data_parallel_size", "context_parallel_size"]  # fmt: skip
# A mixture of experts, the attention variants and context parallelism's communication, as
# TransformerConfig holds them (None: not set).
MOE_ARGS = ["num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "moe_layer_freq", "moe_router_score_function", "moe_router_pre_softmax",
            "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
            "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_dtype",
            "moe_router_load_balancing_type",
            "moe_aux_loss_coeff", "moe_router_force_load_balancing", "moe_grouped_gemm",
            "moe_token_dispatcher_type", "expert_model_parallel_size", "expert_tensor_parallel_size",
            "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
            "qk_layernorm", "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
            "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "cp_comm_type"]  # fmt: skip
# Activation recomputation, as TransformerConfig holds it after its own checks (recompute_modules'
# choices, moe_act's need of the grouped GEMM).
RECOMPUTE_ARGS = ["recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"]


def split_command(text: str) -> tuple[dict[str, str | None], int, list[str]]:
    """(environment: name -> value, or None for unset; world size; pretrain_gpt.py arguments)."""
    words = shlex.split(text.replace("\\\n", " "), comments=True)
    script = words.index("pretrain_gpt.py")
    launcher, env = words[:script], {}
    if launcher[0] == "env":
        assert launcher[1] == "-u", launcher
        env[launcher[2]] = None
        launcher = launcher[3:]
    while "=" in launcher[0]:
        name, value = launcher.pop(0).split("=", 1)
        env[name] = value
    options = dict(word.split("=", 1) for word in launcher[1:])
    return env, int(options["--nproc-per-node"]) * int(options["--nnodes"]), words[script + 1 :]


def validate(text: str, arch: int) -> tuple[argparse.Namespace, object]:
    """Megatron's parse_args + validate_args on one exported command, then the TransformerConfig
    (MLATransformerConfig for latent attention) that pretrain_gpt.py builds from the arguments and
    whose __post_init__ checks the model (its mixture-of-experts rules among them): (arguments,
    config). AssertionError or ValueError if refused."""
    import megatron.training.arguments as arguments
    import torch
    from megatron.training.argument_utils import core_transformer_config_from_args

    env, world_size, argv = split_command(text)
    for name, value in env.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0")
    arguments.get_device_arch_version = lambda: arch
    # --moe-grouped-gemm asks the GPU's compute capability (>= 8); the GPU named by --arch.
    torch.cuda.get_device_capability = lambda *_: (arch, 0)
    sys.argv = ["pretrain_gpt.py", *argv, *RUN_ARGS]
    with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
        args = arguments.parse_args()
        arguments.validate_args(args)
        checked = argparse.Namespace(**vars(args))
        if importlib.util.find_spec("transformer_engine") is None:
            # TransformerConfig refuses fused RoPE without Transformer Engine (a GPU machine's
            # package, not the export's choice): checked here without it.
            checked.apply_rope_fusion = False
        config = core_transformer_config_from_args(checked)
    return args, config


def layers_by_stage(config: object) -> list[int] | None:
    """Decoder layers of each pipeline stage in stage order (virtual stage v of pp rank r is stage
    v pp + r) as TransformerConfig's --pipeline-model-parallel-layout places them; None without one
    (Megatron then splits the layers evenly)."""
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is None:
        return None
    from megatron.core.transformer.enums import LayerType

    pp, vpp = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size
    return [layout.layout[r][v].count(LayerType.decoder) for v in range(vpp) for r in range(pp)]


def write_flags(path: str) -> None:
    from megatron.core.package_info import __version__
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    flags = sorted({flag for action in parser._actions for flag in action.option_strings})
    with open(path, "w") as f:
        f.write(f"# megatron-core {__version__}: megatron/training/arguments.py add_megatron_arguments, "
                "every option (scripts/check-megatron-export.py --flags-out)\n")  # fmt: skip
        f.writelines(f"{flag}\n" for flag in flags)
    print(f"{len(flags)} flags of megatron-core {__version__} -> {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="*", help="files written by tuner export --format megatron")
    parser.add_argument(
        "--arch", type=int, default=9, help="GPU major version (8 Ampere, 9 Hopper, 10 Blackwell)"
    )
    parser.add_argument("--flags-out", help="write the parser's flags to this file")
    parser.add_argument("--json", action="store_true", help="print what Megatron parsed as JSON")
    opts = parser.parse_args()
    if opts.flags_out:
        write_flags(opts.flags_out)
    failed, parsed = 0, {}
    for path in opts.exports:
        try:
            args, config = validate(Path(path).read_text(), opts.arch)
        except (AssertionError, ValueError) as e:
            failed += 1
            parsed[path] = {"error": str(e)}
            if not opts.json:
                print(f"REFUSED {path}: {e}")
            continue
        parsed[path] = {name: getattr(args, name) for name in MODEL_ARGS}
        parsed[path] |= {name: getattr(config, name, None) for name in MOE_ARGS + RECOMPUTE_ARGS}
        parsed[path] |= {"virtual_pipeline_model_parallel_size": args.virtual_pipeline_model_parallel_size,
                         "decoder_layers_by_stage": layers_by_stage(config)}  # fmt: skip
        if opts.json:
            continue
        print(f"ok {path}: tp {args.tensor_model_parallel_size} pp {args.pipeline_model_parallel_size} "
              f"cp {args.context_parallel_size} "
              f"vpp {args.virtual_pipeline_model_parallel_size} dp {args.data_parallel_size} "
              f"sp {args.sequence_parallel} fsdp2 {args.use_torch_fsdp2} "
              f"dist-opt {args.use_distributed_optimizer}")  # fmt: skip
    if opts.json:
        print(json.dumps(parsed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
