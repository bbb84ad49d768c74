"""The layering rules (pyproject.toml's import-linter contracts; docs/architecture.md, "Layering
rules"): they hold for this checkout, and each one can fail. A copy of the three packages with one
forbidden import added breaks the contract that forbids it, and no other."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "api", "tuner", "trainer")
IMPORTLINTER = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
CONTRACTS = [c["name"] for c in IMPORTLINTER["contracts"]]
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"

CONTRACT_MODULES = "The tuner and the API import only the trainer's contract"
TORCH_FREE = "Torch-free: the tuner, the API and the trainer's contract modules"
# (the contract it breaks, module, the import added to it): at least one probe per contract. Each
# adds an import that breaks only its own rule (e.g. trainer.failures is torch-free, so importing
# it into the tuner breaks the contract-modules rule but not the torch-free one).
VIOLATIONS = [
    ("Layers: api -> tuner -> trainer (never upwards)", "trainer/config.py", "import tuner.spec"),
    ("Layers: api -> tuner -> trainer (never upwards)", "tuner/plan.py", "import bench.priors"),
    (CONTRACT_MODULES, "tuner/plan.py", "import trainer.failures"),
    (CONTRACT_MODULES, "api/main.py", "import trainer.launch"),
    (TORCH_FREE, "trainer/contract/trial_dir.py", "import torch"),
    (TORCH_FREE, "trainer/contract/axes.py", "import torch.nn"),
    (TORCH_FREE, "trainer/spawn.py", "import torch.distributed"),
    ("Dispatch never imports the runner, the store or the database", "tuner/dispatch/base.py", "from tuner import store"),
    ("Dispatch never imports the runner, the store or the database", "tuner/dispatch/local.py", "import sqlalchemy"),
    ("The store never imports the API, the CLI, the views or the runner", "tuner/store/trials.py", "import tuner.views"),
    ("The store never imports the API, the CLI, the views or the runner", "tuner/db.py", "from tuner.cli import common"),
    ("The API's routers query only through the store", "api/routers/studies.py", "from sqlalchemy import select"),
    # The memory oracle's exception is cli_memcheck's alone: anywhere else it breaks both rules.
    ((CONTRACT_MODULES, TORCH_FREE), "tuner/cli/plan.py", "from trainer.memcheck import memcheck"),
]  # fmt: skip


def lint_imports(root: Path) -> tuple[int, dict[str, str], str]:
    """Run import-linter on the packages under `root` with `root`'s pyproject.toml: (exit code,
    {contract name: KEPT or BROKEN}, the output)."""
    proc = subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache"], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"})  # fmt: skip
    out = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # some releases colour even a pipe
    verdicts = {}
    for name in CONTRACTS:
        m = re.search(rf"^{re.escape(name)} (KEPT|BROKEN)\b", out, re.MULTILINE)
        if m:
            verdicts[name] = m[1]
    return proc.returncode, verdicts, out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the packages' Python files and pyproject.toml, made once."""
    root = tmp_path_factory.mktemp("layering")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root)
    return root


def test_the_layering_contracts_hold() -> None:
    code, verdicts, out = lint_imports(ROOT)
    assert code == 0 and verdicts == dict.fromkeys(CONTRACTS, "KEPT"), out


def test_every_contract_is_probed_and_documented() -> None:
    assert {c for c, _, _ in VIOLATIONS if isinstance(c, str)} == set(CONTRACTS)
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    assert [c for c in CONTRACTS if f"**{c}**" not in architecture] == []


@pytest.mark.parametrize(
    ("contract", "module", "line"), VIOLATIONS, ids=[f"{m}: {i}" for _, m, i in VIOLATIONS]
)
def test_a_forbidden_import_breaks_its_contract(
    pristine: Path, tmp_path: Path, contract: str | tuple[str, ...], module: str, line: str
) -> None:
    broken = {contract} if isinstance(contract, str) else set(contract)
    root = tmp_path / "copy"
    shutil.copytree(pristine, root)
    with open(root / module, "a") as f:
        f.write(f"\n{line}  # the probe\n")
    code, verdicts, out = lint_imports(root)
    assert code != 0, out
    assert verdicts == {c: "BROKEN" if c in broken else "KEPT" for c in CONTRACTS}, out
    assert f"{module[:-3].replace('/', '.')} -> " in out  # the report names the probe's module
