#!/usr/bin/env bash
# A/B of two checkouts on one GPU, in one run: the nano-vllm workload on dummy Qwen3-0.6B (bf16,
# the settings of nanovllm_h200.sh), alternating A, B, A, B, ... so that drift of the machine
# falls on both sides alike. Writes each run's JSON and a summary with the medians and B/A.
#
#   bash benchmarks/experiments/engine_ab/ab_h200.sh A_DIR B_DIR OUT_JSON [ROUNDS]
#
# A_DIR and B_DIR are checkouts (each run imports the minipaged package found there).
set -euo pipefail
a=$(cd "$1" && pwd); b=$(cd "$2" && pwd); out=$3; rounds=${4:-2}
tmp=$(mktemp -d)
for r in $(seq 1 "$rounds"); do
  for side in a b; do
    dir=$a; [ "$side" = b ] && dir=$b
    (cd "$dir" && python -m minipaged.cli bench --workload nanovllm --model dummy:qwen3-0.6b \
        --dtype bfloat16 --temperature 0.6 --max-num-batched-tokens 8192 --block-size 128 \
        --backends minipaged --json "$tmp/$side$r.json") | tail -3
  done
done
python - "$tmp" "$out" "$a" "$b" "$rounds" <<'PY'
import json, statistics, sys
tmp, out, a, b, rounds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
runs = {s: [json.load(open(f"{tmp}/{s}{r}.json")) for r in range(1, rounds + 1)] for s in "ab"}
for r in runs["a"] + runs["b"]:
    r["command"] = r["command"].split(" --json ")[0]  # the temporary file is gone
tps = {s: [x["results"][0]["tokens_per_sec"] for x in runs[s]] for s in "ab"}
med = {s: statistics.median(v) for s, v in tps.items()}
summary = {"workload": "nanovllm, dummy:qwen3-0.6b, bf16, block_size 128, temperature 0.6",
           "order": "A, B alternating", "environment": runs["a"][0]["environment"],
           "a": {"checkout": a, "tokens_per_sec": tps["a"], "median": med["a"]},
           "b": {"checkout": b, "tokens_per_sec": tps["b"], "median": med["b"]},
           "b_over_a": med["b"] / med["a"], "runs": runs}
json.dump(summary, open(out, "w"), indent=1)
print(f"A {tps['a']} median {med['a']:,.0f} tok/s; B {tps['b']} median {med['b']:,.0f} tok/s; "
      f"B/A = {med['b'] / med['a']:.4f}")
PY
