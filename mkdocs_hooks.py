"""mkdocs hooks for the course book (mkdocs.yml `hooks:`).

The book's pages keep the repository's layout: docs/ holds the book's own pages, and
docs/notebooks, docs/benchmarks and docs/figures are links to the repository's folders, so a
relative link that works in the repository works in the book too. Three things mkdocs does not
do by itself:

* the source files (`minipaged/**/*.py`, `tests/*.py`) are added to the site as they are, so a
  code path can be a link to its source;
* a link written from a lesson or from benchmarks/README.md into `docs/` (`../docs/start_here.md`,
  right in the repository) points at the book's page;
* lessons are rendered by mkdocs-jupyter, which leaves their links as written: a link to another
  page or file is rewritten to that page's address in the site (a lesson's page sits one folder
  deeper than its notebook), and an inline code span naming a file of the repository
  (`engine/scheduler.py`, `minipaged/engine/scheduler.py`, `tests/test_sampler.py`) becomes a
  link to its source, on every page;
* mkdocs-jupyter's table of contents drops a heading's code spans from its anchors
  (`max_model_len` vs `max_num_seqs` -> `#vs`) while the heading's id keeps them: the table's
  links are pointed at the ids.
"""
from __future__ import annotations

import html
import posixpath
import re
from pathlib import Path

from markdown.extensions.toc import slugify
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent
MIRRORED = ("notebooks/", "benchmarks/", "figures/")  # folders the book links to, not its own
SOURCES = [("minipaged", "**/*.py"), ("tests", "*.py")]
_files: dict[str, File] = {}


def on_files(files: Files, config) -> Files:
    for folder, pattern in SOURCES:
        for path in sorted((ROOT / folder).glob(pattern)):
            if "__pycache__" in path.parts:
                continue
            uri = path.relative_to(ROOT).as_posix()
            if files.get_file_from_path(uri) is None:
                files.append(File(uri, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    _files.clear()
    _files.update({f.src_uri: f for f in files})
    return files


def _target(page_uri: str, link: str) -> str:
    """The site path a relative link of the page at `page_uri` names, read in the repository."""
    base = posixpath.dirname(page_uri)
    path = posixpath.normpath(posixpath.join(base, link)) if base else posixpath.normpath(link)
    mirrored = page_uri.startswith(MIRRORED)
    if mirrored and path.startswith("docs/"):
        return path[len("docs/"):]
    return path


_MD_LINK = re.compile(r"\]\(([^)\s#:]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    uri = page.file.src_uri
    if not uri.startswith(MIRRORED):
        return markdown

    def fix(m):
        target = _target(uri, m.group(1))
        if target in _files:
            rel = posixpath.relpath(target, posixpath.dirname(uri) or ".")
            return f"]({rel}{m.group(2) or ''})"
        return m.group(0)

    return _MD_LINK.sub(fix, markdown)


_HREF = re.compile(r'href="([^"#:?]+\.(?:md|ipynb|py|json|png|sh|txt|yaml|yml))(#[^"]*)?"')
_CODE = re.compile(r'(?<!">)<code>([A-Za-z0-9_./-]+\.(?:py|md|ipynb|json|sh|png))</code>')


def _source(name: str) -> File | None:
    for cand in (name, "minipaged/" + name):
        f = _files.get(posixpath.normpath(cand))
        if f is not None:
            return f
    return None


def on_post_page(output: str, page, config) -> str:
    uri = page.file.src_uri
    if uri.endswith(".ipynb"):
        def fix(m):
            f = _files.get(_target(uri, m.group(1)))
            if f is None:
                return m.group(0)
            return f'href="{f.url_relative_to(page.file)}{m.group(2) or ""}"'
        output = _HREF.sub(fix, output)
        output = _fix_toc(output)

    def link(m):
        f = _source(m.group(1))
        if f is None:
            return m.group(0)
        return f'<a href="{f.url_relative_to(page.file)}">{m.group(0)}</a>'

    head, sep, body = output.partition('<div class="md-content"')
    return head + sep + _CODE.sub(link, body) if sep else output


_HEADING = re.compile(r'<h[1-6] id="([^"]+)"[^>]*>(.*?)</h[1-6]>', re.S)


def _fix_toc(output: str) -> str:
    ids = set(re.findall(r'\sid="([^"]+)"', output))
    for hid, inner in _HEADING.findall(output):
        text = re.sub(r'<a class="anchor-link".*?</a>|<code>.*?</code>', "", inner, flags=re.S)
        alias = slugify(html.unescape(re.sub(r"<[^>]+>", "", text)), "-")
        if alias and alias != hid and alias not in ids:
            output = output.replace(f'href="#{alias}"', f'href="#{hid}"')
    return output
