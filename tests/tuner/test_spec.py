"""Study specs: presets, YAML files, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.hardware import CLUSTER_PRESET_NAMES, cluster_preset
from tuner.space import layout
from tuner.spec import (
    ClusterSpec,
    ModelSpec,
    SpecError,
    benchmark_config,
    load_spec,
    padded_vocab,
    parse_spec,
)

STUDIES = Path(__file__).resolve().parents[2] / "studies"
BASE = {
    "model": "gpt-22b",
    "cluster": {"preset": "a100-80gb", "num_nodes": 2},
    "training": {"global_batch_size": 64},
}


def test_presets_expand_and_overrides_apply() -> None:
    spec = parse_spec({**BASE, "model": {"preset": "gpt-22b", "seq_len": 4096}})
    assert spec.model.num_layers == 48 and spec.model.hidden_size == 6144 and spec.model.num_heads == 48
    assert spec.seq_len == 4096 and spec.devices == 16 and spec.cluster.name == "a100-80gb"


@pytest.mark.parametrize("name", CLUSTER_PRESET_NAMES)
def test_every_cluster_preset_validates(name: str) -> None:
    spec = parse_spec({**BASE, "model": "gpt-tiny", "cluster": name, "space": {"tp": [1, 2, 4]}})
    assert spec.cluster.peak_tflops > 0 and spec.cluster.gpus_per_node >= 1


def test_frontier_preset_is_the_papers_machine() -> None:
    c = parse_spec({**BASE, "cluster": "frontier-mi250x"}).cluster
    assert (c.gpus_per_node, c.device_memory_gb, c.peak_tflops, c.inter_node_gbps) == (8, 64, 191.5, 100)


@pytest.mark.parametrize(
    ("change", "field", "hint"),
    [
        ({"space": {"tp": [5, 8]}}, "space.tp", "valid tp values: [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]"),
        ({"num_gpus": 7}, "num_gpus (7)", "multiple of gpus_per_node (8)"),
        ({"model": "gpt-99b"}, "model", "valid: ['deepseek-tiny', 'deepseek-v3', 'gpt-1.3b'"),
        ({"cluster": "dgx-9000"}, "cluster", "valid: ['cpu-local'"),
        ({"training": {"global_batch_size": -8}}, "training.global_batch_size", "greater than 0"),
        ({"trainig": {}}, "trainig", "Extra inputs are not permitted"),
        (
            {"space": {"pp_schedule": ["zb-v"]}},
            "space.pp_schedule.0",
            "'gpipe', '1f1b', 'interleaved_1f1b', 'zbv' or 'dualpipev'",
        ),
        ({"sampler": "hyperband"}, "sampler", "'grid', 'random'"),
        ({"backend": "k8s"}, "backend", "'local', 'slurm' or 'dry-run'"),
        ({"num_gpus": 64}, "num_gpus (64)", "exceeds the cluster's 2 x 8 = 16"),
        ({"model": {"num_layers": 2, "hidden_size": 100, "num_heads": 3}}, "model", "divisible by num_heads"),
    ],
)
def test_bad_spec_names_the_field(change: dict, field: str, hint: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({**BASE, **change})
    assert field in str(err.value) and hint in str(err.value), str(err.value)


def test_yaml_unknown_key_names_it(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        "model: gpt-tiny\ncluster: cpu-local\ntraining: {global_batch_size: 8}\nspace: {tpp: [2]}\n"
    )
    with pytest.raises(SpecError, match=r"space\.tpp: Extra inputs are not permitted"):
        load_spec(path)


def test_yaml_syntax_error_is_a_spec_error(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("model: [gpt-tiny\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(path)


@pytest.mark.parametrize("path", sorted(STUDIES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_studies_load(path: Path) -> None:
    spec = load_spec(path)
    assert spec.name == path.stem


def test_the_example_studies_exist() -> None:
    names = {p.stem for p in STUDIES.glob("*.yaml")}
    assert {"tiny-cpu", "frontier-22b", "frontier-175b", "frontier-1t"} <= names


def test_vocabulary_padding_follows_megatron() -> None:
    """--make-vocab-size-divisible-by 128, times tp; an already padded size stays."""
    assert [padded_vocab(50257, t) for t in (1, 2, 4, 8, 16)] == [50304, 50432, 50688, 51200, 51200]
    assert padded_vocab(51200, 8) == 51200 and padded_vocab(250880, 8) == 250880


def test_the_trainer_gets_the_padded_vocabulary() -> None:
    spec = parse_spec({"model": {"preset": "gpt-350m", "vocab_size": 50257}, "cluster": "a100-80gb",
                       "training": {"global_batch_size": 8}})  # fmt: skip
    assert spec.model.vocab_size == 50257  # stored as the user gave it
    for tp in (1, 8):
        cfg = benchmark_config(spec, layout(tp, 1, 8 // tp, micro_batch_size=1, num_microbatches=tp))
        assert cfg.model.vocab_size == padded_vocab(50257, tp) and cfg.parallel.problems(cfg.model) == []


def test_device_kind_picks_cpu_for_ranks_sharing_cores() -> None:
    assert ClusterSpec(**cluster_preset("cpu-local")).device_kind == "cpu"
    assert ClusterSpec(**cluster_preset("a100-80gb")).device_kind == "gpu"


def test_model_spec_declares_every_model_field_with_its_default_and_choices() -> None:
    """ModelSpec (the edge: field-level errors with bounds) re-declares ModelConfig's fields; it
    must agree with the contract field for field, default for default, choice for choice."""
    import dataclasses
    import typing

    from trainer.contract.model import ModelConfig

    spec_fields = {k: v for k, v in ModelSpec.model_fields.items() if k != "preset"}
    contract = {f.name: f for f in dataclasses.fields(ModelConfig)}
    assert list(spec_fields) == list(contract)
    for name, f in contract.items():
        declared = spec_fields[name]
        default = None if f.default is dataclasses.MISSING else f.default
        assert declared.is_required() == (f.default is dataclasses.MISSING), name
        assert declared.is_required() or declared.default == default, name
        literal = typing.get_type_hints(ModelConfig)[name]
        if typing.get_origin(literal) is typing.Literal:
            assert typing.get_args(declared.annotation) == typing.get_args(literal), name
