"""Draw figures/decode_breakdown_h200.png from benchmarks/results/decode_breakdown_h200.json.

    python benchmarks/plot_decode_breakdown.py

The picture is `minipaged.lessons.viz.plot_decode_breakdown` (lesson 08 draws the same): ms per decode
step stacked by kernel family and GPU idle time at each measured point of the run, and attention's
achieved read rate against a plain streaming read on the same GPU.
"""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from minipaged.lessons import viz  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    src = ROOT / "benchmarks" / "results" / "decode_breakdown_h200.json"
    dst = ROOT / "figures" / "decode_breakdown_h200.png"
    viz.plot_decode_breakdown(json.loads(src.read_text())).savefig(dst, dpi=110)
    print(f"wrote {dst}")
