"""The sbatch target: a Slurm job script that runs our own trainer (trainer.benchmark) on the layout,
as tuner/dispatch/slurm.py's trial jobs do, with the config the study measured inline.

Families and axes: every registered family (trainer/contract/families/, custom included) and every
axis our trainer runs, tp_col (2D tensor parallelism, trainer/tp2d.py) included: it measured the
layout, so it refuses nothing beyond the layout's own checks against the model
(tuner/exports/__init__.py), and names no family: the config is the model's fields.
"""

from __future__ import annotations

import shlex
from dataclasses import replace

from trainer.contract.parallel import ParallelConfig
from trainer.contract.trial_dir import CONFIG_FILE, RESULT_FILE
from tuner.dispatch.sbatch import SITE_OPTIONS, SiteSettings, SlurmResources, preamble, trainer_command
from tuner.exports.common import comments, header
from tuner.spec import SlurmSpec, StudySpec, benchmark_config, slug

EXPORT_PYTHON = "python"  # the sbatch export's interpreter when the site names none: the job's PATH


def unsupported(spec: StudySpec, config: ParallelConfig) -> list[str]:
    """Nothing: our own trainer ran the layout."""
    return []


def render(spec: StudySpec, config: ParallelConfig, site: SiteSettings | None = None) -> str:
    """The job script that runs trainer.benchmark for this layout, as tuner/dispatch/slurm.py's
    jobs do, with the resources as #SBATCH lines. Those lines are not shell and cannot be quoted,
    so every value is a number, a slug, or a name that passed SlurmSpec's checks (the site's too).
    Unlike a trial job it runs anywhere: no path of the exporting machine (the trainer comes from
    the site's python), the nodes to itself, and it stops at the first failing line."""
    site = site or SiteSettings(python=EXPORT_PYTHON)
    q, s = shlex.quote, spec.slurm
    cfg = benchmark_config(spec, config)  # exactly what the study measured (tests/tuner/test_export.py)
    SlurmSpec(
        **{k: getattr(s, k) or getattr(site, k) for k in SITE_OPTIONS}
    )  # the site's names pass the spec's checks
    resources = SlurmResources.for_trial(cfg, name=slug(spec.name), timeout_s=spec.trial.timeout_s, spec=s,
                                         site=site, gpus_per_node=spec.cluster.gpus_per_node)  # fmt: skip
    run_dir = q(slug(spec.name)) + '-"$SLURM_JOB_ID"'
    lines = ["#!/bin/bash", *replace(resources, exclusive=True).sbatch_lines()]
    timing = (
        f"--time is the study's trial timeout ({spec.trial.timeout_s:g} s): the trainer warms up "
        f"{cfg.warmup_steps} and measures {cfg.measure_steps} steps; result.json has the figures."
    )
    python = (
        "the python below (TUNER_SLURM_PYTHON, else the job's PATH) must import trainer: install "
        "'parallel-tuner[trainer]' for it, or set PYTHONPATH in the site's setup (TUNER_SLURM_SETUP)."
    )
    lines += comments([*header(spec, config, "sbatch job"), timing, python])
    lines += ["set -euo pipefail", *preamble(s, site, {}, checkout=None)]
    lines += [
        "# one directory per job, under the submit directory (sbatch's working directory)",
        f"mkdir -p {run_dir}",
        f"cd {run_dir}",
        f"cat > {CONFIG_FILE} <<'CONFIG_JSON'",
        cfg.to_json(),
        "CONFIG_JSON",
        trainer_command(site.python, CONFIG_FILE, RESULT_FILE),
    ]
    return "\n".join(lines) + "\n"
