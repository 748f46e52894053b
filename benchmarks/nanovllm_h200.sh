#!/usr/bin/env bash
# The H200 runs behind the README's GPU table: the nano-vllm workload on dummy-weight presets.
#
#   bash benchmarks/nanovllm_h200.sh minipaged   # the three model shapes, bf16 KV, and Qwen3 with fp8 KV
#   bash benchmarks/nanovllm_h200.sh hf          # Qwen3-0.6B: minipaged beside the HF baselines, one run
#
# JSON goes to benchmarks/results/ (or $OUT when set); each run prints its table.
# KV blocks of 128 tokens (nano-vllm uses 256): the decode kernel reads them 3-4% faster than
# blocks of 16 (benchmarks/experiments/attention_tiles/attention_workload.py --block-size), and
# the host builds 8x shorter block tables per step. The engine's default stays 16 (the lessons draw individual blocks).
set -euo pipefail
out=${OUT:-benchmarks/results}
bench() { python -m minipaged.cli bench --workload nanovllm --dtype bfloat16 --temperature 0.6 \
            --max-num-batched-tokens 8192 --block-size 128 "$@"; }
case "${1:-minipaged}" in
  minipaged)
    bench --model dummy:qwen2.5-0.5b --backends minipaged --json "$out/nanovllm_h200_qwen2.5-0.5b.json"
    bench --model dummy:llama-3.2-1b --backends minipaged --json "$out/nanovllm_h200_llama-3.2-1b.json"
    bench --model dummy:qwen3-0.6b --backends minipaged --kv-cache-dtype fp8 \
          --json "$out/nanovllm_h200_qwen3-0.6b_fp8kv.json"
    ;;
  hf)
    bench --model dummy:qwen3-0.6b --backends minipaged,hf-static,hf-cb,hf-sequential \
          --hf-batch-size 32 --hf-max-requests 32 --hf-sequential-max-requests 1 \
          --json "$out/nanovllm_h200_qwen3-0.6b.json"
    ;;
esac
