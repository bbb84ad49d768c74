"""A model from a Hugging Face config.json (tuner/hfconfig.py): the published files read into the
presets they name, every refusal names its field, and a study spec reads the file where the spec
file is (never on a server)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from trainer.contract.model import ModelConfig
from trainer.contract.presets import MODEL_PRESETS
from tuner.hfconfig import DEFAULT_SEQ_LEN, HFConfigError, hf_config_fields, hf_config_notes, read_hf_config
from tuner.models import model_family, model_key, model_label
from tuner.spec import SpecError, default_tp, load_spec, parse_spec

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"
PRESET_OF = {
    "Llama-3.2-1B": "llama3.2-1b", "Llama-3.2-3B": "llama3.2-3b", "Llama-3.1-8B": "llama3.1-8b",
    "Llama-3.1-70B": "llama3.1-70b", "Llama-3.1-405B": "llama3.1-405b", "Qwen2.5-7B": "qwen2.5-7b",
}  # fmt: skip
STUDY = {"cluster": "h100-80gb", "training": {"global_batch_size": 64}}


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(PRESET_OF))
def test_a_published_config_reads_into_its_preset(name: str) -> None:
    model = ModelConfig(**read_hf_config(CONFIGS / f"{name}.json"))
    preset = MODEL_PRESETS[PRESET_OF[name]]
    assert dataclasses.replace(model, seq_len=preset.seq_len) == preset
    # not the 131072 positions the model supports: Llama 3's pre-training context
    assert model.seq_len == DEFAULT_SEQ_LEN == 8192
    assert model.family == "llama"


# The mixtures of experts' files -> their presets (trainer/contract/model.py), and the architecture each reads as.
MOE_PRESET_OF = {
    "Mixtral-8x7B-v0.1": ("mixtral-8x7b", "llama-moe"), "Qwen3-30B-A3B": ("qwen3-30b-a3b", "llama-moe"),
    "Qwen3-235B-A22B": ("qwen3-235b-a22b", "llama-moe"), "OLMoE-1B-7B-0924": ("olmoe-1b-7b", "llama-moe"),
    "DeepSeek-V3": ("deepseek-v3", "deepseek-moe"),
}  # fmt: skip
# Published total and active parameters, in billions, as rounded where published: the Qwen3 model
# cards (30.5 / 3.3, 235 / 22), the DeepSeek-V3 report's table 1 (671 / 37), the Mixtral paper
# (47 / 13), the OLMoE paper (6.9 / 1.3). Counted here within 2 % of each.
PUBLISHED_PARAMS = {"Mixtral-8x7B-v0.1": (47, 13), "Qwen3-30B-A3B": (30.5, 3.3), "Qwen3-235B-A22B": (235, 22),
                    "OLMoE-1B-7B-0924": (6.9, 1.3), "DeepSeek-V3": (671, 37)}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MOE_PRESET_OF))
def test_a_published_mixture_of_experts_reads_into_its_preset(name: str) -> None:
    """Every field of the preset, the parameter counts with it, and the preset's name as the key.
    OLMoE's file spells multi-head attention as 16 KV heads of 16 (the preset too; the reader None):
    the same model. DeepSeek-V3's file has aux_loss_alpha 0.001, read as is; its preset trains with
    the report's 0.0001 (DeepSeek-V3 report, section 4.2), the one field apart."""
    preset_name, architecture = MOE_PRESET_OF[name]
    model, preset = ModelConfig(**read_hf_config(CONFIGS / f"{name}.json")), MODEL_PRESETS[preset_name]
    same = dataclasses.replace(model, seq_len=preset.seq_len, num_kv_heads=preset.num_kv_heads)
    if name == "DeepSeek-V3":
        assert (model.moe_aux_loss_coef, preset.moe_aux_loss_coef) == (0.001, 0.0001)
        same = dataclasses.replace(same, moe_aux_loss_coef=preset.moe_aux_loss_coef)
    assert same == preset
    assert (model.num_params, model.num_active_params) == (preset.num_params, preset.num_active_params)
    total, active = PUBLISHED_PARAMS[name]
    assert model.num_params / 1e9 == pytest.approx(total, rel=0.02)
    assert model.num_active_params / 1e9 == pytest.approx(active, rel=0.02)
    assert model.architecture == architecture
    if name != "DeepSeek-V3":
        assert model_key(model) == preset_name


