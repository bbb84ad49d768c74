"""Rank a study's layouts by the performance model, before running any (`tuner plan`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from trainer.contract.axes import AXES
from trainer.contract.parallel import ParallelConfig
from tuner.cost.terms import TERM_LABELS, Estimate
from tuner.perfconstants import ModelConstants
from tuner.pricing import Pricing
from tuner.space import SearchSpace
from tuner.spec import VOCAB_DIVISIBLE_BY, StudySpec, padded_vocab, parse_spec

if TYPE_CHECKING:
    from tuner.dispatch.sbatch import SiteSettings

# What --config may pin, and how each value is read: every axis of the table
# (trainer/contract/axes.py, with its short aliases) and dp, the two data-parallel axes together.
_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_READ = {int: int, bool: lambda v: _BOOL[v.lower()], str: lambda v: v.replace("-", "_")}
PIN_KEYS = {**{a.name: _READ[a.type] for a in AXES}, "dp": int}
PIN_ALIASES = {alias: a.name for a in AXES for alias in a.aliases}
# Pins that narrow the space's choices (the rest are derived and filtered afterwards).
SPACE_PINS = {a.name for a in AXES if a.searched}


class PlanError(ValueError):
    """Bad pins, or pins no valid layout agrees with; the message says why."""


def parse_pins(text: str | None) -> dict[str, Any]:
    """'tp=8,pp=8' -> {'tp': 8, 'pp': 8}; names the bad key or value."""
    pins: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        key = PIN_ALIASES.get(key.strip(), key.strip())
        if not sep or key not in PIN_KEYS:
            raise PlanError(f"--config: {item!r} is not KEY=VALUE with KEY one of {sorted(PIN_KEYS)}")
        try:
            pins[key] = PIN_KEYS[key](value.strip())
        except (ValueError, KeyError):
            raise PlanError(f"--config: {key}={value!r} is not a valid value for {key}") from None
    return pins


def _pinned_spec(spec: StudySpec, pins: dict[str, Any]) -> StudySpec:
    """The spec with each pinned knob's choices replaced by the pin (which may lie outside them)."""
    space = spec.space.model_dump()
    for key, value in pins.items():
        if key in SPACE_PINS:
            space[key] = [value]
    if pins.get("pp_schedule") == "interleaved_1f1b" and "virtual_stages" not in pins:
        space["virtual_stages"] = spec.space.virtual_stages
    if "virtual_stages" in pins and pins["virtual_stages"] > 1 and "pp_schedule" not in pins:
        space["pp_schedule"] = ["interleaved_1f1b"]
    return parse_spec({**spec.model_dump(exclude={"space"}), "space": space}, "--config")


def _agrees(config: ParallelConfig, pins: dict[str, Any]) -> bool:
    return all(getattr(config, k) == v for k, v in pins.items() if k not in SPACE_PINS)


def layout_row(config: ParallelConfig, searched: Collection[str] = ()) -> dict[str, Any]:
    """A layout's knobs as the plan shows them: every axis of the table (trainer/contract/axes.py),
    dp whole in the place of dp_replicate and dp_shard (and HSDP's replicas beside it where the
    study searches them: of dp, dp_replicate replicate and the rest shard), and an axis written only when set (ep, cp) where the study searches it (`searched`)
    or the layout uses it."""
    row: dict[str, Any] = {}
    for a in AXES:
        value = getattr(config, a.name)
        if a.name in ("dp_replicate", "dp_shard"):
            row.setdefault("dp", config.dp)
            if a.name == "dp_replicate" and a.name in searched:  # HSDP's replicas, where searched
                row["dp_replicate"] = value if config.zero_stage else 1
        elif a.written != "when_set" or a.name in searched or value != a.default:
            row[a.name] = value
    return row


def candidate_dict(config: ParallelConfig, est: Estimate, searched: Collection[str] = ()) -> dict[str, Any]:
    """One ranked layout: its knobs (layout_row), what the model predicts, and the padded
    vocabulary it builds. A mixture of experts' also has what its expert terms were priced from
    (predicted.moe: tuner.cost.experts.moe_info, edp among them) and its `experts:` line."""
    out = _candidate_dict(config, est, searched)
    if est.moe is not None:
        out["predicted"]["moe"] = est.moe
        out["experts"] = experts_line(est.moe)
    return out


