"""Draw figures/serve_vs_offline_h200.png from the H200 serve_load results.

    python benchmarks/plot_serve_load.py

Each JSON is one `benchmarks/serve_load.py --offline` invocation (the offline engine and the
server measured in the same run, dummy Qwen3-0.6B, nano-vllm workload, concurrency 256, block
size 128). The picture is `minipaged.lessons.viz.plot_serve_vs_offline` (lesson 07 draws it too).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minipaged.lessons import viz  # noqa: E402

RUNS = [("one process\n(engine thread)", "serve_load_h200_qwen3-0.6b_one_process.json"),
        ("two processes,\nRequestOutput per step", "serve_load_h200_qwen3-0.6b_two_process_first.json"),
        ("two processes\n(final)", "serve_load_h200_qwen3-0.6b.json"),
        ("two processes (final),\n3 repeats", "serve_load_h200_qwen3-0.6b_repeats.json")]
TITLE = ("minipaged serve at 256 concurrent streams vs the offline engine, same run "
         "(H200, dummy Qwen3-0.6B, nano-vllm workload)")


def load_runs(results: Path) -> list:
    return [(label, json.loads((results / name).read_text())) for label, name in RUNS]


def main() -> None:
    rows = viz.serve_vs_offline_rows(load_runs(ROOT / "benchmarks" / "results"))
    dst = ROOT / "figures" / "serve_vs_offline_h200.png"
    viz.plot_serve_vs_offline(rows, TITLE).savefig(dst, dpi=110, bbox_inches="tight")
    print(dst)


if __name__ == "__main__":
    main()
