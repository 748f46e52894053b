#!/usr/bin/env bash
# Serving under load on the H200: request-rate sweeps of `minipaged bench serve` against
# `minipaged serve` with dummy Qwen3-0.6B weights (bf16), for the nano-vllm workload (prompts and
# outputs U[100, 1024]) and ShareGPT-like lengths (exponential, means 161 in / 338 out).
#
#   bash benchmarks/serve_rate_h200.sh          # about 7 minutes; progress on stdout
#   MODEL=stories260K SERVER_ARGS="--device cpu" SWEEPS="sharegpt:20:2,8" OUT=/tmp/x \
#       bash benchmarks/serve_rate_h200.sh      # the same steps, small, on a CPU
#
# The server runs in the background on $PORT (default 8123) with the flags of the README's GPU
# runs (block 128, an 8192-token step budget) and max_model_len 4096 ($SERVER_ARGS); its log goes
# to a temporary file and is printed if it fails. Each sweep ($SWEEPS) warms the server up with
# 32 requests (untimed), then sends Poisson arrivals at each rate from 8 client processes; it writes one JSON per workload
# to benchmarks/results/ (or $OUT): serve_rate_h200_nanovllm.json, serve_rate_h200_sharegpt.json,
# each with its figure beside it (.png: normalized latency, TTFT, TPOT against the rate) and its
# knee (where the mean normalized latency crosses 4x its value at the lowest rate). The rates
# bracket what the offline engine sustains on this workload (about 20,000 tok/s: 35 req/s of
# nano-vllm's 562 mean output tokens, 60 of ShareGPT's 338).
set -euo pipefail
out=${OUT:-benchmarks/results}
port=${PORT:-8123}
model=${MODEL:-dummy:qwen3-0.6b}
py=${PYTHON:-python3}  # the interpreter with minipaged[serve] installed
server_args=${SERVER_ARGS:---dtype bfloat16 --block-size 128 --max-num-batched-tokens 8192 --max-model-len 4096}
sweeps=${SWEEPS:-nanovllm:600:10,20,30,40,50 sharegpt:400:15,30,45,60,90}  # workload:prompts:rates
mkdir -p "$out"
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
server_log=$(mktemp)

log "starting minipaged serve $model on port $port ($server_args)"
# shellcheck disable=SC2086
"$py" -m minipaged.cli serve "$model" --port "$port" $server_args --uvicorn-log-level warning \
    --disable-log-requests > "$server_log" 2>&1 &
server=$!
stop() { kill -INT "$server" 2>/dev/null && wait "$server" 2>/dev/null || true; }
trap stop EXIT
"$py" - "$port" "$server" "$server_log" <<'PY'
import os, sys, time, urllib.request
port, pid, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for _ in range(300):
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the server exited:\n" + open(log).read()[-3000:])
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(2)
sys.exit("the server did not become healthy in 10 minutes:\n" + open(log).read()[-3000:])
PY
log "server ready"

for spec in $sweeps; do
  IFS=: read -r workload prompts rates <<< "$spec"
  log "$workload: $prompts requests at each of $rates req/s"
  "$py" -m minipaged.cli bench serve --base-url "http://127.0.0.1:$port" --model "$model" \
      --workload "$workload" --num-prompts "$prompts" --request-rate "$rates" --num-warmups 32 \
      --goodput ttft:500 tpot:50 --json "$out/serve_rate_h200_$workload.json"
  log "$workload sweep done: $out/serve_rate_h200_$workload.json and .png"
done
