"""The `tuner` console script, run as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.cost.terms import TERM_LABELS

TUNER = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"


def tuner(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([TUNER, *args], capture_output=True, text=True, timeout=600, cwd=cwd)


def test_version() -> None:
    proc = tuner("version")
    assert proc.returncode == 0 and proc.stdout.strip() == "0.1.0"


def test_run_of_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    proc = tuner("run", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_does_not_import_torch() -> None:
    code = "import sys, tuner.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.distributed
def test_demo_runs_the_tiny_study_and_best_returns_it(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TUNER_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}",
        "TUNER_WORK_DIR": str(tmp_path),
    }
    proc = subprocess.run([TUNER, "demo"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ": complete" in proc.stdout and "best layout:" in proc.stdout
    best = subprocess.run([TUNER, "best", "--json"], capture_output=True, text=True, timeout=60, env=env)
    (row,) = json.loads(best.stdout)
    assert (
        row["model"] == "llama-tiny"
        and row["family"] == "llama"
        and row["tokens_per_s"] > 0
        and row["gpus"] == 2
    )
    trials = json.loads(subprocess.run([TUNER, "trials", row["study"], "--json"], capture_output=True, text=True,
                                       timeout=60, env=env).stdout)  # fmt: skip
    assert max(t["tokens_per_s"] or 0 for t in trials) == row["tokens_per_s"]
    assert all(t["state"] in ("complete", "failed", "pruned") for t in trials)


ACCEPTANCE = [
    "plan",
    "--model",
    "gpt-175b",
    "--cluster",
    "frontier-mi250x",
    "--gpus",
    "1024",
    "--global-batch",
    "640",
]


def test_plan_json_has_the_documented_shape_and_valid_candidates() -> None:
    from trainer.contract.presets import MODEL_PRESETS
    from tuner.space import SearchSpace, layout
    from tuner.spec import SpaceSpec

    proc = tuner(*ACCEPTANCE, "--json", "--top", "20")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) == {"space_size", "num_valid", "num_fit", "rejected", "vocab", "candidates", "column"}
    assert doc["column"] == []  # the space offers no column axis (tp_col [1])
    assert doc["vocab"] == {"vocab_size": 50304, "divisible_by": 128,
                            "padded_by_tp": {"1": 50304, "2": 50432, "4": 50688, "8": 51200}}  # fmt: skip
    assert doc["space_size"] >= doc["num_valid"] >= doc["num_fit"] >= len(doc["candidates"]) == 20
    assert all(isinstance(k, str) and v > 0 for k, v in doc["rejected"].items())
    space = SearchSpace(MODEL_PRESETS["gpt-175b"], 1024, 8, 640, SpaceSpec())
    speeds = [c["predicted"]["tokens_per_s"] for c in doc["candidates"]]
    assert speeds == sorted(speeds, reverse=True)
    for cand in doc["candidates"]:
        k = dict(cand["config"])
        assert set(cand["predicted"]) == {
            "memory_bytes",
            "step_time_s",
            "tokens_per_s",
            "tflops_per_device",
            "mfu",
            "fits",
            "terms",
            "hidden",
        }
        terms = cand["predicted"]["terms"]
        # communication overlapped with compute, named by the term it would add to, not in the step
        assert set(cand["predicted"]["hidden"]) <= set(TERM_LABELS)
        assert set(terms) == set(TERM_LABELS)  # every second of the step, by term
        assert sum(terms.values()) == pytest.approx(cand["predicted"]["step_time_s"], rel=1e-9)
        assert cand["predicted"]["fits"] is True and cand["predicted"]["memory_bytes"] <= 64e9
        assert cand["vocab_size"] == int(doc["vocab"]["padded_by_tp"][str(k["tp"])])
        config = layout(k.pop("tp"), k.pop("pp"), k.pop("dp"), **k)
        assert space.explain(config) == [], (cand, space.explain(config))


GPT2_VOCAB = ["plan", "--model", "gpt-175b", "--vocab", "50257", "--cluster", "a100-80gb", "--gpus", "512",
              "--global-batch", "1536"]  # fmt: skip


@pytest.mark.slow  # several `tuner` processes (~10 s on 2 cores): in make test, out of the edit loop
def test_plan_pads_the_gpt2_vocabulary_and_prices_tp_across_nodes() -> None:
    """Issue 13: the real GPT-2 vocabulary gives candidates at every tp up to 8, each with its
    padded vocabulary stated; a pinned tp=16 (two nodes) is valid and predicted slower than tp=8."""
    proc = tuner(*GPT2_VOCAB, "--json", "--top", "2000")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert not any("vocab" in rule for rule in doc["rejected"])
    assert doc["vocab"]["padded_by_tp"] == {"1": 50304, "2": 50432, "4": 50688, "8": 51200}
    best = {}
    for cand in doc["candidates"]:
        best.setdefault(cand["config"]["tp"], cand["predicted"]["tokens_per_s"])
    assert set(best) == {1, 2, 4, 8}
    pinned = json.loads(tuner(*GPT2_VOCAB, "--json", "--config", "tp=16").stdout)
    assert pinned["candidates"] and pinned["vocab"]["padded_by_tp"] == {"16": 51200}
    assert pinned["candidates"][0]["predicted"]["tokens_per_s"] < best[8]
    text = tuner(*GPT2_VOCAB, "--top", "3").stdout
    assert "vocabulary 50257, padded to a multiple of 128 x tp (Megatron-LM): 50304 at tp 1" in text
    assert "51200 at tp 8" in text


def test_plan_pins_narrow_the_candidates() -> None:
    proc = tuner(*ACCEPTANCE, "--json", "--config", "tp=8,pp=16")
    doc = json.loads(proc.stdout)
    assert doc["candidates"] and all(
        c["config"]["tp"] == 8 and c["config"]["pp"] == 16 for c in doc["candidates"]
    )


def test_plan_pin_outside_the_default_choices() -> None:
    proc = tuner("plan", "--layers", "105", "--hidden", "12288", "--heads", "96", "--cluster", "a100-80gb",
                 "--gpus", "560", "--global-batch", "70", "--config", "tp=8,pp=35", "--json", "--include-unfit")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert {c["config"]["pp"] for c in json.loads(proc.stdout)["candidates"]} == {35}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "tp=5"], "space.tp: [5] do not divide the model's num_heads (96)"),
        (["--config", "tensor=8"], "'tensor=8' is not KEY=VALUE"),
        (["--config", "tp=8,dp=3"], "no valid layout agrees"),
        (["--cluster", "dgx-9000"], "unknown cluster preset 'dgx-9000'"),
        (["--model", "gpt-9t"], "unknown model preset 'gpt-9t'"),
        (["--global-batch", "-5"], "training.global_batch_size: Input should be greater than 0"),
        (["--gpus", "7", "--gpus-per-node", "8"], "num_gpus (7) must be a multiple of gpus_per_node (8)"),
    ],
)
def test_plan_bad_input_exits_2_without_traceback(args: list[str], message: str) -> None:
    base = dict(zip(ACCEPTANCE[1::2], ACCEPTANCE[2::2], strict=True))
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    proc = tuner("plan", *[x for kv in base.items() for x in kv])
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_plan_without_a_global_batch_names_the_flag(tmp_path: Path) -> None:
    proc = tuner("plan", "--model", "llama3.1-8b", "--cluster", "h100-80gb", "--gpus", "16")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        "--global-batch: the global batch size in sequences is required (e.g. --global-batch 512)"
        in proc.stderr
    )
    spec = tmp_path / "s.yaml"
    spec.write_text("model: llama3.1-8b\ncluster: h100-80gb\nnum_gpus: 8\n")
    proc = tuner("plan", "--spec", str(spec))
    assert proc.returncode == 2 and f"or training.global_batch_size in --spec {spec}" in proc.stderr
    assert tuner("plan", "--spec", str(spec), "--global-batch", "64", "--top", "1").returncode == 0


def test_plan_reads_a_spec_file_and_reports_bad_keys(tmp_path: Path) -> None:
    studies = Path(__file__).resolve().parents[2] / "studies"
    proc = tuner("plan", "--spec", str(studies / "frontier-22b.yaml"), "--top", "3")
    assert proc.returncode == 0 and "rejected layouts by reason" in proc.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: gpt-22b\ncluster: a100-80gb\ntraining: {global_batch_size: 8}\nbudjet: {}\n")
    proc = tuner("plan", "--spec", str(bad))
    assert proc.returncode == 2 and "budjet: Extra inputs are not permitted" in proc.stderr


HF_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"
# 2 nodes, pp pinned to 1: tp up to the node and beyond it, dp across nodes; the GQA rule is about
# tp alone (the 512- and 1,024-GPU plans these tests ran took 35-40 s each in a make test).
LLAMA_70B = ["plan", "--hf-config", str(HF_CONFIGS / "Llama-3.1-70B.json"), "--cluster", "h100-80gb",
             "--gpus", "16", "--global-batch", "32", "--config", "pp=1"]  # fmt: skip
LLAMA_405B = ["plan", "--model", "llama3.1-405b", "--cluster", "h100-80gb", "--gpus", "16",
              "--global-batch", "32", "--config", "pp=1"]  # fmt: skip


@pytest.mark.slow  # plans in a process each
@pytest.mark.parametrize("args", [LLAMA_70B, LLAMA_405B], ids=["70b-hf-config", "405b-preset"])
def test_plan_of_a_gqa_model_rejects_tp_past_its_kv_heads(args: list[str]) -> None:
    """Issue 26: Llama 3.1's 8 KV heads cap tp at 8. The default space offers tp up to the query
    heads (tuner.spec.default_tp), so the rejections count the layouts the rule removes."""
    proc = tuner(*args, "--json", "--top", "100000", "--include-unfit")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert len(doc["candidates"]) == doc["num_valid"] > 0
    assert {c["config"]["tp"] for c in doc["candidates"]} == {1, 2, 4, 8}
    assert doc["rejected"]["tp must divide num_kv_heads"] > 0
    text = tuner(*args, "--top", "3").stdout
    assert "(llama):" in text.splitlines()[0]
    kv_line = next(line for line in text.splitlines() if line.endswith("tp must divide num_kv_heads"))
    assert int(kv_line.split()[0]) == doc["rejected"]["tp must divide num_kv_heads"]


@pytest.mark.slow  # several `tuner` processes (~10 s on 2 cores): in make test, out of the edit loop
def test_plan_of_an_hf_config_is_the_preset_it_names() -> None:
    """The file's plan is the preset's, layout for layout (on one node with pp 1 pinned: the
    model is what is compared, and a plan of the 512-GPU space takes most of a minute)."""
    small = [*LLAMA_70B[:3], *LLAMA_70B[3:5], "--gpus", "8", "--global-batch", "64", "--config", "pp=1"]
    from_file = json.loads(tuner(*small, "--json", "--top", "5", "--include-unfit").stdout)
    preset = json.loads(
        tuner(
            small[0], "--model", "llama3.1-70b", *small[3:], "--json", "--top", "5", "--include-unfit"
        ).stdout
    )
    assert from_file == preset and from_file["num_valid"] > 0
    assert tuner(*small, "--top", "1").stdout.startswith("llama3.1-70b (llama): 70.55B parameters, seq 8192")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hf-config", str(HF_CONFIGS / "Mistral-7B-v0.1.json")], "model.hf_config: "),
        (["--hf-config", str(HF_CONFIGS / "Mistral-7B-v0.1.json")], "sliding_window 4096 is not supported"),
        (["--hf-config", "no/such/config.json"], "cannot read"),
        (["--hf-config", str(HF_CONFIGS / "Llama-3.1-8B.json"), "--model", "llama3.1-8b"], "give one model"),
    ],
)
def test_plan_refuses_an_hf_config_it_cannot_read(args: list[str], message: str) -> None:
    proc = tuner("plan", *args, "--cluster", "h100-80gb", "--gpus", "8", "--global-batch", "64")
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow  # several `tuner` processes (~10 s on 2 cores): in make test, out of the edit loop
def test_plan_reads_a_mixture_of_experts_and_says_what_it_leaves_out(tmp_path: Path) -> None:
    """Mixtral's file is its preset (the label with total and active parameters); DeepSeek-V3's
    notes (tuner/hfconfig.py: hf_config_notes) go to stderr; experts on a dense architecture are
    refused by name. (One node with tp 8 pinned: what is said does not depend on the space, and a
    plan of DeepSeek-V3's whole default space takes a minute.)"""
    args = ("--cluster", "h100-80gb", "--gpus", "8", "--global-batch", "64", "--config", "pp=1,tp=8",
            "--top", "1")  # fmt: skip
    mixtral = tuner("plan", "--hf-config", str(HF_CONFIGS / "Mixtral-8x7B-v0.1.json"), *args)
    assert mixtral.returncode == 0, mixtral.stderr
    assert mixtral.stdout.startswith("mixtral-8x7b (llama-moe, 46.7B total, 12.9B active): 46.70B parameters")
    deepseek = tuner("plan", "--hf-config", str(HF_CONFIGS / "DeepSeek-V3.json"), *args)
    assert "note: --hf-config rope_scaling 'yarn' (factor 40" in deepseek.stderr, deepseek.stderr
    assert "note: --hf-config num_nextn_predict_layers 1" in deepseek.stderr
    llama = json.loads((HF_CONFIGS / "Llama-3.1-8B.json").read_text()) | {"num_local_experts": 8}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    refused = tuner("plan", "--hf-config", str(tmp_path / "config.json"), *args)
    assert refused.returncode == 2 and "mixture of experts ({'num_local_experts': 8}) is not supported with " \
        "model_type 'llama'" in refused.stderr, refused.stderr  # fmt: skip


def test_plan_spec_reads_hf_config_relative_to_the_spec(tmp_path: Path) -> None:
    (tmp_path / "llama").mkdir()
    shutil.copy(HF_CONFIGS / "Llama-3.1-8B.json", tmp_path / "llama" / "config.json")
    (tmp_path / "s.yaml").write_text("model: {hf_config: llama/config.json, num_layers: 16}\n"
                                     "cluster: h100-80gb\ntraining: {global_batch_size: 64}\n")  # fmt: skip
    proc = tuner("plan", "--spec", str(tmp_path / "s.yaml"), "--top", "1", cwd=HF_CONFIGS)  # cwd elsewhere
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("llama-L16-h4096-a32-kv8 (llama): ")


@pytest.mark.slow  # several `tuner` processes (~10 s on 2 cores): in make test, out of the edit loop
def test_studies_and_best_name_the_model_with_its_family(tmp_path: Path) -> None:
    """A study of a config.json submitted from its file: listed under the preset it is, with its
    family; a GPT study beside it keeps its plain key."""
    from tests.records import finish, record_trial
    from trainer.contract.parallel import ParallelConfig
    from tuner import store
    from tuner.db import connect
    from tuner.outcome import Outcome

    env = {**os.environ, "TUNER_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}", "COLUMNS": "300"}
    shutil.copy(HF_CONFIGS / "Llama-3.1-8B.json", tmp_path / "config.json")
    (tmp_path / "llama.yaml").write_text("name: llama\nmodel: {hf_config: config.json}\ncluster: h100-80gb\n"
                                         "training: {global_batch_size: 64}\n")  # fmt: skip
    (tmp_path / "gpt.yaml").write_text("name: gpt\nmodel: {num_layers: 4, hidden_size: 64, num_heads: 4}\n"
                                       "cluster: h100-80gb\ntraining: {global_batch_size: 64}\n")  # fmt: skip
    for name in ("llama", "gpt"):
        proc = subprocess.run([TUNER, "submit", str(tmp_path / f"{name}.yaml")], capture_output=True, text=True,
                              env=env, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    listed = subprocess.run([TUNER, "studies"], capture_output=True, text=True, env=env, timeout=60).stdout
    assert "llama3.1-8b (llama)" in listed and "L4-h64-a4 (gpt)" in listed
    with connect(env["TUNER_DATABASE_URL"]).begin() as s:
        study = store.get_study(s, "llama")
        record_trial(
            s, study, ParallelConfig(tp=8, micro_batch_size=8), Outcome(ok=True, tokens_per_s=9e4, mfu=0.4)
        )
        finish(s, study.id)
    best = subprocess.run([TUNER, "best"], capture_output=True, text=True, env=env, timeout=60).stdout
    assert best.startswith("llama3.1-8b (llama) (8,030.3M params) on 8 x h100-80gb: tp8"), best
    (row,) = json.loads(
        subprocess.run([TUNER, "best", "--json"], capture_output=True, text=True, env=env).stdout
    )
    assert (row["model"], row["family"]) == ("llama3.1-8b", "llama")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"space": {"tp": [5]}}, "space.tp: [5] do not divide the model's num_heads (4)"),
        ({"sampler": "hyperband"}, "sampler: Input should be"),
        ({"budget": {"max_trials": 0}}, "budget.max_trials: Input should be greater than 0"),
    ],
)
def test_run_refuses_a_bad_study_file(change: dict, message: str, tmp_path: Path) -> None:
    import yaml

    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "studies" / "tiny-cpu.yaml").read_text())
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({**spec, **change}))
    env = {**os.environ, "TUNER_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}"}
    proc = subprocess.run(
        [TUNER, "run", str(tmp_path / "s.yaml")], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_unreachable_database_is_one_line() -> None:
    env = {**os.environ, "TUNER_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none"}
    proc = subprocess.run([TUNER, "studies"], capture_output=True, text=True, timeout=60, env=env)
    assert (
        proc.returncode == 2 and proc.stderr.count("\n") == 1 and "cannot reach the database" in proc.stderr
    )


def _held_study(tmp_path: Path, owner, expires_in_s: float) -> dict[str, str]:
    """A tiny study in a fresh database, RUNNING under `owner`'s lease."""
    import datetime as dt

    import yaml

    from tuner import store
    from tuner.db import connect, utcnow
    from tuner.spec import load_spec

    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "studies" / "tiny-cpu.yaml").read_text())
    spec.update(name="held", budget={"max_trials": 1})
    (tmp_path / "held.yaml").write_text(yaml.safe_dump(spec))
    sessions = connect(db)
    with sessions.begin() as s:
        study_id = store.create_study(s, load_spec(tmp_path / "held.yaml")).id
        now = utcnow() - dt.timedelta(seconds=store.DEFAULT_LEASE_S - expires_in_s)
        store.claim(s, study_id, owner, now=now)
    return {**os.environ, "TUNER_DATABASE_URL": db, "TUNER_WORK_DIR": str(tmp_path / "runs")}


