"""The flags that say what to plan (model, cluster, training, pins), declared once and shared by
`tuner plan` and `tuner memcheck`: a command takes a SpecOptions object, `with_spec_options` gives
typer the flags. spec_data turns them into a study spec (as data)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from trainer.contract.presets import MODEL_PRESETS
from tuner.cli.common import fail
from tuner.hardware import CLUSTER_PRESET_NAMES, cluster_preset
from tuner.hfconfig import read_hf_config_notes
from tuner.spec import SpecError, resolve_hf_config


def _option(kind: Any, *decls: str, help: str | None = None) -> Any:
    return Annotated[kind | None, typer.Option(*decls, help=help)]


@dataclass(frozen=True)
class SpecOptions:
    """What to plan: a spec file and the flags that override it (None: not given)."""

    spec: _option(Path, help="study spec (YAML); flags override its values") = None
    model: _option(str, help=f"model preset: {sorted(MODEL_PRESETS)}") = None
    hf_config: _option(
        Path, "--hf-config", help="a Hugging Face config.json (Llama, Mistral, Qwen2) read as the model"
    ) = None
    layers: _option(int, help="num_layers (with --hidden, --heads)") = None
    hidden: _option(int, help="hidden_size") = None
    heads: _option(int, help="num_heads") = None
    vocab: _option(int, help="vocab_size") = None
    seq: _option(int, help="seq_len") = None
    cluster: _option(str, help=f"cluster preset: {list(CLUSTER_PRESET_NAMES)}") = None
    gpus_per_node: _option(int) = None
    device_memory_gb: _option(float) = None
    peak_tflops: _option(float, help="dense bf16 TFLOP/s per device") = None
    intra_node_gbps: _option(float) = None
    inter_node_gbps: _option(float, help="per node") = None
    gpus: _option(int, help="devices in the study (default: the cluster)") = None
    global_batch: _option(int, help="global batch size in sequences") = None
    precision: _option(str, help="bf16 | fp16 | fp32") = None
    config: _option(str, "--config", help="pin knobs, e.g. tp=8,pp=8") = None


_FIELDS = [f.name for f in dataclasses.fields(SpecOptions)]


def with_spec_options(fn: Callable[..., None]) -> Callable[..., None]:
    """`fn(opts: SpecOptions, ...)` as a typer command: its own parameters (a typer.Context first,
    if it takes one), then every SpecOptions flag, then the rest of its own."""
    hints = inspect.get_annotations(SpecOptions, eval_str=True)
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hints[name])
              for name in _FIELDS]  # fmt: skip
    own = [p for name, p in inspect.signature(fn, eval_str=True).parameters.items() if name != "opts"]
    first = [p for p in own if p.annotation is typer.Context]
    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own if p.annotation is not typer.Context]

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> None:
        opts = SpecOptions(**{name: kwargs.pop(name) for name in _FIELDS})
        fn(*args, opts=opts, **kwargs)

    command.__signature__ = inspect.Signature([*first, *shared, *rest])  # what typer reads
    return command


def spec_data(opts: SpecOptions) -> dict[str, Any]:
    """A study spec (as data) from the flags; a spec file's values are overridden."""
    data: dict[str, Any] = {"name": "plan"}
    if opts.spec is not None:
        try:
            data = yaml.safe_load(opts.spec.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            fail(f"--spec {opts.spec}: {e}")
        if not isinstance(data, dict):
            fail(f"--spec {opts.spec}: expected a mapping at the top level")
        data = _resolved(data, opts.spec.parent, f"--spec {opts.spec}")
    keys = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads", "vocab": "vocab_size",
            "seq": "seq_len"}  # fmt: skip
    shape = {field: getattr(opts, flag) for flag, field in keys.items() if getattr(opts, flag) is not None}
    if opts.model is not None and opts.hf_config is not None:
        fail("--model and --hf-config: give one model")
    if opts.model is not None or opts.hf_config is not None or shape:
        model: dict[str, Any] = {"preset": opts.model} if opts.model else {}
        if opts.hf_config is not None:
            model = {"hf_config": str(opts.hf_config)}
        data = _resolved({**data, "model": model | shape}, Path.cwd(), "--hf-config")
        if opts.hf_config is not None:  # what the file holds that the model leaves out (tuner/hfconfig.py)
            for note in read_hf_config_notes(opts.hf_config):
                typer.echo(f"note: --hf-config {note}", err=True)
    cluster = data.get("cluster", {})
    cluster = {"preset": cluster} if isinstance(cluster, str) else dict(cluster)
    if opts.cluster is not None:
        cluster = {"preset": opts.cluster}
    overrides = ("gpus_per_node", "device_memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps")
    cluster |= {k: getattr(opts, k) for k in overrides if getattr(opts, k) is not None}
    if opts.gpus is not None:
        data["num_gpus"] = opts.gpus
        per_node = cluster.get("gpus_per_node")
        if per_node is None and cluster.get("preset"):
            try:
                per_node = cluster_preset(cluster["preset"])["gpus_per_node"]
            except ValueError as e:
                fail(f"cluster: {e}")
        cluster["num_nodes"] = max(1, -(-opts.gpus // (per_node or 1)))
    if cluster:
        data["cluster"] = cluster
    training = dict(data.get("training") or {})
    if opts.global_batch is not None:
        training["global_batch_size"] = opts.global_batch
    if opts.precision is not None:
        training["precision"] = opts.precision
    if "global_batch_size" not in training:  # the one field a study cannot default
        where = f" or training.global_batch_size in --spec {opts.spec}" if opts.spec is not None else ""
        fail(
            f"--global-batch: the global batch size in sequences is required (e.g. --global-batch 512){where}"
        )
    data["training"] = training
    return data


def _resolved(data: dict[str, Any], base_dir: Path, origin: str) -> dict[str, Any]:
    try:
        return resolve_hf_config(data, base_dir, origin)
    except SpecError as e:
        fail(str(e))
