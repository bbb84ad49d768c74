"""trainer/contract/: the torch-free contract with the tuner."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainer.contract.model import ModelConfig
from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig, BenchmarkResult

TINY = MODEL_PRESETS["gpt-tiny"]


def test_config_module_does_not_import_torch() -> None:
    """The contract modules the tuner imports, and the local launch path (the static check:
    pyproject.toml's import-linter contracts)."""
    contract = ["axes", "rules", "parallel", "model", "presets", "result", "topology", "devices", "trial_dir"]
    modules = ["config", *(f"contract.{m}" for m in contract), "launch", "forkclient", "spawn"]
    code = f"import sys, {', '.join('trainer.' + m for m in modules)}; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_benchmark_config_json_round_trip() -> None:
    cfg = BenchmarkConfig(
        model=MODEL_PRESETS["gpt-1.3b"],
        parallel=ParallelConfig(
            tp=2,
            pp=4,
            dp_shard=2,
            zero_stage=3,
            micro_batch_size=2,
            num_microbatches=8,
            activation_checkpoint="selective",
            sequence_parallel=True,
            pp_schedule="interleaved_1f1b",
            virtual_stages=2,
        ),
        max_memory_bytes=80 * 2**30,
    )
    assert BenchmarkConfig.from_json(cfg.to_json()) == cfg


def test_model_preset_by_name() -> None:
    assert BenchmarkConfig.from_dict({"model": "gpt-tiny"}).model == TINY


def test_result_json_round_trip() -> None:
    r = BenchmarkResult(
        status="ok", step_times_s=[0.5, 0.25], losses=[1.0], peak_memory_bytes_per_rank=[3, 4]
    )
    assert BenchmarkResult.from_json(r.to_json()) == r


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"model": "gpt-tiny", "parallel": {"tpp": 2}}, "ParallelConfig: unknown field(s) ['tpp']"),
        ({"parallel": {}}, "missing field 'model'"),
        ({"model": {"num_layers": 2, "hidden_size": 64}}, "num_heads"),
        ({"model": "gpt-tiny", "warmup_steps": 0}, "warmup_steps must be >= 1"),
        ({"model": "gpt-tiny", "dtype": "fp16"}, "dtype 'fp16' is not one of"),
        ({"model": {"num_layers": 2, "hidden_size": 65, "num_heads": 4}}, "divisible by num_heads"),
    ],
)
def test_bad_config_names_the_field(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        BenchmarkConfig.from_json(json.dumps(data))


def test_layout_arithmetic() -> None:
    p = ParallelConfig(
        tp=4, pp=2, dp_replicate=2, dp_shard=3, zero_stage=3, micro_batch_size=2, num_microbatches=8
    )
    assert p.world_size == 4 * 2 * 2 * 3
    assert p.global_batch_size == 2 * 8 * 2 * 3
    assert p.describe() == "tp4 pp2(1f1b) dpr2 dps3(z3) mbs2x8"


@pytest.mark.parametrize(
    ("layout", "reason"),
    [
        (ParallelConfig(tp=3), "tp (3) must divide num_heads (4)"),
        (ParallelConfig(sequence_parallel=True), "sequence_parallel needs tp > 1"),
        (ParallelConfig(pp=8), "num_layers (4) < pp (8) * virtual_stages (1)"),
        (ParallelConfig(pp=2, num_microbatches=1), "1F1B needs num_microbatches (1) >= pp (2)"),
        (ParallelConfig(pp=2, virtual_stages=2, num_microbatches=2), "virtual_stages > 1 needs"),
        (
            ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", num_microbatches=2),
            "needs virtual_stages >= 2",
        ),
        (ParallelConfig(pp=2, pp_schedule="zb"), "pp_schedule 'zb' is not one of"),
        (
            ParallelConfig(pp=2, pp_schedule="zbv", virtual_stages=3, num_microbatches=6),
            "places two stages on each rank (a V): virtual_stages must be 2, got 3",
        ),
        (
            ParallelConfig(pp=2, pp_schedule="dualpipev", virtual_stages=2, num_microbatches=2),
            "needs num_microbatches (2) >= its stages (2 x pp = 4)",
        ),
        (ParallelConfig(dp_shard=2), "dp_shard (2) > 1 needs zero_stage 2 or 3"),
        (ParallelConfig(zero_stage=3), "zero_stage 3 needs dp_shard > 1 or cp > 1"),
        (
            ParallelConfig(activation_checkpoint="mla_up_proj"),
            "recomputes latent attention's up-projections: this model's attention is 'mha'",
        ),
        (ParallelConfig(dp_shard=2, zero_stage=1), "zero_stage 1 is not one of"),
        (ParallelConfig(activation_checkpoint="some"), "activation_checkpoint 'some'"),
        (
            ParallelConfig(cp=2, activation_checkpoint="op"),
            "activation_checkpoint op with cp (2) > 1 is not priced",
        ),
        (
            ParallelConfig(tp_col=2, activation_checkpoint="op"),
            "activation_checkpoint op with tp_col (2) > 1",
        ),
        (
            ParallelConfig(tp=2, activation_checkpoint="layernorm"),
            "activation_checkpoint layernorm with tp (2) > 1 needs sequence_parallel",
        ),
        (
            ParallelConfig(cp=2, activation_checkpoint="layernorm"),
            "activation_checkpoint layernorm with tp_col (1) or cp (2) > 1 is not built",
        ),
        (
            ParallelConfig(activation_checkpoint="moe_act"),
            "activation_checkpoint moe_act recomputes the routed experts' activation: this model has no experts",
        ),
        (ParallelConfig(micro_batch_size=0), "micro_batch_size must be >= 1"),
    ],
)
def test_invalid_layouts_say_why(layout: ParallelConfig, reason: str) -> None:
    assert any(reason in p for p in layout.problems(TINY)), layout.problems(TINY)


def test_valid_layouts_have_no_problems() -> None:
    for layout in [
        ParallelConfig(),
        ParallelConfig(tp=4, sequence_parallel=True),
        ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2, num_microbatches=4),
        ParallelConfig(pp=4, pp_schedule="gpipe", num_microbatches=1),
        ParallelConfig(dp_replicate=2, dp_shard=2, zero_stage=2),
    ]:
        assert layout.problems(TINY) == []


