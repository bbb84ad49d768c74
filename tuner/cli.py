"""`tuner`: the command-line interface. Torch-free: trials run in their own processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import yaml

from trainer.contract.presets import MODEL_PRESETS
from tuner.hardware import CLUSTER_PRESET_NAMES, cluster_preset
from tuner.hfconfig import read_hf_config_notes
from tuner.models import model_key, model_label
from tuner.plan import PlanError, parse_pins
from tuner.plan import plan as run_plan
from tuner.spec import SpecError, StudySpec, parse_spec, resolve_hf_config

app = typer.Typer(
    help="parallel-tuner: find the fastest way to train a GPT on a cluster.", no_args_is_help=True
)


@app.callback()
def main(ctx: typer.Context) -> None:
    """parallel-tuner command line."""
    from tuner.settings import Settings

    try:
        ctx.obj = Settings.from_env()  # read once, passed to every command; a bad TUNER_* is one line
    except ValueError as e:
        _fail(str(e))


@app.command()
def version() -> None:
    """Print the installed version."""
    from importlib.metadata import version as dist_version

    typer.echo(dist_version("parallel-tuner"))


def _fail(message: str) -> NoReturn:
    """Bad input: the message on stderr, exit code 2, no traceback."""
    typer.echo(message, err=True)
    raise typer.Exit(2)


def _spec_from_flags(**flags: Any) -> dict[str, Any]:
    """A study spec (as data) from `tuner plan`'s flags; a spec file's values are overridden."""
    data: dict[str, Any] = {"name": "plan"}
    if flags["spec"] is not None:
        try:
            data = yaml.safe_load(flags["spec"].read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            _fail(f"--spec {flags['spec']}: {e}")
        if not isinstance(data, dict):
            _fail(f"--spec {flags['spec']}: expected a mapping at the top level")
        data = _resolved(data, flags["spec"].parent, f"--spec {flags['spec']}")
    shape = {k: flags[k] for k in ("layers", "hidden", "heads", "vocab", "seq") if flags[k] is not None}
    hf_config = flags.get("hf_config")
    if flags["model"] is not None and hf_config is not None:
        _fail("--model and --hf-config: give one model")
    if flags["model"] is not None or hf_config is not None or shape:
        model: dict[str, Any] = {"preset": flags["model"]} if flags["model"] else {}
        if hf_config is not None:
            model = {"hf_config": str(hf_config)}
        keys = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads", "vocab": "vocab_size",
                "seq": "seq_len"}  # fmt: skip
        model |= {keys[k]: v for k, v in shape.items()}
        data = _resolved({**data, "model": model}, Path.cwd(), "--hf-config")
        if hf_config is not None:  # what the file holds that the model leaves out (tuner/hfconfig.py)
            for note in read_hf_config_notes(hf_config):
                typer.echo(f"note: --hf-config {note}", err=True)
    cluster = data.get("cluster", {})
    cluster = {"preset": cluster} if isinstance(cluster, str) else dict(cluster)
    if flags["cluster"] is not None:
        cluster = {"preset": flags["cluster"]}
    overrides = {k: flags[k] for k in ("gpus_per_node", "device_memory_gb", "peak_tflops", "intra_node_gbps",
                                       "inter_node_gbps") if flags[k] is not None}  # fmt: skip
    cluster |= overrides
    if flags["gpus"] is not None:
        data["num_gpus"] = flags["gpus"]
        per_node = cluster.get("gpus_per_node")
        if per_node is None and cluster.get("preset"):
            try:
                per_node = cluster_preset(cluster["preset"])["gpus_per_node"]
            except ValueError as e:
                _fail(f"cluster: {e}")
        cluster["num_nodes"] = max(1, -(-flags["gpus"] // (per_node or 1)))
    if cluster:
        data["cluster"] = cluster
    training = dict(data.get("training") or {})
    if flags["global_batch"] is not None:
        training["global_batch_size"] = flags["global_batch"]
    if flags["precision"] is not None:
        training["precision"] = flags["precision"]
    if training:
        data["training"] = training
    return data


def _resolved(data: dict[str, Any], base_dir: Path, origin: str) -> dict[str, Any]:
    try:
        return resolve_hf_config(data, base_dir, origin)
    except SpecError as e:
        _fail(str(e))


@app.command()
def plan(
    spec: Annotated[Path | None, typer.Option(help="study spec (YAML); flags override its values")] = None,
    model: Annotated[str | None, typer.Option(help=f"model preset: {sorted(MODEL_PRESETS)}")] = None,
    hf_config: Annotated[
        Path | None,
        typer.Option(
            "--hf-config", help="a Hugging Face config.json (Llama, Mistral, Qwen2) read as the model"
        ),
    ] = None,
    layers: Annotated[int | None, typer.Option(help="num_layers (with --hidden, --heads)")] = None,
    hidden: Annotated[int | None, typer.Option(help="hidden_size")] = None,
    heads: Annotated[int | None, typer.Option(help="num_heads")] = None,
    vocab: Annotated[int | None, typer.Option(help="vocab_size")] = None,
    seq: Annotated[int | None, typer.Option(help="seq_len")] = None,
    cluster: Annotated[str | None, typer.Option(help=f"cluster preset: {list(CLUSTER_PRESET_NAMES)}")] = None,
    gpus_per_node: Annotated[int | None, typer.Option()] = None,
    device_memory_gb: Annotated[float | None, typer.Option()] = None,
    peak_tflops: Annotated[float | None, typer.Option(help="dense bf16 TFLOP/s per device")] = None,
    intra_node_gbps: Annotated[float | None, typer.Option()] = None,
    inter_node_gbps: Annotated[float | None, typer.Option(help="per node")] = None,
    gpus: Annotated[int | None, typer.Option(help="devices in the study (default: the cluster)")] = None,
    global_batch: Annotated[int | None, typer.Option(help="global batch size in sequences")] = None,
    precision: Annotated[str | None, typer.Option(help="bf16 | fp16 | fp32")] = None,
    config: Annotated[str | None, typer.Option("--config", help="pin knobs, e.g. tp=8,pp=8")] = None,
    top: Annotated[int, typer.Option(min=1, help="how many layouts to list")] = 10,
    include_unfit: Annotated[
        bool, typer.Option(help="also list layouts predicted to run out of memory")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
    explain: Annotated[
        bool,
        typer.Option("--explain", help="each listed layout's predicted step, term by term (they add up)"),
    ] = False,
    verify_memory: Annotated[
        bool,
        typer.Option("--verify-memory", help="check each listed layout with the memory oracle (needs torch)"),
    ] = False,
) -> None:
    """Rank every valid layout by the performance model, without running any."""
    flags = dict(locals())
    data = _spec_from_flags(**flags)
    try:
        study = parse_spec(data, str(spec) if spec else "plan")
        constants = _stored_constants(study.cluster.name)
        result = run_plan(
            study, pins=parse_pins(config), top=top, include_unfit=include_unfit, constants=constants
        )
        if verify_memory:
            from tuner.cli_memcheck import verify_candidates

            verify_candidates(study, result, constants)
    except (SpecError, PlanError, ValueError) as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    _print_plan(study, result)
    if explain:
        _print_terms(result)
    if verify_memory:
        from tuner.cli_memcheck import print_verified

        print_verified(result)


def _stored_constants(cluster_name: str):
    """The constants the last study on this cluster fitted (the database of TUNER_DATABASE_URL),
    or None: plan never creates a database and works without one."""
    from tuner import store
    from tuner.db import DatabaseError, connect
    from tuner.settings import Settings

    url = Settings.from_env().database_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return None
    try:
        with connect(url)() as s:
            return store.latest_constants(s, cluster_name)
    except DatabaseError:
        return None


def _print_plan(study: StudySpec, result: dict[str, Any]) -> None:
    m, c = study.gpt(), study.cluster
    typer.echo(f"{model_label(model_key(m, study.model.preset))}: {m.num_params / 1e9:.2f}B parameters, seq {m.seq_len}, global "
               f"batch {study.training.global_batch_size}, {study.devices} x {c.name} devices "
               f"({c.peak_tflops:g} TFLOP/s, {c.device_memory_gb:g} GB)")  # fmt: skip
    vocab = result["vocab"]
    padded = ", ".join(f"{v} at tp {t}" for t, v in vocab["padded_by_tp"].items())
    typer.echo(f"vocabulary {vocab['vocab_size']}, padded to a multiple of {vocab['divisible_by']} x tp "
               f"(Megatron-LM): {padded or '-'}")  # fmt: skip
    typer.echo(
        f"space {result['space_size']}, valid {result['num_valid']}, predicted to fit {result['num_fit']}\n"
    )
    moe = m.moe  # a mixture of experts: an ep column
    cp = any(
        "cp" in cand["config"] for cand in result["candidates"]
    )  # context parallelism searched: a cp column
    head = (f"{'tp':>5} {'pp':>3} {'dp':>5}" + (f" {'cp':>3}" if cp else "") + (f" {'ep':>4}" if moe else "")
            + f" {'mbs':>3} {'nmb':>5} {'zero':>4} "
            f"{'ckpt':>9} {'sp':>3} {'schedule':>18} {'vocab':>7} {'mem GiB':>8} {'TFLOP/s':>8} {'MFU':>6} {'tokens/s':>11}")  # fmt: skip
    typer.echo(head)
    for cand in result["candidates"]:
        k, p = cand["config"], cand["predicted"]
        sched = (
            k["pp_schedule"] + (f"/v{k['virtual_stages']}" if k["virtual_stages"] > 1 else "")
            if k["pp"] > 1
            else "-"
        )
        flag = "" if p["fits"] else "  (does not fit)"
        tp = f"{k['tp']}x{k['tp_col']}" if k.get("tp_col", 1) > 1 else str(k["tp"])  # row x column
        ep = f" {k.get('ep', 1):>4}" if moe else ""
        ctx = f" {k.get('cp', 1):>3}" if cp else ""
        typer.echo(
            f"{tp:>5} {k['pp']:>3} {k['dp']:>5}{ctx}{ep} {k['micro_batch_size']:>3} {k['num_microbatches']:>5} "
            f"{k['zero_stage']:>4} {k['activation_checkpoint']:>9} {'y' if k['sequence_parallel'] else 'n':>3} "
            f"{sched:>18} {cand['vocab_size']:>7} {p['memory_bytes'] / 2**30:>8.1f} {p['tflops_per_device']:>8.1f} {p['mfu']:>6.1%} "
            f"{p['tokens_per_s']:>11.0f}{flag}"
        )
    if result["candidates"] and result["candidates"][0].get("experts"):
        typer.echo(f"\nthe fastest layout's {result['candidates'][0]['experts']}")
    for line in result.get("hint", []):
        typer.echo(f"\n{line}" if line is result["hint"][0] else line)
    if result.get("column"):
        typer.echo("\n2D tensor parallelism (tp x tp_col), the fastest layout of each column degree:")
        for entry in result["column"]:
            typer.echo(f"  tp_col {entry['tp_col']}: {entry['layout'] or '-'}: {entry['why']}")
    if result["rejected"]:
        typer.echo("\nrejected layouts by reason:")
        for reason, count in result["rejected"].items():
            typer.echo(f"{count:>7}  {reason}")


def _print_terms(result: dict[str, Any]) -> None:
    """Each candidate's step time as the sum of its terms (tuner.perfmodel.StepTerms), largest
    first; terms under 0.05 % of the step are folded into one line so the sum still holds."""
    from tuner.perfmodel import TERM_LABELS

    typer.echo("\nwhere each step goes (seconds; the terms add up to the step):")
    for rank, cand in enumerate(result["candidates"], 1):
        p = cand["predicted"]
        step, terms = p["step_time_s"], sorted(p["terms"].items(), key=lambda kv: -kv[1])
        shown = [(k, v) for k, v in terms if v >= 5e-4 * step]
        rest = sum(v for k, v in terms if v < 5e-4 * step)
        parts = [f"{TERM_LABELS[k]} {v:.4g} ({v / step:.0%})" for k, v in shown]
        if rest > 0:
            parts.append(f"other terms {rest:.2g}")
        typer.echo(f"{rank:>3}. {_layout(cand['config'])}: step {step:.4g} s = " + " + ".join(parts))
        if cand.get("experts"):
            typer.echo(f"     {cand['experts']}")


def _layout(k: dict[str, Any]) -> str:
    tp = f"{k['tp']}x{k['tp_col']}" if k.get("tp_col", 1) > 1 else str(k["tp"])
    sched = (
        f" {k['pp_schedule']}" + (f"/v{k['virtual_stages']}" if k["virtual_stages"] > 1 else "")
        if k["pp"] > 1
        else ""
    )
    cp = f" cp{k['cp']}" if k.get("cp", 1) > 1 else ""
    return (f"tp{tp} pp{k['pp']}{sched} dp{k['dp']}{cp} z{k['zero_stage']} mbs{k['micro_batch_size']}x{k['num_microbatches']}"
            + (f" ac={k['activation_checkpoint']}" if k["activation_checkpoint"] != "none" else "")
            + (" sp" if k["sequence_parallel"] else "") + (f" ep{k['ep']}" if k.get("ep", 1) > 1 else ""))  # fmt: skip


def _register_plugins() -> None:
    """Commands other packages of the distribution add through the `parallel_tuner.cli` entry
    point group: `tuner serve` is registered by the API package (its cli module), so this package never imports it."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="parallel_tuner.cli"):
        ep.load()(app)


from tuner import cli_memcheck, cli_results, cli_study  # noqa: E402  (commands that use the database or a server)

cli_study.register(app)
cli_results.register(app)
cli_memcheck.register(app)
_register_plugins()

if __name__ == "__main__":
    app()
