"""benchmarks/ab_script.py: each side's package comes first on the path, sides alternate, and
the summary pairs each round's B / A."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_each_side_runs_its_own_package_and_rounds_are_paired(tmp_path):
    for side, speed in (("old", 100.0), ("new", 125.0)):
        (tmp_path / side / "minipaged").mkdir(parents=True)
        (tmp_path / side / "minipaged" / "__init__.py").write_text(f"SPEED = {speed}\n")
    script = tmp_path / "bench.py"
    script.write_text(
        "import argparse, json, minipaged\n"
        "ap = argparse.ArgumentParser(); ap.add_argument('--json'); a = ap.parse_args()\n"
        "json.dump({'results': [{'tok_s': minipaged.SPEED}]}, open(a.json, 'w'))\n")
    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_script.py"),
                    "--a", str(tmp_path / "old"), "--b", str(tmp_path / "new"), "--rounds", "3",
                    "--metric", "results/0/tok_s", "--out-flag=--json", "--out", str(out), "--",
                    str(script)],
                   check=True, timeout=120)
    m = json.loads(out.read_text())["metrics"]["results/0/tok_s"]
    assert m["a"] == [100.0] * 3 and m["b"] == [125.0] * 3
    assert m["b_over_a_per_round"] == [1.25] * 3 and m["b_over_a_paired_median"] == 1.25
