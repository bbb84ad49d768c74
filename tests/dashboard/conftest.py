"""One headless Chromium per test module (Debian's /usr/bin/chromium, not Playwright's download)."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from tests.dashboard.helpers import CHROMIUM


@pytest.fixture(scope="module")
def browser():
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} missing: make system-deps (apt-get install chromium)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])  # fmt: skip
        yield browser
        browser.close()
