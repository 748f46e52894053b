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


def test_host_ab_keeps_each_sides_modules_apart(tmp_path):
    """benchmarks/experiments/decode_step/host_ab.py runs two revisions in one process: each
    side's modules, including those it imports inside functions after start-up, stay its own."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "experiments" / "decode_step"))
    try:
        import host_ab
    finally:
        sys.path.pop(0)
    for side in ("old", "new"):
        pkg = tmp_path / side / "minipaged"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(
            "def which():\n    from minipaged.late import SIDE\n    return SIDE\n")
        (pkg / "llm.py").write_text("")
        (pkg / "late.py").write_text(f"SIDE = {side!r}\n")
    saved = {n: m for n, m in sys.modules.items() if n == "minipaged" or n.startswith("minipaged.")}
    try:
        sides = host_ab.Sides()
        old = sides.load("old", str(tmp_path / "old"))
        new = sides.load("new", str(tmp_path / "new"))
        first = {}  # a module imported late is kept, not imported again (its kernels, caches)
        for name, package in (("old", old), ("new", new), ("old", old), ("new", new)):
            sides.activate(name)
            assert package.which() == name
            late = first.setdefault(name, sys.modules["minipaged.late"])
            assert sys.modules["minipaged.late"] is late and late.SIDE == name
    finally:
        for n in [n for n in sys.modules if n == "minipaged" or n.startswith("minipaged.")]:
            del sys.modules[n]
        sys.modules.update(saved)