def experts_line(moe: dict[str, Any]) -> str:
    """The `experts:` line of a MoE layout's explanation: the all-to-all by tier, the imbalance
    factor and the experts' GEMM efficiency (tuner/cost/experts.py)."""
    mb = moe["a2a_bytes_per_call"] / 1e6
    return (
        f"experts: ep{moe['ep']} ({moe['local_experts']} of {moe['num_experts']} experts a rank, edp {moe['edp']}); "
        f"all-to-all {moe['a2a_intra_s']:.3g} s in node + {moe['a2a_inter_s']:.3g} s across nodes "
        f"({moe['a2a_calls_per_layer']} x {mb:.3g} MB out of a rank per MoE layer and micro-batch, "
        f"{moe['moe_layers_on_stage']:g} MoE layers on the slowest stage); imbalance x{moe['imbalance_factor']:.3f}; "
        f"expert GEMMs at {moe['expert_gemm_efficiency']:.0%} of the dense GEMMs' rate "
        f"({moe['tokens_per_expert']:.0f} tokens per expert per micro-batch); expert compute {moe['experts_compute_s']:.3g} s"
    )  # fmt: skip


def _candidate_dict(config: ParallelConfig, est: Estimate, searched: Collection[str]) -> dict[str, Any]:
    return {
        "vocab_size": est.vocab_size,
        "config": layout_row(config, searched),
        "predicted": {
            "memory_bytes": int(est.memory_bytes), "step_time_s": est.step_time_s, "tokens_per_s": est.tokens_per_s,
            "tflops_per_device": est.tflops_per_device, "mfu": est.mfu, "fits": est.fits,
            # every second of step_time_s, by term (tuner.cost.terms.StepTerms: they add up)
            "terms": est.terms.as_dict(),
            # communication overlapped with compute, not in the terms (Estimate.hidden)
            "hidden": dict(est.hidden),
        },
    }  # fmt: skip


Scored = list[tuple[ParallelConfig, Estimate]]


def fastest_fitting(scored: Scored) -> tuple[ParallelConfig, Estimate] | None:
    """The layout with the most predicted tokens/s among those predicted to fit (None: none fits)."""
    return max(((c, e) for c, e in scored if e.fits), key=lambda ce: ce[1].tokens_per_s, default=None)


def column_comparison(scored: Scored) -> list[dict[str, Any]]:
    """For each column degree (2D tensor parallelism's tp_col) among the layouts: its fastest
    layout predicted to fit, against the fastest with tp_col 1, and why it wins or loses: the
    step's terms that differ most (seconds, + where the column layout spends more)."""
    cols = sorted({c.tp_col for c, _ in scored})
    if cols == [1]:
        return []
    best = {col: fastest_fitting([(c, e) for c, e in scored if c.tp_col == col]) for col in cols}
    base = best.get(1)
    out = []
    for col in cols:
        if col == 1:
            continue
        if best[col] is None:
            out.append(
                {"tp_col": col, "layout": None, "why": f"no layout with tp_col {col} is predicted to fit"}
            )
            continue
        config, est = best[col]
        entry: dict[str, Any] = {"tp_col": col, "layout": config.describe(), "tokens_per_s": est.tokens_per_s}
        if base is None:
            entry["why"] = "no layout without a column axis is predicted to fit"
        else:
            ref_config, ref = base
            mine, theirs = est.terms.as_dict(), ref.terms.as_dict()
            deltas = {k: mine[k] - theirs[k] for k in TERM_LABELS}
            speedup = est.tokens_per_s / ref.tokens_per_s
            parts = [f"{TERM_LABELS[k]} {d:+.3g} s" for k, d in sorted(deltas.items(), key=lambda kd: -abs(kd[1]))
                     if abs(d) >= 0.005 * ref.step_time_s][:3]  # fmt: skip
            verdict = "wins" if speedup > 1 else "loses"
            entry |= {
                "versus": ref_config.describe(), "speedup": speedup, "term_deltas_s": deltas,
                "why": f"{verdict} ({speedup:.2f}x the best without a column axis, {ref_config.describe()}): "
                + (", ".join(parts) if parts else "the same step to within 0.5 %")
                + f" per step of {ref.step_time_s:.3g} s",
            }  # fmt: skip
        out.append(entry)
    return out


