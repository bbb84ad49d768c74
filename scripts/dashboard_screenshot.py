"""The README's dashboard screenshot (docs/dashboard-study.png) from a real study: `tuner demo`
(llama-tiny on this machine's CPU cores: studies/tiny-llama-cpu.yaml) into a temporary SQLite database,
`tuner serve --no-worker` over it, and the study page in headless Chromium (Playwright driving
Debian's /usr/bin/chromium, as the dashboard tests do).

    flock /tmp/parallel-tuner-measure.lock .venv/bin/python scripts/dashboard_screenshot.py

The demo runs 12 real trials (a few minutes on 2 cores: hence the lock, which keeps it off other
measurements). `--database URL` photographs the newest llama-tiny study of an existing database instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
TUNER = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"
CHROMIUM = "/usr/bin/chromium"
CHARTS = ("history", "memory", "predicted", "failures")  # the ones in the picture


def tuner_env(database_url: str, work_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNER_")}
    return {**env, "TUNER_DATABASE_URL": database_url, "TUNER_WORK_DIR": str(work_dir)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def screenshot(base: str, out: Path, width: int, height: int) -> str:
    """The newest llama-tiny study's page, its charts drawn, saved to `out`; returns what the picture
    shows, in one line (for the README's caption)."""
    studies = httpx.get(f"{base}/api/studies", params={"model": "llama-tiny", "limit": 1}).json()["items"]
    if not studies:
        raise SystemExit("no llama-tiny study in the database")
    study = studies[0]
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        page = browser.new_context(viewport={"width": width, "height": height}).new_page()
        page.goto(f"{base}/#/study/{study['id']}")
        for name in CHARTS:
            page.wait_for_selector(f'[data-chart="{name}"][data-points]', timeout=30_000)
        page.screenshot(path=str(out))
        browser.close()
    detail = httpx.get(f"{base}/api/studies/{study['id']}").json()
    states = ", ".join(f"{n} {s.lower()}" for s, n in detail["progress"]["by_state"].items())
    best = detail["best"]
    return (f"study {detail['name']!r}: {detail['model']} on {detail['gpus']} x {detail['cluster']}, "
            f"{detail['sampler']} sampler, {states}; best #{best['number']} {best['layout']} "
            f"{best['tokens_per_s']:,.0f} tokens/s; created {detail['created_at']}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard-study.png")
    parser.add_argument(
        "--database", help="photograph this database's newest llama-tiny study instead of running the demo"
    )
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=1100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tuner-screenshot-") as tmp:
        env = tuner_env(args.database or f"sqlite:///{Path(tmp) / 'demo.sqlite'}", Path(tmp) / "runs")
        if not args.database:
            print("running `tuner demo` (12 real trials on this CPU) ...", flush=True)
            subprocess.run([TUNER, "demo"], env=env, check=True, cwd=tmp)
        port = free_port()
        server = subprocess.Popen([TUNER, "serve", "--no-worker", "--port", str(port)], env=env, cwd=tmp,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{base}/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("tuner serve did not answer")
                time.sleep(0.2)
            shown = screenshot(base, args.out, args.width, args.height)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"{args.out}: {shown}")


if __name__ == "__main__":
    main()
