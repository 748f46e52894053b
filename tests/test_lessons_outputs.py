"""The lessons are committed executed (`make lessons`, tools/execute_lessons.py), so they read
without a kernel. Every code cell was run, and the output stored with it was produced by its
current source: each executed cell records the hash of its source, and a cell edited since
(stale) fails here until `make lessons` runs again. Every code cell shows something (a print, a
table, a figure) except a lesson's first, which holds its imports and setup; each lesson stores
at least one figure, and the stored notebooks stay small (no widget state; PNGs
palette-encoded)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from execute_lessons import source_hash  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_TOTAL_BYTES = 8 * 1024 * 1024


def code_cells(path: Path):
    nb = json.loads(path.read_text())
    return nb, [c for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_code_cell_was_run_from_its_current_source(path):
    _, cells = code_cells(path)
    stale = []
    for i, cell in enumerate(cells, 1):
        source = "".join(cell["source"])
        stored = cell["metadata"].get("minipaged", {}).get("source_sha256")
        if cell["execution_count"] is None or stored is None:
            stale.append(f"code cell {i} was never executed by make lessons")
        elif stored != source_hash(source):
            stale.append(f"code cell {i} changed since its output was stored")
        elif any(o["output_type"] == "error" for o in cell["outputs"]):
            stale.append(f"code cell {i} stored an error")
    assert stale == [], f"{path.name}: " + "; ".join(stale) + " (run `make lessons`)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_lesson_stores_a_figure_and_no_widget_state(path):
    nb, cells = code_cells(path)
    outputs = [o for c in cells for o in c["outputs"]]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name}: no figure"
    assert "widgets" not in nb["metadata"]
    assert not any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_code_cell_but_the_setup_stores_an_output(path):
    _, cells = code_cells(path)
    silent = [i for i, cell in enumerate(cells, 1) if i > 1 and not cell["outputs"]]
    assert silent == [], (f"{path.name}: code cells {silent} store no output; only the first "
                          "(imports and setup) may: print what the cell did")


def test_the_stored_lessons_are_small():
    assert sum(p.stat().st_size for p in NOTEBOOKS) < MAX_TOTAL_BYTES


def test_a_changed_cell_is_found_stale(tmp_path):
    nb = json.loads(NOTEBOOKS[0].read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    cell["source"] = "".join(cell["source"]) + "\n# edited"
    stale = tmp_path / NOTEBOOKS[0].name
    stale.write_text(json.dumps(nb))
    with pytest.raises(AssertionError, match="changed since its output was stored"):
        test_every_code_cell_was_run_from_its_current_source(stale)


def test_a_silent_cell_is_found(tmp_path):
    nb = json.loads(NOTEBOOKS[0].read_text())
    second = [c for c in nb["cells"] if c["cell_type"] == "code"][1]
    second["outputs"] = []
    silent = tmp_path / NOTEBOOKS[0].name
    silent.write_text(json.dumps(nb))
    with pytest.raises(AssertionError, match="code cells \\[2\\] store no output"):
        test_every_code_cell_but_the_setup_stores_an_output(silent)
