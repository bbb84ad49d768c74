"""A study's best layout as a launch config for another stack, one module (or package) per target:
a torchtitan config module (tuner/exports/torchtitan/), Megatron-LM `pretrain_gpt.py` arguments
under torchrun (tuner/exports/megatron/), or an sbatch script that runs our own trainer
(tuner/exports/sbatch.py). What they share, the header above all: tuner/exports/common.py.

Each target (TARGETS) knows every family and axis it supports, said at its top, and has
`unsupported(spec, config)`: why it cannot run a layout our trainer measured (empty: it can), and
`render(spec, config, site)`: the file. export_layout makes the checks common to all (the format,
2D tensor parallelism, the layout against the model), then asks the target.

Only the layout and the model travel: data, tokenizer, optimizer and step counts belong to the run,
not the layout. Where a stack has no equivalent of a knob the file says so in a comment instead of
silently changing what was measured; where it cannot run the layout or build the model at all,
export_layout refuses with the reason. Names a user wrote (study, cluster) appear only as
slug(name), so no comment or shell line carries a user's text. Golden files: tests/tuner/golden/;
the tests parse them with torchtitan's own ConfigManager and check Megatron-LM's flags and
validate_args rules (docs/exports.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tuner.exports import megatron, sbatch, torchtitan
from tuner.exports.megatron import MEGATRON_SOURCE
from tuner.exports.sbatch import EXPORT_PYTHON
from tuner.exports.torchtitan import TORCHTITAN_CONFIG_FN, TORCHTITAN_VERSION

if TYPE_CHECKING:
    from trainer.contract.parallel import ParallelConfig
    from tuner.dispatch.sbatch import SiteSettings
    from tuner.settings import SlurmSettings
    from tuner.spec import StudySpec

__all__ = [
    "FORMATS",
    "MEGATRON_SOURCE",
    "TARGETS",
    "TORCHTITAN_CONFIG_FN",
    "TORCHTITAN_VERSION",
    "Target",
    "export_layout",
    "export_site",
    "refusal",
    "refusals",
]


class Target(Protocol):
    """An export target: a module of this package."""

    def unsupported(self, spec: StudySpec, config: ParallelConfig) -> list[str]:
        """Why the target cannot run `config` of `spec` (empty: it can). A layout knob a stack lacks
        is refused with its reason, never exported as something else."""
        ...

    def render(self, spec: StudySpec, config: ParallelConfig, site: SiteSettings | None) -> str:
        """The launch config: what export_layout returns once every check has passed."""
        ...


# format -> its target, in the order the CLI and the API list them.
TARGETS: dict[str, Target] = {"torchtitan": torchtitan, "megatron": megatron, "sbatch": sbatch}
FORMATS = tuple(TARGETS)


def export_layout(
    fmt: str, spec: StudySpec, config: ParallelConfig, *, site: SiteSettings | None = None
) -> str:
    """The launch config for `config` in format `fmt` (one of FORMATS). `site` (sbatch only)
    supplies Slurm defaults, the job preamble and the python (export_site: the TUNER_SLURM_*
    settings); None: no site options, `python` from PATH.
    ValueError when the model cannot run the layout or the stack cannot express it."""
    _check(fmt, spec, config)
    return TARGETS[fmt].render(spec, config, site)


def _check(fmt: str, spec: StudySpec, config: ParallelConfig) -> None:
    """export_layout's checks, without rendering: ValueError naming why `fmt` cannot express it."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {list(FORMATS)}")
    if config.tp_col > 1 and fmt != "sbatch":  # our own trainer runs it (trainer/tp2d.py)
        raise ValueError(
            f"{fmt}: cannot express layout {config.describe()}: tp_col {config.tp_col} is 2D tensor "
            "parallelism (AxoNN's column axis), which neither Megatron-LM nor torchtitan implements"
        )
    problems = config.problems(spec.as_model_config())
    if problems:
        raise ValueError(f"layout {config.describe()} cannot run the study's model: " + "; ".join(problems))
    reasons = TARGETS[fmt].unsupported(spec, config)
    if reasons:
        raise ValueError(f"{fmt}: cannot express layout {config.describe()}: " + "; ".join(reasons))


def refusal(fmt: str, spec: StudySpec, config: ParallelConfig) -> str | None:
    """Why `fmt` cannot express `config` of `spec` (export_layout's checks, nothing rendered);
    None: it can. ValueError for an unknown format."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {list(FORMATS)}")
    try:
        _check(fmt, spec, config)
    except ValueError as e:
        return str(e)
    return None


def refusals(spec: StudySpec, config: ParallelConfig) -> dict[str, str]:
    """Why each format cannot express `config` of `spec` (export_layout's checks, nothing
    rendered), by format; absent: it can. What a plan or a benchmark says of a layout that was
    never trialled."""
    return {fmt: why for fmt in FORMATS if (why := refusal(fmt, spec, config)) is not None}


def export_site(slurm: SlurmSettings) -> SiteSettings:
    """The site an sbatch export is written for: the TUNER_SLURM_* settings, as trial jobs take them
    (what a spec sets wins), except that without TUNER_SLURM_PYTHON the job runs `python` from its
    PATH, not the path of this process's interpreter, which is a path on the exporting machine."""
    return slurm.site(default_python=EXPORT_PYTHON)
