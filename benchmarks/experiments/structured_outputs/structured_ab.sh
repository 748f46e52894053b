#!/usr/bin/env bash
# A/B of two checkouts on the structured-outputs benchmark, in one run: this checkout's
# benchmarks/structured_outputs.py runs against each checkout's minipaged package in turn
# (A, B, A, B, ...), so that drift of the machine falls on both sides alike. Writes each run's
# JSON and a summary: per way, the median tokens/s ratio to the unconstrained run and, with
# --breakdown, the median main-thread ms per step of each part; and the median over all rounds
# of each round's ratio to its own unconstrained run (paired: drift between rounds moves both
# sides; the unconstrained run is each round's first, so drift within a round does not cancel).
#
#   bash benchmarks/experiments/structured_outputs/structured_ab.sh A_DIR B_DIR OUT_JSON ROUNDS \
#       [benchmark arguments...]
#
# On the H200:  bash benchmarks/experiments/structured_outputs/structured_ab.sh OLD . OUT.json 2 \
#                   --model dummy:qwen3-0.6b \
#                   --device cuda --dtype bfloat16 --synthetic-vocab --runs 3 --breakdown
# On the CPU:   bash benchmarks/experiments/structured_outputs/structured_ab.sh OLD . OUT.json 2 \
#                   --tiny-model \
#                   --async-scheduling --breakdown --runs 3
# OLD is another checkout, e.g. `mkdir OLD && git archive REV minipaged | tar -x -C OLD`.
# PYTHON (default `python`) is the interpreter, e.g. PYTHON=.venv/bin/python.
set -euo pipefail
a=$(cd "$1" && pwd); b=$(cd "$2" && pwd); out=$3; rounds=$4; shift 4
bench=$(cd "$(dirname "$0")/../.." && pwd)  # benchmarks/
tmp=$(mktemp -d)
for side in a b; do  # the script, beside a link to that side's package (its ROOT is the folder)
  dir=$a; [ "$side" = b ] && dir=$b
  mkdir -p "$tmp/$side/benchmarks/lib"
  cp "$bench/structured_outputs.py" "$tmp/$side/benchmarks/"
  cp "$bench/lib/synthetic_tokenizer.py" "$tmp/$side/benchmarks/lib/"
  ln -s "$dir/minipaged" "$tmp/$side/minipaged"
done
for r in $(seq 1 "$rounds"); do
  for side in a b; do
    "${PYTHON:-python}" "$tmp/$side/benchmarks/structured_outputs.py" "$@" --out "$tmp/$side$r.json" \
      | tail -4
  done
done
"${PYTHON:-python}" - "$tmp" "$out" "$a" "$b" "$rounds" "$*" <<'PY'
import json, os, statistics, sys
tmp, out, a, b, rounds, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
runs = {s: [json.load(open(f"{tmp}/{s}{r}.json")) for r in range(1, rounds + 1)] for s in "ab"}
for r in runs["a"] + runs["b"]:
    r["command"] = r["command"].split(" --out ")[0]  # the temporary file is gone
ways = [w for w in runs["a"][0]["results"] if w != "none"]


def medians(side):
    got = {}
    for w in ways:
        rs = [x["results"][w] for x in runs[side]]
        got[w] = {"ratio_to_none": statistics.median(r["ratio_to_none"] for r in rs)}
        if "ratio_to_none_per_round" in rs[0]:  # every round of every invocation, paired
            got[w]["ratio_to_none_paired_median"] = statistics.median(
                x for r in rs for x in r["ratio_to_none_per_round"])
        if "host_ms_per_step" in rs[0]:
            got[w]["host_ms_per_step"] = {k: statistics.median(r["host_ms_per_step"][k] for r in rs)
                                          for k in rs[0]["host_ms_per_step"]}
    return got


med = {s: medians(s) for s in "ab"}
summary = {"benchmark": "structured_ab",
           "command": ("bash benchmarks/experiments/structured_outputs/structured_ab.sh "
                       f"A B OUT {rounds} {args}"),
           "order": "A, B alternating", "environment": runs["a"][0]["environment"],
           "a": {"checkout": os.path.basename(a), **med["a"]},
           "b": {"checkout": os.path.basename(b), **med["b"]}, "runs": runs}
json.dump(summary, open(out, "w"), indent=1)
for w in ways:
    ra, rb = med["a"][w]["ratio_to_none"], med["b"][w]["ratio_to_none"]
    line = f"{w}: ratio to none A {ra:.3f}, B {rb:.3f}"
    if "ratio_to_none_paired_median" in med["a"][w]:
        pa, pb = (med[s][w]["ratio_to_none_paired_median"] for s in "ab")
        line += f"; paired rounds A {pa:.3f}, B {pb:.3f}"
    if "host_ms_per_step" in med["a"][w]:
        sa, sb = med["a"][w]["host_ms_per_step"]["start"], med["b"][w]["host_ms_per_step"]["start"]
        line += f"; start ms/step A {sa:.3f}, B {sb:.3f}"
    print(line)
PY
rm -rf "$tmp"
