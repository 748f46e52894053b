"""Execute the lessons in place and store their outputs (`make lessons`), so they read without a
kernel: on GitHub, in JupyterLab before running anything, and in the course book (mkdocs.yml
renders the stored outputs).

    python tools/execute_lessons.py                    # every notebook in notebooks/
    python tools/execute_lessons.py notebooks/04_sampling.ipynb

Each run is reproducible as far as a CPU allows: one torch thread (OMP_NUM_THREADS=1), seed 0 for
`random`, NumPy and torch before the first cell (a hidden cell, removed afterwards), no timing
metadata. Every executed code cell records `metadata.minipaged.source_sha256`, the hash of its
source; tests/test_lessons_outputs.py fails when a cell's source no longer matches the output
stored with it. Outputs are kept small: PNGs are re-encoded with a 256-colour palette when that
is smaller, and ipywidgets' state and views are dropped (their static fallback stays).
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED_CELL = ("import random as _r, numpy as _np, torch as _t\n"
             "_r.seed(0); _np.random.seed(0); _t.manual_seed(0)\n"
             "del _r, _np, _t")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
FRAME = re.compile(r"data:image/png;base64,([A-Za-z0-9+/=\\\n]+)")


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]


def smaller_png(data: str) -> str:
    from PIL import Image
    raw = base64.b64decode(data)
    img = Image.open(io.BytesIO(raw))
    img = img.convert("RGBA") if img.mode in ("RGBA", "LA", "P") else img.convert("RGB")
    out = io.BytesIO()
    img.quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(out, "PNG", optimize=True)
    return base64.b64encode(out.getvalue()).decode() if out.tell() < len(raw) else data


def tidy(nb: dict) -> None:
    nb["metadata"].pop("widgets", None)
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        cell["metadata"].pop("execution", None)
        for out in cell.get("outputs", []):
            data = out.get("data")
            if not data:
                continue
            data.pop(WIDGET_MIME, None)
            if "image/png" in data:
                png = data["image/png"]
                png = "".join(png) if isinstance(png, list) else png
                data["image/png"] = smaller_png(png.replace("\n", ""))
            if "text/html" in data:  # an animation's frames: data URIs inside its player
                html = data["text/html"]
                html = "".join(html) if isinstance(html, list) else html
                data["text/html"] = FRAME.sub(
                    lambda m: "data:image/png;base64," + smaller_png(
                        m.group(1).replace("\\\n", "").replace("\n", "")), html)


def execute(path: Path, timeout: int = 600) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(SEED_CELL))
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    nb.cells.pop(0)
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = i + 1
        for out in cell.outputs:
            if "execution_count" in out:
                out["execution_count"] = i + 1
        cell.metadata["minipaged"] = {"source_sha256": source_hash(cell.source)}
    data = json.loads(nbformat.writes(nb))
    tidy(data)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def retidy(path: Path) -> None:
    """Shrink a stored notebook's outputs again without executing it (hashes untouched)."""
    data = json.loads(path.read_text())
    tidy(data)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def main(argv: list[str]) -> int:
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0",
                      TQDM_DISABLE="1")
    paths = [Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    total = 0
    for path in paths:
        t0 = time.time()
        execute(path.resolve())
        size = path.stat().st_size
        total += size
        print(f"{path.name}: {time.time() - t0:.0f} s, {size / 1024:.0f} KiB", flush=True)
    print(f"total: {total / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
