"""A real headless browser for the tests: Debian's chromium, run as a command.

`render(url)` loads a page with every request off this machine failing (a proxy that does not
exist; loopback and file:// stay reachable), lets its scripts run, and returns the DOM they
left and the console's messages. Tests that need it skip when no chromium is installed
(the README's set-up installs it where it can).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from typing import Optional

import pytest


def chromium() -> Optional[str]:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def need_chromium() -> str:
    path = chromium()
    if path is None:
        pytest.skip("no headless chromium on this machine (Debian: apt-get install chromium)")
    return path


def render(url: str, budget_ms: int = 8000) -> tuple[str, list[str]]:
    """(DOM after the page's scripts ran, console messages) for `url`, offline."""
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [need_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}",
             "--proxy-server=http://127.0.0.1:9",  # nothing beyond this machine answers
             "--enable-logging=stderr", "--v=0", f"--virtual-time-budget={budget_ms}",
             "--dump-dom", url], capture_output=True, text=True, timeout=120)
    console = re.findall(r":CONSOLE[^\]]*\] (.*)", proc.stderr)
    return proc.stdout, console


def script_errors(console: list[str]) -> list[str]:
    return [m for m in console if "Uncaught" in m or "Error" in m.split(",")[0]]