def test_the_moe_fields_each_architecture_reads() -> None:
    """Where each file keeps its experts (docs/models.md's table)."""
    mixtral, qwen, olmoe, deepseek = (
        hf_config_fields(_config(n)) for n in ("Mixtral-8x7B-v0.1", "Qwen3-30B-A3B", "OLMoE-1B-7B-0924", "DeepSeek-V3")
    )  # fmt: skip
    assert {k: mixtral[k] for k in ("num_experts", "moe_top_k", "moe_ffn_hidden_size", "moe_norm_topk")} == {
        "num_experts": 8, "moe_top_k": 2, "moe_ffn_hidden_size": 14336, "moe_norm_topk": True}  # fmt: skip
    assert (qwen["attention_head_dim"], qwen["qk_norm"], qwen["moe_ffn_hidden_size"], qwen["moe_dense_layers"]) == (
        128, "head", 768, 0)  # fmt: skip
    assert (olmoe["qk_norm"], olmoe["moe_norm_topk"], olmoe["moe_aux_loss_coef"]) == ("proj", False, 0.01)
    assert {k: deepseek[k] for k in ("attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                     "qk_rope_head_dim", "v_head_dim", "moe_shared_ffn_hidden_size",
                                     "moe_dense_layers", "moe_router_score", "moe_groups", "moe_topk_groups",
                                     "moe_route_scale", "moe_bias_update_rate")} == {
        "attention": "mla", "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "moe_shared_ffn_hidden_size": 2048, "moe_dense_layers": 3, "moe_router_score": "sigmoid",
        "moe_groups": 8, "moe_topk_groups": 4, "moe_route_scale": 2.5, "moe_bias_update_rate": 0.001}  # fmt: skip
    # Qwen3-MoE's dense first layers, DeepSeek's routing without groups or bias
    assert hf_config_fields(_config("Qwen3-30B-A3B") | {"mlp_only_layers": [0, 1]})["moe_dense_layers"] == 2
    greedy = hf_config_fields(_config("DeepSeek-V3") | {"topk_method": "greedy"})
    assert (greedy["moe_groups"], greedy["moe_topk_groups"], greedy["moe_bias_update_rate"]) == (1, 1, 0.0)


def test_qwen3_dense_reads_its_wide_heads_and_qk_norm() -> None:
    """Qwen3-8B (a dense model: 32 heads of 128 = its 4096 stream, per-head q/k norms): the model
    card's 8.2B parameters, 6.95B without the embedding and the head."""
    model = ModelConfig(**read_hf_config(CONFIGS / "Qwen3-8B.json"))
    assert (model.qk_norm, model.attention_head_dim, model.kv_heads, model.moe) == ("head", None, 8, False)
    assert round(model.num_params / 1e9, 1) == 8.2
    assert round((model.num_params - model.num_embedding_params - model.num_head_params) / 1e9, 2) == 6.95
    wide = hf_config_fields(_config("Qwen3-8B") | {"head_dim": 256})
    assert wide["attention_head_dim"] == 256 and ModelConfig(**wide).q_size == 32 * 256


def test_what_a_file_holds_beyond_the_model_is_noted() -> None:
    """DeepSeek-V3's YaRN scaling, multi-token prediction, the bias rate, FP8 storage and its
    auxiliary-loss coefficient are said (the CLI prints them); the other files have nothing to say."""
    notes = hf_config_notes(_config("DeepSeek-V3"))
    for said in ("rope_scaling 'yarn' (factor 40", "num_nextn_predict_layers 1", "moe_bias_update_rate 0.001",
                 "quantization_config 'fp8'", "aux_loss_alpha 0.001"):  # fmt: skip
        assert any(said in note for note in notes), (said, notes)
    assert all(hf_config_notes(_config(n)) == [] for n in (*PRESET_OF, *MOE_PRESET_OF) if n != "DeepSeek-V3")


def test_mistral_v0_3_reads_into_its_published_shape() -> None:
    model = ModelConfig(**read_hf_config(CONFIGS / "Mistral-7B-Instruct-v0.3.json"))
    shape = (
        model.num_layers,
        model.hidden_size,
        model.num_heads,
        model.kv_heads,
        model.ffn_size,
        model.vocab_size,
    )
    assert shape == (32, 4096, 32, 8, 14336, 32768)
    assert (model.rope_theta, model.rope_scaling_factor, model.tie_embeddings, model.qkv_bias) == (
        1e6,
        None,
        False,
        False,
    )
    assert round(model.num_params / 1e9, 2) == 7.25  # the model card's 7.25B


def test_seq_len_is_capped_at_the_context_the_model_supports() -> None:
    config = _config("Llama-3.1-8B") | {"max_position_embeddings": 4096}
    assert hf_config_fields(config)["seq_len"] == 4096


def test_llama_without_kv_heads_is_multi_head_attention() -> None:
    """LlamaConfig reads a missing num_key_value_heads as num_attention_heads (Llama 1 files)."""
    config = {k: v for k, v in _config("Llama-3.1-8B").items() if k != "num_key_value_heads"}
    fields = hf_config_fields(config)
    assert fields["num_kv_heads"] is None and ModelConfig(**fields).kv_heads == 32


