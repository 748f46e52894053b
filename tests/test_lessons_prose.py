"""The lessons stay readable: at most MAX_LESSON_WORDS words of markdown prose per lesson and
no paragraph over MAX_PARAGRAPH_WORDS. Longer accounts (how a number moved, what was tried and
dropped) belong in benchmarks/README.md or benchmarks/experiments/, with the lesson keeping a
summary and a link.

How words are counted (tools/lesson_prose.py, which `python tools/lesson_prose.py` prints per
lesson): markdown cells only; fenced and indented code blocks, HTML comments, images and link
targets dropped; a word is a whitespace-separated token with at least one letter or digit; a
paragraph is a block between blank lines, split again at each list item, table row and heading."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from lesson_prose import (MAX_LESSON_WORDS, MAX_PARAGRAPH_WORDS, count_words,  # noqa: E402
                          lesson_paragraphs, paragraphs)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def check_lesson(path: Path) -> None:
    paras = lesson_paragraphs(path)
    total = sum(n for _, n, _ in paras)
    assert total <= MAX_LESSON_WORDS, (
        f"{path.name}: {total} words of prose, over {MAX_LESSON_WORDS}: move an account into "
        f"benchmarks/README.md or benchmarks/experiments/ and keep a summary with a link")
    long = [f"cell {i}: {n} words ({' '.join(p.split()[:8])} ...)"
            for i, n, p in paras if n > MAX_PARAGRAPH_WORDS]
    assert long == [], f"{path.name}: paragraphs over {MAX_PARAGRAPH_WORDS} words: " + "; ".join(long)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_lesson_prose_within_limits(path):
    check_lesson(path)


def test_the_counter_skips_code_and_link_targets_and_splits_lists():
    text = ("Intro with `code_name` and a [link](../very/long/path/to/a/file.md#an-anchor) - ok.\n"
            "\n"
            "```python\nprint('not prose at all')\n```\n"
            "\n"
            "    minipaged exercise start x   # an indented code block\n"
            "\n"
            "* first item, four words\n"
            "* second item here\n"
            "| a | b |\n"
            "![a picture](figures/x.png)")
    paras = paragraphs(text)
    assert [count_words(p) for p in paras] == [7, 4, 3, 2]  # "-" is no word; the link counts by its text


def test_a_long_lesson_and_a_long_paragraph_fail(tmp_path):
    def notebook(*cells):
        path = tmp_path / "x.ipynb"
        path.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": c}
                                              for c in cells]}))
        return path

    long_para = " ".join(["word"] * (MAX_PARAGRAPH_WORDS + 1))
    with pytest.raises(AssertionError, match="paragraphs over"):
        check_lesson(notebook(long_para))
    short = " ".join(["word"] * (MAX_PARAGRAPH_WORDS // 2))
    many = [short] * (2 * MAX_LESSON_WORDS // MAX_PARAGRAPH_WORDS + 1)
    with pytest.raises(AssertionError, match="words of prose"):
        check_lesson(notebook(*many))
    check_lesson(notebook(short, short))
