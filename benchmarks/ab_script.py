"""A/B of two checkouts' packages under any benchmark script that writes JSON, in one run.

    python benchmarks/ab_script.py --a OLD_DIR --b . --rounds 3 --out FILE.json \
        --metric 'results/all constrained/tokens_per_sec' [--label-a a316e22 --label-b HEAD] \
        -- benchmarks/structured_outputs.py --model dummy:qwen3-0.6b --device cuda \
           --dtype bfloat16 --synthetic-vocab --runs 3

Each side is a folder holding a `minipaged` package (this checkout, or another revision's
`git archive REV minipaged | tar -x -C DIR`). The script after `--` is this checkout's and runs
unchanged on both sides; only the package it imports differs (the side's folder comes first on
PYTHONPATH). Every run is a fresh process given `--out` with a file of its own; `--metric` is a
path of keys into that JSON, `/`-separated (higher is better, e.g. tokens/s). Sides alternate A, B,
B, A, A, B, ... like `ab_engine.py`, and the summary is the median over rounds of each round's
B / A ratio, beside each side's median. Repeat `--metric` to report several. A script that names
its JSON file otherwise takes `--out-flag`; the package's own CLI runs as a module:

    python benchmarks/ab_script.py --a OLD_DIR --b NEW_DIR --out-flag=--json \
        --metric results/0/tokens_per_sec -- -m minipaged.cli bench --workload sharegpt \
        --model dummy:qwen3-0.6b --dtype bfloat16 --backends minipaged
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def lookup(data, path: str) -> float:
    """`path`'s value: keys of dicts and indices of lists, '/'-separated ("results/0/tok_s")."""
    for key in path.split("/"):
        data = data[int(key)] if isinstance(data, list) else data[key]
    return float(data)


def run_rounds(rounds: int, command, show) -> dict[str, list[dict]]:
    """Each side once per round, each run a fresh process, in the order A, B, then B, A, ...:
    `command(side, json_path)` gives the run's (argv, env or None) and the run writes its JSON
    to `json_path`; `show(side, result)` is printed after each run. Returns each side's JSONs."""
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for side in (("a", "b") if r % 2 == 0 else ("b", "a")):
                path = os.path.join(tmp, f"{side}{r}.json")
                argv, env = command(side, path)
                subprocess.run(argv, env=env, check=True)
                runs[side].append(json.load(open(path)))
                print(f"round {r} {show(side, runs[side][-1])}", flush=True)
    return runs


def paired(a_values: list[float], b_values: list[float]) -> dict:
    """Each round's B / A and their median: the machine's drift falls on both sides of a round."""
    ratios = [b / a for a, b in zip(a_values, b_values)]
    return {"b_over_a_per_round": [round(x, 4) for x in ratios],
            "b_over_a_paired_median": round(statistics.median(ratios), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True), ap.add_argument("--b", required=True)
    ap.add_argument("--label-a", default="A"), ap.add_argument("--label-b", default="B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--metric", action="append", required=True,
                    help="a '/'-separated key path into the script's JSON; repeatable")
    ap.add_argument("--out", default=None)
    ap.add_argument("--out-flag", default="--out",
                    help="the script's flag for its JSON file "
                         "(`minipaged bench`: --out-flag=--json)")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]")
    a = ap.parse_args()
    script = a.script[1:] if a.script[:1] == ["--"] else a.script
    if not script:
        ap.error("give the benchmark script after --")

    def command(side: str, path: str):
        env = dict(os.environ)  # the side's package first on the path
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(getattr(a, side))] + paths)
        return [sys.executable] + script + [a.out_flag, path], env

    def show(side: str, result: dict) -> str:
        return f"{getattr(a, 'label_' + side)}: " + ", ".join(
            f"{m} {lookup(result, m):,.1f}" for m in a.metric)

    runs = run_rounds(a.rounds, command, show)
    metrics = {}
    for m in a.metric:
        values = {s: [lookup(x, m) for x in runs[s]] for s in "ab"}
        metrics[m] = {"a": values["a"], "b": values["b"],
                      "a_median": statistics.median(values["a"]),
                      "b_median": statistics.median(values["b"])} | paired(values["a"], values["b"])
        print(f"{m}: {a.label_a} median {metrics[m]['a_median']:,.1f}, {a.label_b} median "
              f"{metrics[m]['b_median']:,.1f}; B/A paired median "
              f"{metrics[m]['b_over_a_paired_median']:.4f} "
              f"(per round {metrics[m]['b_over_a_per_round']})")
    summary = {"benchmark": "ab_script",
               "command": "python benchmarks/ab_script.py --a A --b B "
                          f"--rounds {a.rounds} -- " + " ".join(script),
               "order": "A, B, then B, A, ... (alternating by round)",
               "a": {"label": a.label_a}, "b": {"label": a.label_b},
               "metrics": metrics, "runs": runs}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
