"""fp8 weights against bf16 weights, both in one run: throughput and one-stream ITL.

    python benchmarks/fp8.py                      # H200: the nano-vllm workload, Qwen3-0.6B and
                                                  # Llama-3.2-1B dummy weights (about 3-4 min)
    python benchmarks/fp8.py --tiny               # the CPU: stories260K, 8 small requests,
                                                  # float32 vs fp8 (proves the script, ~20 s)

For each model, one engine with the weights in `--dtype` (bf16) and one with
`quantization="fp8"` (models/quantization/fp8.py), built one after the other in this process,
each running

  throughput   nano-vllm's workload (`minipaged bench --workload nanovllm`: 256 requests, input
               and output lengths U[100, 1024], seed 0, EOS ignored, temperature 0.6), with the
               README's H200 settings: KV blocks of 128, 8192 batched tokens, CUDA graphs,
               async scheduling and fused kernels on (the engine's CUDA defaults)
  one stream   one request alone (a 512-token prompt, 256 output tokens, greedy): its mean
               inter-token latency, where a decode step reads every weight once, so fp8's
               halved linear-layer bytes show most

Both measurements warm their engine up first with their own requests' shapes, untimed
(`lessons.bench.run_minipaged`: the same prompt lengths and max_tokens, token ids reversed);
each row keeps what the warm-ups ran ("warmup") and its first timed step against its median step
("step_ms"). The table prints both sides and fp8 / bf16 ratios; the weight bytes a decode step
reads (the parameters' real bytes: fp8 weights are one byte plus a 4-byte scale per row;
embeddings, norms and the tied LM head stay bf16) and what the one-stream ITL makes of them in
GB/s. Dummy weights throughout (random, fixed seed): the speed is the real architecture's, the
text is noise. JSON: benchmarks/results/fp8_h200.json ($OUT/fp8_h200.json when $OUT is set;
--out).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from minipaged.lessons import bench  # noqa: E402

H200_MODELS = "dummy:qwen3-0.6b,dummy:llama-3.2-1b"


def weight_bytes(model) -> int:
    """Bytes of every parameter as stored (fp8 weights count one byte each)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def one_stream(llm, vocab: int, prompt_len: int, output_len: int) -> dict:
    """One request alone: its mean inter-token latency (decode steps of batch 1)."""
    prompt = [(7 * i + 3) % min(vocab, 10000) for i in range(prompt_len)]
    wl = bench.Workload("one-stream", [prompt], [output_len])
    r = bench.run_minipaged(llm, wl, temperature=0.0)
    return {"itl_ms": r.extra["itl_ms"]["p50"], "ttft_ms": r.extra["ttft_ms"]["p50"],
            "output_tokens": r.output_tokens, "warmup": r.extra["warmup"],
            "step_ms": r.extra["step_ms"]}