def plan(
    spec: StudySpec,
    *,
    pins: dict[str, Any] | None = None,
    top: int = 10,
    include_unfit: bool = False,
    constants: ModelConstants | None = None,
    export: str | None = None,
    site: SiteSettings | None = None,
) -> dict[str, Any]:
    """The `tuner plan --json` document: space size, rejections by reason, the top-K candidates.
    With `export` (a format of tuner.exports), only the layouts that format can express are
    ranked, and the document's `export` holds the fastest fitting one's launch config (`site`: an
    sbatch script's Slurm settings) and how many layouts the format refused, by reason."""
    pins = pins or {}
    if export is not None:
        from tuner.exports import FORMATS

        if export not in FORMATS:
            raise PlanError(f"--export: {export!r} is not one of {list(FORMATS)}")
    if pins:
        spec = _pinned_spec(spec, pins)
    pricing = Pricing.for_study(spec, constants)  # the caller passes the database's constants
    space = SearchSpace.from_spec(spec)
    enum = space.enumerate()
    valid = [c for c in enum.valid if _agrees(c, pins)]
    if pins and not valid:
        if enum.valid:  # the space had layouts, none with the derived pins (dp, num_microbatches)
            derived = {k: v for k, v in pins.items() if k not in SPACE_PINS}
            first = enum.valid[0]
            reasons = f"none has {derived}; valid ones have e.g. dp={first.dp}, num_microbatches={first.num_microbatches}"
        else:
            reasons = "; ".join(f"{enum.examples[r]} ({n} layouts)" for r, n in enum.rejected.most_common())
        raise PlanError(f"--config: no valid layout agrees with {pins}: {reasons}")
    model = spec.as_model_config()
    num_valid, refused = len(valid), Counter[str]()
    if export is not None:
        valid, refused = _expressible(export, spec, valid)
    scored = pricing.rank(valid)
    num_fit = sum(e.fits for _, e in scored)
    shown = scored if include_unfit else [(c, e) for c, e in scored if e.fits]
    hint = (
        no_fit_hint(spec, scored, pricing, pins, include_unfit) if scored and not num_fit and not pins else None
    )  # fmt: skip
    return {
        "space_size": enum.space_size,
        "num_valid": num_valid,
        "num_fit": num_fit,
        "rejected": dict(enum.rejected.most_common()),
        "vocab": vocab_dict(model.vocab_size, sorted({c.tp for c in valid})),
        "candidates": [candidate_dict(c, e, searched=space.searched_axes()) for c, e in shown[:top]],
        "column": column_comparison(scored),
        **({"hint": hint} if hint else {}),
        **(
            {"export": _export(export, spec, scored, refused, site, space.searched_axes())}
            if export is not None
            else {}
        ),
    }


def _expressible(
    fmt: str, spec: StudySpec, valid: list[ParallelConfig]
) -> tuple[list[ParallelConfig], Counter[str]]:
    """The layouts `fmt` can express, and how many it refused by reason (the first reason each,
    up to its first colon: e.g. "activation_checkpoint 'offload'")."""
    from tuner.exports import refusal

    kept, refused = [], Counter()
    for config in valid:
        why = refusal(fmt, spec, config)
        if why is None:
            kept.append(config)
        else:
            reasons = why.split(f"cannot express layout {config.describe()}: ", 1)[-1]
            refused[reasons.split("; ")[0].split(": ")[0]] += 1
    return kept, refused