def test_run_refuses_a_study_a_live_worker_holds_and_studies_shows_the_holder(tmp_path: Path) -> None:
    from tuner import store

    env = _held_study(tmp_path, store.Owner("worker@gpu-node-7:4242:c0ffee", "gpu-node-7", 4242), 45)
    proc = subprocess.run(
        [TUNER, "run", str(tmp_path / "held.yaml")], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "worker@gpu-node-7:4242:c0ffee" in line and "expires in" in line
    shown = subprocess.run([TUNER, "studies", "--json"], capture_output=True, text=True, env=env)
    (row,) = json.loads(shown.stdout)  # the API's shape (tuner/views.py: StudySummary)
    assert row["status"] == "running" and row["owner"] == "worker@gpu-node-7:4242:c0ffee"
    assert row["lease"]["owner"] == row["owner"] and 0 < row["lease"]["expires_in_s"] <= 45
    table = subprocess.run([TUNER, "studies"], capture_output=True, text=True, env={**env, "COLUMNS": "250"})
    assert "worker@gpu-node-7:4242:c0ffee" in table.stdout


def test_run_takes_over_an_expired_lease_only_with_the_flag(tmp_path: Path) -> None:
    from tuner import store

    env = _held_study(tmp_path, store.Owner("worker@gpu-node-7:4242:c0ffee", "gpu-node-7", 4242), -5)
    proc = subprocess.run(
        [TUNER, "run", str(tmp_path / "held.yaml")], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2 and "expired" in proc.stderr and "--takeover" in proc.stderr


@pytest.mark.distributed
def test_run_with_takeover_finishes_a_study_whose_worker_vanished(tmp_path: Path) -> None:
    from tuner import store

    env = _held_study(tmp_path, store.Owner("worker@gpu-node-7:4242:c0ffee", "gpu-node-7", 4242), -5)
    proc = subprocess.run([TUNER, "run", str(tmp_path / "held.yaml"), "--takeover"], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resuming study 'held' (running)" in proc.stdout and "'held': complete" in proc.stdout


def test_a_bad_setting_is_one_line_naming_it() -> None:
    proc = subprocess.run([TUNER, "studies"], capture_output=True, text=True,
                          env={**os.environ, "TUNER_LEASE_S": "soon"})  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "TUNER_LEASE_S: Input should be a valid number, unable to parse string as a number (got 'soon')"
    )


def test_export_help_says_what_each_format_writes() -> None:
    text = " ".join(tuner("export", "--help").stdout.split())
    for said in ("torchtitan: a Python config module for torchtitan 0.3.0 (not TOML)",
                 "megatron: a `torchrun ... pretrain_gpt.py` command",
                 "sbatch: a Slurm script that runs our own trainer's short benchmark of the layout (the trial "
                 "again, not a training run)", "tuner plan ... --export FORMAT"):  # fmt: skip
        assert said in text, said