def test_transformers_5_rope_parameters_read_as_rope_scaling() -> None:
    """transformers 5 saves rope_theta and the scaling together under rope_parameters."""
    old = _config("Llama-3.1-8B")
    new = {k: v for k, v in old.items() if k not in ("rope_scaling", "rope_theta")}
    new["rope_parameters"] = old["rope_scaling"] | {"rope_theta": old["rope_theta"]}
    assert hf_config_fields(new) == hf_config_fields(old)
    plain = new | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert hf_config_fields(plain)["rope_theta"] == 1e6 and "rope_scaling_factor" not in hf_config_fields(
        plain
    )


@pytest.mark.parametrize(
    ("base", "change", "named"),
    [
        (
            "Llama-3.1-8B",
            {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]},
            "model_type 'gemma2'",
        ),
        ("Llama-3.1-8B", {"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
        ("Llama-3.1-8B", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("Llama-3.1-8B", {"attention_bias": True}, "attention_bias"),
        ("Llama-3.1-8B", {"mlp_bias": True}, "mlp_bias"),
        ("Llama-3.1-8B", {"head_dim": 64}, "head_dim 64"),
        ("Llama-3.1-8B", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ("Llama-3.1-8B", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
        ("Llama-3.1-8B", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'low_freq_factor'"),
        ("Llama-3.1-8B", {"num_local_experts": 8, "num_experts_per_tok": 2}, "num_local_experts"),
        ("Llama-3.1-8B", {"num_hidden_layers": None}, "num_hidden_layers"),
        ("Qwen2.5-7B", {"use_sliding_window": True}, "use_sliding_window"),
        ("Qwen2.5-7B", {"num_experts": 64, "model_type": "qwen2_moe"}, "num_experts"),
        ("Mistral-7B-Instruct-v0.3", {"num_key_value_heads": None}, "num_key_value_heads"),
        ("Mistral-7B-v0.1", {}, "sliding_window 4096"),
        ("Mixtral-8x7B-v0.1", {"sliding_window": 4096}, "sliding_window 4096"),
        (
            "Mixtral-8x7B-v0.1",
            {"num_local_experts": None},
            "num_local_experts: None is not a positive integer",
        ),
        ("Qwen3-30B-A3B", {"decoder_sparse_step": 2}, "decoder_sparse_step 2"),
        ("Qwen3-30B-A3B", {"mlp_only_layers": [3]}, "mlp_only_layers [3]"),
        ("Qwen3-30B-A3B", {"use_sliding_window": True}, "use_sliding_window"),
        ("Qwen3-30B-A3B", {"num_experts_per_tok": 0}, "num_experts_per_tok: 0"),
        ("OLMoE-1B-7B-0924", {"clip_qkv": 8.0}, "clip_qkv 8.0"),
        ("Qwen3-30B-A3B", {"shared_expert_intermediate_size": 4096}, "shared_expert_intermediate_size"),
        ("DeepSeek-V3", {"moe_layer_freq": 2}, "moe_layer_freq 2"),
        ("DeepSeek-V3", {"topk_method": "random"}, "topk_method 'random'"),
        ("DeepSeek-V3", {"scoring_func": "tanh"}, "scoring_func 'tanh'"),
        ("DeepSeek-V3", {"kv_lora_rank": None}, "kv_lora_rank: None"),
        ("DeepSeek-V3", {"first_k_dense_replace": 61}, "first_k_dense_replace 61"),
        ("DeepSeek-V3", {"rope_interleave": False}, "rope_interleave False"),
    ],
)
def test_a_config_the_model_cannot_be_is_refused_by_name(base: str, change: dict, named: str) -> None:
    with pytest.raises(HFConfigError, match=r"not supported|missing|positive integer|needs|must be") as err:
        hf_config_fields(_config(base) | change)
    assert named in str(err.value), str(err.value)


def test_an_unsupported_type_lists_the_supported_ones() -> None:
    with pytest.raises(HFConfigError) as err:
        hf_config_fields(
            _config("Llama-3.1-8B") | {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}
        )
    assert all(a in str(err.value) for a in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"))


def test_a_sliding_window_switched_off_is_read() -> None:
    """Qwen2.5 files carry sliding_window 131072 with use_sliding_window false; Mistral v0.3 null."""
    assert hf_config_fields(_config("Qwen2.5-7B"))["qkv_bias"] is True
    assert hf_config_fields(_config("Mistral-7B-Instruct-v0.3"))["qkv_bias"] is False


def test_a_file_that_is_not_a_config_says_what_it_is(tmp_path: Path) -> None:
    with pytest.raises(HFConfigError, match="cannot read"):
        read_hf_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(HFConfigError, match=r"bad\.json: not a JSON file"):
        read_hf_config(tmp_path / "bad.json")


# --- in a study spec ----------------------------------------------------------------------------


def _spec_file(tmp_path: Path, model: str, config: str = "Llama-3.1-70B", **extra: str) -> Path:
    (tmp_path / "models").mkdir(exist_ok=True)
    shutil.copy(CONFIGS / f"{config}.json", tmp_path / "models" / "config.json")
    lines = [
        f"model: {model}",
        "cluster: {preset: h100-80gb, num_nodes: 8}",
        "training: {global_batch_size: 512}",
    ]
    path = tmp_path / "study.yaml"
    path.write_text("\n".join(lines + [f"{k}: {v}" for k, v in extra.items()]) + "\n")
    return path


def test_a_spec_reads_hf_config_relative_to_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CONFIGS)  # not where the spec is
    spec = load_spec(_spec_file(tmp_path, "{hf_config: models/config.json, seq_len: 4096}"))
    assert spec.as_model_config() == dataclasses.replace(MODEL_PRESETS["llama3.1-70b"], seq_len=4096)
    assert spec.model.preset is None and "hf_config" not in spec.model_dump()["model"]  # fields, not a path
    assert spec.space.tp == default_tp(spec.as_model_config()) == [1, 2, 4, 8, 16, 32, 64]
    assert model_key(spec.as_model_config(), spec.model.preset) == "llama3.1-70b"


def test_an_override_changes_the_model_read(tmp_path: Path) -> None:
    spec = load_spec(_spec_file(tmp_path, "{hf_config: models/config.json, num_layers: 40}"))
    assert spec.as_model_config().num_layers == 40 and spec.as_model_config().num_kv_heads == 8
    key = model_key(spec.as_model_config())
    assert key == "llama-L40-h8192-a64-kv8" and model_label(key) == "llama-L40-h8192-a64-kv8 (llama)"


@pytest.mark.parametrize(
    ("model", "config", "named"),
    [
        ("{hf_config: models/config.json}", "Mistral-7B-v0.1", "sliding_window 4096"),
        ("{hf_config: models/missing.json}", "Llama-3.1-8B", "cannot read"),
        ("{hf_config: models/config.json, preset: llama3.1-8b}", "Llama-3.1-8B", "not both"),
        ("{hf_config: 3}", "Llama-3.1-8B", "expected the path"),
    ],
)
def test_a_bad_hf_config_is_a_spec_error_naming_it(
    tmp_path: Path, model: str, config: str, named: str
) -> None:
    with pytest.raises(SpecError) as err:
        load_spec(_spec_file(tmp_path, model, config))
    assert "invalid study spec\nmodel.hf_config: " in str(err.value) and named in str(err.value), str(
        err.value
    )


def test_a_spec_sent_as_data_does_not_read_files() -> None:
    """What the API parses: a path there would read a file on the server."""
    with pytest.raises(SpecError) as err:
        parse_spec({**STUDY, "model": {"hf_config": "/etc/passwd"}})
    assert "model: hf_config" in str(err.value) and "reads no files" in str(err.value)


# --- tp and the KV heads --------------------------------------------------------------------------


def test_the_default_tp_reaches_past_the_kv_heads_only_with_gqa() -> None:
    assert default_tp(MODEL_PRESETS["gpt-1.3b"]) == [1, 2, 4, 8]
    assert default_tp(MODEL_PRESETS["llama3.1-405b"]) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert default_tp(MODEL_PRESETS["qwen2.5-7b"]) == [1, 2, 4, 8, 16]  # 28 heads, 4 KV heads
    assert parse_spec({**STUDY, "model": "qwen2.5-7b"}).space.tp == [1, 2, 4, 8, 16]  # was a spec error


def test_tp_values_off_the_heads_are_still_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"space\.tp: \[6\] do not divide the model's num_kv_heads \(8\)"):
        parse_spec({**STUDY, "model": "llama3.1-70b", "space": {"tp": [1, 6, 8]}})
    with pytest.raises(SpecError, match=r"space\.tp: \[16\] do not divide"):
        parse_spec({**STUDY, "model": "llama3.1-70b", "space": {"tp": [16]}})  # no valid tp left
    assert parse_spec({**STUDY, "model": "llama3.1-70b", "space": {"tp": [8, 16]}}).space.tp == [8, 16]


def test_a_family_is_read_from_the_key() -> None:
    assert [model_family(k) for k in ("gpt-1.3b", "llama3.1-8b", "L4-h64-a4", "llama-L2-h64-a4-kv2")] == [
        "gpt", "llama", "gpt", "llama",
    ]  # fmt: skip
    # a GPT shape keeps its key even with a preset's fields (as keys always were)
    assert model_key(dataclasses.replace(MODEL_PRESETS["gpt-tiny"])) == "L4-h64-a4"