def test_vocab_must_split_over_tp() -> None:
    model = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=50257)
    assert any("pad the vocabulary" in p for p in ParallelConfig(tp=2).problems(model))


@pytest.mark.parametrize(
    ("preset", "billions"), [("gpt-1.3b", 1.42), ("gpt-22b", 22), ("gpt-175b", 175), ("gpt-1t", 1000)]
)
def test_presets_have_their_size(preset: str, billions: float) -> None:
    assert abs(MODEL_PRESETS[preset].num_params / 1e9 - billions) / billions < 0.05


def test_flops_per_token_is_palm_formula() -> None:
    m = MODEL_PRESETS["gpt-175b"]
    n = m.num_nonembed_params
    assert m.flops_per_token == 6 * n + 12 * 96 * 12288 * 2048
    # GPT-3 175B: ~6 * 175e9 = 1.05 TFLOP per token, plus attention.
    assert 1.0e12 < m.flops_per_token < 1.2e12


MOE = MODEL_PRESETS["moe-tiny"]


@pytest.mark.parametrize(
    ("layout", "rule"),
    [
        (ParallelConfig(ep=2), "ep must divide dp x tp"),
        (ParallelConfig(ep=3, dp_shard=3, zero_stage=2), "ep must divide num_experts"),
        (ParallelConfig(tp=2, ep=2), "a mixture of experts with tp > 1 needs sequence_parallel"),
        (ParallelConfig(tp=2, tp_col=2), "a mixture of experts needs tp_col 1"),
    ],
)
def test_moe_layouts_say_why(layout: ParallelConfig, rule: str) -> None:
    assert rule in [r for r, _ in layout.violations(MOE)]


def test_moe_layouts_fold_ep_into_data_and_tensor_parallelism() -> None:
    for layout in [
        ParallelConfig(dp_shard=2, zero_stage=3, ep=2),
        ParallelConfig(dp_replicate=2, ep=2),
        ParallelConfig(tp=2, sequence_parallel=True, dp_shard=2, zero_stage=2, ep=4),
        ParallelConfig(pp=2, dp_shard=2, zero_stage=2, ep=2, num_microbatches=2),
    ]:
        assert layout.problems(MOE) == [], layout
    assert ParallelConfig(tp=2, sequence_parallel=True, dp_shard=2, zero_stage=2, ep=4).edp == 1
    assert ParallelConfig(tp=2, sequence_parallel=True, dp_shard=4, zero_stage=2, ep=2).edp == 4
    assert ParallelConfig(dp_shard=2, zero_stage=2, ep=2).problems(TINY) == [
        "ep (2) > 1 needs a model with experts"
    ]


def test_moe_fields_are_validated_with_their_names() -> None:
    with pytest.raises(ValueError, match="need num_experts > 0"):
        ModelConfig(num_layers=2, hidden_size=64, num_heads=4, moe_top_k=2)
    with pytest.raises(ValueError, match=r"moe_top_k <= num_experts \(got 9\)"):
        ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_experts=8, moe_top_k=9)
    with pytest.raises(ValueError, match="moe_groups"):
        ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_experts=8, moe_top_k=2, moe_groups=3)
    with pytest.raises(ValueError, match="moe_dense_layers"):
        ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_experts=8, moe_top_k=2, moe_dense_layers=2)
    with pytest.raises(ValueError, match="attention 'mla' only"):
        ModelConfig(num_layers=2, hidden_size=64, num_heads=4, kv_lora_rank=16)


def test_a_dense_model_keeps_its_keys_and_a_moe_round_trips() -> None:
    """The fields added for experts and other attentions stay out of a dense model's dict (stored
    keys and golden scripts unchanged); a mixture of experts' dict has them and reads back."""
    dense = BenchmarkConfig(model=MODEL_PRESETS["llama-tiny"]).to_dict()
    assert not {"num_experts", "attention", "qk_norm"} & set(dense["model"])
    assert "ep" not in dense["parallel"] and "moe_routing" not in dense
    cfg = BenchmarkConfig(
        model=MODEL_PRESETS["moe-tiny-ds"], parallel=ParallelConfig(dp_shard=2, zero_stage=2, ep=2)
    )
    data = cfg.to_dict()
    assert data["parallel"]["ep"] == 2 and data["model"]["moe_shared_ffn_hidden_size"] == 64
    assert BenchmarkConfig.from_json(cfg.to_json()) == cfg


def test_moe_flops_count_the_active_experts() -> None:
    """Top-k of the routed experts per token: Mixtral's 12.9B of 46.7B."""
    m = MODEL_PRESETS["mixtral-8x7b"]
    dense_equivalent = 6 * (m.num_nonembed_params - 6 * m.expert_params * m.num_layers)
    assert m.flops_per_token == dense_equivalent + 12 * m.num_layers * m.hidden_size * m.seq_len
    assert round(m.num_active_params / 1e9, 1) == 12.9 and round(m.num_params / 1e9, 1) == 46.7