def run_side(model: str, quantization, args) -> dict:
    from minipaged import LLM
    t0 = time.perf_counter()
    llm = LLM(model, dtype=args.dtype, device=args.device, quantization=quantization,
              block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
              seed=0)
    build_s = time.perf_counter() - t0
    mc = llm.engine.model_config
    wl = bench.make_workload(args.workload, mc.vocab_size, args.num_requests, seed=0,
                             bos=None if args.workload == "nanovllm" else mc.bos_token_id,
                             max_model_len=llm.engine.config.max_model_len)
    thr = bench.run_minipaged(llm, wl, temperature=args.temperature)
    stream = one_stream(llm, mc.vocab_size, args.stream_prompt_len, args.stream_output_len)
    wbytes = weight_bytes(llm.engine.model)
    row = {"model": model, "weights": quantization or args.dtype, "build_s": round(build_s, 1),
           "num_requests": thr.num_requests, "output_tokens": thr.output_tokens,
           "elapsed_s": thr.elapsed_sec, "tokens_per_sec": thr.tokens_per_sec,
           "ttft_ms": thr.extra["ttft_ms"], "itl_ms": thr.extra["itl_ms"],
           "preemptions": thr.extra["preemptions"], "weight_bytes": wbytes,
           "warmup": thr.extra["warmup"], "step_ms": thr.extra["step_ms"], "one_stream": stream}
    if stream["itl_ms"]:
        row["one_stream"]["weights_gb_per_s"] = round(wbytes / (stream["itl_ms"] / 1e3) / 1e9, 1)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def format_table(rows: list[dict]) -> str:
    out = ["| model | weights | weight MB | output tok/s | elapsed s | "
           "ITL p50 ms (batch) | one-stream ITL ms | one-stream weights GB/s "
           "| tok/s vs unquantized | one-stream ITL vs unquantized |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {}
    for r in rows:
        ref = base.setdefault(r["model"], r)
        s = r["one_stream"]
        ratio_tput = ratio_itl = "-"
        if r is not ref:
            ratio_tput = f"{r['tokens_per_sec'] / ref['tokens_per_sec']:.2f}x"
            if s["itl_ms"] and ref["one_stream"]["itl_ms"]:
                ratio_itl = f"{s['itl_ms'] / ref['one_stream']['itl_ms']:.2f}x"
        mb = r["weight_bytes"] / 1e6
        mb = f"{mb:,.0f}" if mb >= 10 else f"{mb:.3f}"
        name = (r["model"].removeprefix("dummy:") + " (dummy weights)"
                if r["model"].startswith("dummy:") else r["model"])
        out.append(f"| {name} | {r['weights']} | {mb} | {r['tokens_per_sec']:,.0f} | "
                   f"{r['elapsed_s']:.2f} | {r['itl_ms']['p50']} | {s['itl_ms']} | "
                   f"{s.get('weights_gb_per_s', '-')} | {ratio_tput} | {ratio_itl} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=H200_MODELS, help="comma-separated")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="the unquantized side's dtype")
    ap.add_argument("--workload", default="nanovllm", choices=bench.WORKLOADS)
    ap.add_argument("--num-requests", type=int, default=None, help="default: the workload's")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--stream-prompt-len", type=int, default=512)
    ap.add_argument("--stream-output-len", type=int, default=256)
    ap.add_argument("--tiny", action="store_true",
                    help="CPU: stories260K, float32 vs fp8, 8 requests of the cpu workload")
    ap.add_argument("--out", default=None, help="JSON file (default: fp8_h200.json, or "
                                                "fp8_cpu_tiny.json with --tiny, in $OUT or "
                                                "benchmarks/results/)")
    args = ap.parse_args(argv)
    if args.tiny:
        torch.set_num_threads(1)
        args.models, args.device, args.dtype = "stories260K", "cpu", "float32"
        args.workload = "cpu"
        args.num_requests, args.temperature, args.block_size = args.num_requests or 8, 0.0, 16
        args.max_num_batched_tokens, args.stream_prompt_len, args.stream_output_len = 2048, 32, 64
    results = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out = Path(args.out or results / ("fp8_cpu_tiny.json" if args.tiny else "fp8_h200.json"))
    rows = []
    for model in args.models.split(","):
        for quantization in (None, "fp8"):  # both sides, one after the other, in this run
            rows.append(run_side(model, quantization, args))
            print(f"{model} {quantization or args.dtype}: "
                  f"{rows[-1]['tokens_per_sec']:,.0f} tok/s, "
                  f"one-stream ITL {rows[-1]['one_stream']['itl_ms']} ms; throughput after a "
                  f"{bench.Warmup(**rows[-1]['warmup'])}, one stream after a "
                  f"{bench.Warmup(**rows[-1]['one_stream']['warmup'])}", flush=True)
            report = {"environment": bench.environment(), "command": "python benchmarks/fp8.py "
                      + " ".join(argv if argv is not None else sys.argv[1:]),
                      "settings": {k: v for k, v in vars(args).items()}, "rows": rows}
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2))  # a run stopped later keeps these rows
    print(format_table(rows))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
