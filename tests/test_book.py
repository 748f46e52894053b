"""The course book (`make book`, mkdocs.yml): every lesson executed and rendered into a static
site with the guides, the architecture and the benchmarks; `mkdocs build --strict` passes, every
link inside the site resolves (pages, files, anchors), and each page opens in a real headless
browser (tests/browser.py): it loads, its pictures are in the page, its animations are there,
and no script fails."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from browser import need_chromium, render, script_errors

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
ANIMATED = {"01_kv_memory_waste", "02_block_manager"}
PAGES = ["index", "start_here", "build_track", "architecture", "benchmarks", "guides/serving"]


def nav_pages() -> list[str]:
    from mkdocs.config import load_config
    cfg = load_config(str(ROOT / "mkdocs.yml"))

    def walk(items):
        for item in items:
            value = item if isinstance(item, str) else next(iter(item.values()))
            if isinstance(value, list):
                yield from walk(value)
            else:
                yield value
    return list(walk(cfg["nav"]))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, OMP_NUM_THREADS="1", NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--clean", "--strict", "-f",
                           str(ROOT / "mkdocs.yml"), "-d", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_the_nav_has_every_lesson_in_order_and_every_page():
    pages = nav_pages()
    lessons = [p for p in pages if p.endswith(".ipynb")]
    assert lessons == [f"notebooks/{name}.ipynb" for name in LESSONS]
    assert pages[:2] == ["index.md", "start_here.md"]
    own = sorted(p.relative_to(ROOT / "docs").as_posix()
                 for p in (ROOT / "docs").rglob("*.md") if not p.is_symlink())
    assert set(own) <= set(pages), set(own) - set(pages)
    assert "build_track.md" in pages and "architecture.md" in pages
    assert "benchmarks/README.md" in pages


def test_the_readme_links_resolve_and_its_guides_are_in_the_book():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    pages = set(nav_pages())
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert links
    for link in links:
        if urlsplit(link).scheme:
            continue
        assert (ROOT / link).exists(), f"README links to {link}, which is not in the repository"
        if link.startswith("docs/"):
            assert link.removeprefix("docs/") in pages, f"{link} is not in the book's nav"
    guides = {link for link in links if link.startswith("docs/guides/")}
    assert len(guides) >= 11


def broken_links(site: Path) -> list[str]:
    """Every relative href / src of every page that names no file of the site, or an anchor
    that the target page does not have."""
    attr = re.compile(r'<(?:a|img|link|script|source)\b[^>]*?\s(?:href|src)="([^"]*)"', re.S)
    ids: dict[Path, set[str]] = {}
    bad = []
    for page in sorted(site.rglob("*.html")):
        for url in attr.findall(page.read_text(errors="replace")):
            parts = urlsplit(url)
            if parts.scheme or url.startswith(("/", "data:", "mailto:")) or not url:
                continue  # other sites; 404.html's root-absolute links
            target = page if not parts.path else page.parent / unquote(parts.path)
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                bad.append(f"{page.relative_to(site)}: {url}")
            elif parts.fragment and target.suffix == ".html":
                if target not in ids:
                    ids[target] = set(re.findall(r'\sid="([^"]+)"', target.read_text(errors="replace")))
                if unquote(parts.fragment) not in ids[target]:
                    bad.append(f"{page.relative_to(site)}: {url} (no such anchor)")
    return bad


def test_every_link_inside_the_site_resolves(site):
    assert len(list(site.rglob("*.html"))) > 25
    assert broken_links(site) == []


def test_the_link_checker_finds_a_broken_link(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "index.html").write_text('<h2 id="x">x</h2><a href="#x">ok</a>'
                                               '<a href="../b/">gone</a><a href="#y">no</a>'
                                               '<a href="https://example.com/">other</a>')
    assert broken_links(tmp_path) == ["a/index.html: ../b/", "a/index.html: #y (no such anchor)"]


def test_code_paths_link_to_their_source(site):
    html = (site / "architecture" / "index.html").read_text()
    assert '<a href="../minipaged/engine/scheduler.py"><code>engine/scheduler.py</code></a>' in html
    assert (site / "minipaged" / "engine" / "scheduler.py").is_file()


def test_every_lesson_is_a_page_with_its_outputs(site):
    assert (site / "index.html").is_file()
    for name in LESSONS:
        page = site / "notebooks" / name / "index.html"
        assert page.is_file(), f"{name} is missing from the book"
        html = page.read_text()
        assert "data:image/png;base64," in html, f"{name}: no picture was rendered"
        if name in ANIMATED:
            assert 'class="animation"' in html, f"{name}: its animation is missing"


@pytest.mark.parametrize("name", PAGES + LESSONS)
def test_pages_load_in_a_headless_browser(site, name):
    need_chromium()
    page = site / ("notebooks/" + name if name in LESSONS else name) / "index.html"
    if name == "index":
        page = site / "index.html"
    dom, console = render(page.as_uri())
    assert "minipaged" in dom
    assert not script_errors(console), console
    if name in ANIMATED:  # the player's script ran and put its first frame in place
        assert re.search(r'<img[^>]+id="_anim_img[^"]*"[^>]+src="data:image/png', dom), \
            "the animation's first frame did not load"


def test_every_lesson_links_to_start_here_and_the_glossary():
    import json
    for name in LESSONS:
        first = "".join(json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"][0]["source"])
        assert "../docs/start_here.md#glossary" in first, f"{name}: no link to the glossary"
    text = (ROOT / "docs" / "start_here.md").read_text()
    for heading in ("## What you need", "## What each part teaches", "## Study time per lesson",
                    "## Glossary"):
        assert heading in text
    for name in LESSONS:
        assert f"(notebooks/{name}.ipynb)" in text, f"{name} has no study time"
