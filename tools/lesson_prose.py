"""Count the prose of the lessons: words of markdown per lesson and per paragraph.

    python tools/lesson_prose.py                      # every notebook: words, longest paragraphs
    python tools/lesson_prose.py notebooks/06_*.ipynb

tests/test_lessons_prose.py holds the lessons to MAX_LESSON_WORDS and MAX_PARAGRAPH_WORDS. How it
counts, the same here and there:

* only markdown cells are read; code cells and their outputs are not prose;
* fenced (```) and indented code blocks, HTML comments and images are dropped, and a link counts
  by its text only (its target is not read);
* a word is a whitespace-separated token holding at least one letter or digit (inline code such
  as `apply_penalties` is one word; an arrow or a bullet is none);
* a paragraph is a block between blank lines; inside a block, each list item, each table row and
  each heading starts a paragraph of its own.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LESSON_WORDS = 1800
MAX_PARAGRAPH_WORDS = 200

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)
IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
NEW_ITEM = re.compile(r"^\s{0,3}(?:[*+-]\s|\d+[.)]\s|#{1,6}\s|\|)")
INDENTED = re.compile(r"^(?: {4}|\t)")
WORD = re.compile(r"\w")


def paragraphs(markdown: str) -> list[str]:
    """The prose paragraphs of one markdown cell (see the module docstring for the rules)."""
    text = LINK_TARGET.sub("]", IMAGE.sub("", COMMENT.sub("", FENCE.sub("", markdown))))
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if all(INDENTED.match(line) or not line.strip() for line in lines):
            continue  # an indented code block
        current: list[str] = []
        for line in lines:
            if NEW_ITEM.match(line) and current:
                out.append("\n".join(current))
                current = []
            current.append(line)
        out.append("\n".join(current))
    return [p for p in out if count_words(p)]


def count_words(text: str) -> int:
    return sum(1 for token in text.split() if WORD.search(token))


def lesson_paragraphs(path: Path) -> list[tuple[int, int, str]]:
    """(cell index, words, paragraph) for every prose paragraph of a notebook."""
    cells = json.loads(path.read_text())["cells"]
    return [(i, count_words(p), p) for i, cell in enumerate(cells)
            if cell["cell_type"] == "markdown"
            for p in paragraphs("".join(cell["source"]))]


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    print(f"{'lesson':32} {'words':>6}  longest paragraphs (words @ cell)")
    for path in paths:
        paras = lesson_paragraphs(path)
        longest = sorted(paras, key=lambda p: -p[1])[:3]
        print(f"{path.stem:32} {sum(n for _, n, _ in paras):6d}  "
              + ", ".join(f"{n} @ {i}" for i, n, _ in longest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
