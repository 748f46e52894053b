"""The course book (`make book`, mkdocs.yml): every lesson executed and rendered into a static
site, and each page opened in a real headless browser (tests/browser.py): it loads, its
pictures are in the page, its animations are there, and no script fails."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from browser import need_chromium, render, script_errors

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
ANIMATED = {"01_kv_memory_waste", "02_block_manager"}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--clean", "-f",
                           str(ROOT / "mkdocs.yml"), "-d", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_every_lesson_is_a_page_with_its_outputs(site):
    assert (site / "index.html").is_file()
    for name in LESSONS:
        page = site / name / "index.html"
        assert page.is_file(), f"{name} is missing from the book"
        html = page.read_text()
        assert "data:image/png;base64," in html, f"{name}: no picture was rendered"
        for src in re.findall(r'<img[^>]+src="([^"]+)"', html):
            if not src.startswith("data:"):
                assert (page.parent / src).resolve().exists(), f"{name}: broken image {src}"
        if name in ANIMATED:
            assert 'class="animation"' in html, f"{name}: its animation is missing"


@pytest.mark.parametrize("name", ["index"] + LESSONS)
def test_pages_load_in_a_headless_browser(site, name):
    need_chromium()
    page = site / "index.html" if name == "index" else site / name / "index.html"
    dom, console = render(page.as_uri())
    assert "minipaged" in dom
    assert not script_errors(console), console
    if name in ANIMATED:  # the player's script ran and put its first frame in place
        assert re.search(r'<img[^>]+id="_anim_img[^"]*"[^>]+src="data:image/png', dom), \
            "the animation's first frame did not load"