def _export(
    fmt: str,
    spec: StudySpec,
    scored: Scored,
    refused: Counter[str],
    site: SiteSettings | None,
    searched: Collection[str],
) -> dict[str, Any]:
    """The plan's `export`: the fastest fitting layout `fmt` expresses as its launch config (None
    where none fits, with why), and the layouts the format refused by reason."""
    from tuner.exports import export_layout

    best = fastest_fitting(scored)
    out: dict[str, Any] = {"format": fmt, "expressible": len(scored), "refused": dict(refused.most_common())}
    if best is None:
        why = (
            "no layout it can express is predicted to fit"
            if scored
            else "it can express none of the valid layouts"
        )
        return out | {"layout": None, "text": None, "why": f"{fmt}: {why}"}
    config, est = best
    text = planned(export_layout(fmt, spec, config, site=site), est)
    return out | {"layout": config.describe(), "config": layout_row(config, searched), "tokens_per_s": est.tokens_per_s,
                  "text": text}  # fmt: skip


def planned(text: str, est: Estimate) -> str:
    """A launch config written from a plan, with a comment after its header's first line saying
    that no trial ran it (its notes' "measured" mean what the performance model priced)."""
    lines = text.split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith("# ")) + 1  # after #! and #SBATCH
    note = (f"# planned, not measured: `tuner plan` picked this layout by the performance model "
            f"({est.tokens_per_s:,.0f} tokens/s, {est.memory_bytes / 2**30:.1f} GiB a device predicted); "
            "no trial ran it, so where the notes below say measured, read priced")  # fmt: skip
    return "\n".join([*lines[:at], note, *lines[at:]])


def no_fit_hint(
    spec: StudySpec, scored: Scored, pricing: Pricing, pins: dict[str, Any], include_unfit: bool
) -> list[str]:
    """Why nothing fits (the layout that needs least memory, by part, against the usable
    memory) and what would: the same study on 2, 4 or 8 times the GPUs, its fastest fitting
    layout (no constants changed)."""
    config, est = min(scored, key=lambda ce: ce[1].memory_bytes)
    usable = pricing.hardware.device_memory_bytes * (1 - pricing.constants.memory_margin)
    gib = 2**30
    parts = ", ".join(
        f"{k} {getattr(est, f'{k}_bytes') / gib:.1f}"
        for k in ("weights", "grads", "optimizer", "activations", "workspace")
    )
    lines = [
        f"no layout is predicted to fit: the least memory is {est.memory_bytes / gib:.1f} GiB "
        f"({config.describe()}: {parts} GiB) against {usable / gib:.1f} GiB usable "
        f"({pricing.hardware.device_memory_gb:g} GB less the {pricing.constants.memory_margin:.0%} margin)"
    ]  # fmt: skip
    per_node = spec.cluster.gpus_per_node
    for factor in (2, 4, 8):
        gpus = spec.devices * factor
        cluster = {
            **spec.cluster.model_dump(),
            "num_nodes": max(spec.cluster.num_nodes, -(-gpus // per_node)),
        }
        data = {**spec.model_dump(), "num_gpus": gpus, "cluster": cluster,
                "space": {**spec.space.model_dump(), "num_gpus": None}}  # fmt: skip
        bigger = parse_spec(data, "hint")
        best = pricing_for(bigger, pricing).fastest_fitting(SearchSpace.from_spec(bigger).enumerate().valid)
        if best is not None:
            c, e = best
            lines.append(
                f"on {gpus} GPUs ({factor}x) the fastest fitting layout is {c.describe()}: "
                f"{e.memory_bytes / gib:.1f} GiB, {e.tokens_per_s:.0f} tokens/s (tuner plan --gpus {gpus})"
            )
            break
    else:
        lines.append(f"none fits on up to {8 * spec.devices} GPUs either")
    if not include_unfit:
        lines.append("--include-unfit lists the layouts that do not fit, with their memory")
    return lines


def pricing_for(spec: StudySpec, like: Pricing) -> Pricing:
    """`spec`'s pricing with the constants of `like` (the same calibration)."""
    return Pricing.for_study(spec, like.constants)


def vocab_dict(vocab_size: int, tps: list[int]) -> dict[str, Any]:
    """The tokenizer's vocabulary and what each tp pads it to (Megatron-LM's rule, tuner.spec)."""
    return {
        "vocab_size": vocab_size,
        "divisible_by": VOCAB_DIVISIBLE_BY,
        "padded_by_tp": {str(t): padded_vocab(vocab_size, t) for t in tps},
    }
