"""The `tuner` console script, run as a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TUNER = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"


def tuner(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([TUNER, *args], capture_output=True, text=True, timeout=600, cwd=cwd)


def test_version() -> None:
    proc = tuner("version")
    assert proc.returncode == 0 and proc.stdout.strip() == "0.1.0"


def test_unknown_model_preset_is_a_clear_error() -> None:
    proc = tuner("demo", "--model", "gpt5")
    assert proc.returncode == 2
    assert "unknown preset 'gpt5'" in proc.stderr and "gpt-tiny" in proc.stderr


def test_cli_does_not_import_torch() -> None:
    code = "import sys, tuner.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.distributed
def test_demo_runs_every_layout(tmp_path: Path) -> None:
    proc = tuner("demo", "--work-dir", str(tmp_path), "--steps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fastest:" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary) == 8 and all(row["result"]["status"] == "ok" for row in summary)
    # Same model, same global batch, same seed: every layout ends at the same loss.
    final = [row["result"]["losses"][-1] for row in summary]
    assert max(final) - min(final) < 1e-4 * final[0]
