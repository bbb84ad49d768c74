"""The sbatch argv and job script (golden files), and what a spec may put into them. No cluster."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainer.contract.parallel import ParallelConfig
from trainer.contract.presets import MODEL_PRESETS
from trainer.contract.result import BenchmarkConfig
from tuner.dispatch.sbatch import ROOT, SiteSettings, SlurmResources, render_script, time_limit_minutes
from tuner.spec import SlurmSpec, SpecError, parse_spec, slug

GOLDEN = Path(__file__).parent / "golden"
CFG = BenchmarkConfig(model=MODEL_PRESETS["gpt-1.3b"], device="cuda", dtype="bf16",
                      parallel=ParallelConfig(tp=4, pp=2, dp_replicate=2, micro_batch_size=1, num_microbatches=8))  # fmt: skip
# A Frontier/Perlmutter-style site: account and partition from settings, the rest from the spec.
SITE = SiteSettings(account="abc123", partition="batch", setup=("source /ccs/proj/abc123/env.sh",),
                    python="/ccs/proj/abc123/venv/bin/python")  # fmt: skip
SPEC = SlurmSpec(qos="debug", constraint="nvme&gpu", modules=["PrgEnv-gnu", "rocm/6.0.0"],
                 env={"NCCL_SOCKET_IFNAME": "hsn0", "NOTE": "it's $(not) `run`"}, cpus_per_task=7)  # fmt: skip
WORK = Path("/lustre/runs/study-1/trial-0003")


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    text = text.replace(str(ROOT), "<ROOT>")
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; UPDATE_GOLDEN=1 rewrites it after a deliberate change"


def test_job_script_matches_golden_file() -> None:
    script = render_script(CFG, work_dir=WORK, spec=SPEC, site=SITE, env={"TUNER_TRIAL": "3"})
    _golden("trial.sbatch", script)


def _resources() -> SlurmResources:
    return SlurmResources.for_trial(CFG, name="study-1-3", timeout_s=900, spec=SPEC, site=SITE, gpus_per_node=8,
                                    output=str(WORK / "log.txt"), chdir=WORK)  # fmt: skip


def test_sbatch_argv_matches_golden_file() -> None:
    args = _resources().argv(WORK / "job.sbatch")
    _golden("trial.args.json", json.dumps(args, indent=1) + "\n")
    # 16 ranks on 8-GPU nodes: 2 nodes x 8 tasks, 15 minutes
    assert "--nodes=2" in args and "--ntasks-per-node=8" in args and "--time=15" in args
    assert "--gpus-per-node=8" in args and "--account=abc123" in args and "--qos=debug" in args


def test_argv_and_sbatch_lines_are_one_description() -> None:
    resources = _resources()
    assert [f"#SBATCH {o}" for o in resources.argv(WORK / "job.sbatch")[2:-1]] == resources.sbatch_lines()


def test_time_limit_is_whole_minutes_of_the_trial_timeout() -> None:
    assert [time_limit_minutes(s) for s in (1, 59, 60, 61, 600)] == [1, 1, 1, 2, 10]


@pytest.mark.parametrize("field,value", [
    ("partition", "debug; rm -rf /"), ("partition", "$(id)"), ("account", "a b"), ("qos", "q'"),
    ("constraint", "gpu`id`"), ("partition", "../x"),
])  # fmt: skip
def test_slurm_names_that_a_shell_or_sbatch_could_misread_are_refused(field: str, value: str) -> None:
    data = {"name": "s", "model": "gpt-tiny", "cluster": "cpu-local", "num_gpus": 1,
            "training": {"global_batch_size": 8}, "slurm": {field: value}}  # fmt: skip
    with pytest.raises(SpecError, match=f"slurm.{field}"):
        parse_spec(data)


def test_module_and_env_names_are_checked_and_values_quoted() -> None:
    with pytest.raises(ValueError, match="module name"):
        SlurmSpec(modules=["rocm; id"])
    with pytest.raises(ValueError, match="environment variable name"):
        SlurmSpec(env={"A B": "x"})
    script = render_script(CFG, work_dir=Path("/w d/x"), spec=SlurmSpec(env={"X": "a'b $(c)"}), site=SiteSettings(),
                           env={})  # fmt: skip
    assert "export X='a'\"'\"'b $(c)'" in script and "cd '/w d/x'" in script


def test_site_settings_from_the_environment_are_validated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tuner.settings import Settings, SettingsError

    setup = tmp_path / "setup.sh"
    setup.write_text("module purge\nsource /opt/env.sh\n")
    monkeypatch.setenv("TUNER_SLURM_ACCOUNT", "abc")
    monkeypatch.setenv("TUNER_SLURM_SETUP", str(setup))
    monkeypatch.setenv("TUNER_SLURM_SOCKET_IFNAME", "hsn0")
    site = Settings.from_env().slurm.site()
    assert (site.account, site.setup, site.socket_ifname) == (
        "abc",
        ("module purge", "source /opt/env.sh"),
        "hsn0",
    )
    assert site.exports == {"GLOO_SOCKET_IFNAME": "hsn0", "NCCL_SOCKET_IFNAME": "hsn0"}
    monkeypatch.setenv("TUNER_SLURM_PARTITION", "a;b")
    with pytest.raises(SettingsError, match=r"^TUNER_SLURM_PARTITION: String should match pattern"):
        Settings.from_env()


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "a b; $(rm -rf x)", "`id`", "..", ".hidden", "ok-name_1.2"]
)
def test_slug_is_a_safe_path_component(name: str) -> None:
    s = slug(name)
    assert s and s not in (".", "..") and not s.startswith(".") and "/" not in s
    assert set(s) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
    assert (s == name) == (name == "ok-name_1.2")
