"""The skinny GEMM (minipaged/models/triton_gemv.py) beside cuBLAS on decode's linear layers.

    python benchmarks/experiments/decode_step/skinny_gemm.py \
        [--models qwen3-0.6b,qwen3-8b] [--rows 1,2] [--no-sweep] \
        [--out benchmarks/experiments/decode_step/skinny_gemm_h200.json]
    python benchmarks/experiments/decode_step/skinny_gemm.py --dry-run   # CPU interpreter: plumbing

For each preset's four decoder linear layers (qkv_proj, o_proj, gate_up_proj, down_proj; shapes
from the preset via `decoder_linear_shapes`) and each M in `--rows`, bf16 x (M, K) ~ N(0, 1) and
W (N, K) ~ N(0, 1/K), no bias, it times

* `cublas`: F.linear(x, W), what the fused layers ran before;
* `skinny`: skinny_linear(x, W) with `skinny_config`'s launch, what FusedLinear runs;
* `sweep`: the same kernel with a few other launches around it (half and twice the tile, twice
  and half the programs, half the warps), at M = 1 and M = 2 (`--no-sweep` leaves them out).

Each variant is one CUDA graph of `--calls` (200) back-to-back calls, as a decode graph runs its
layers (no launch overhead between them), replayed `--replays` (5) times after a warm-up replay;
microseconds per call = the median replay / calls. The calls cycle through enough copies of W to
fill four times the L2 cache, so each call reads its weight from HBM as a decode step does (28
layers' weights pass through the L2 between two calls of one layer), not from the L2. GB/s =
N x K x 2 bytes of weight read per call / time (x and out are under 0.1% of it).

Correctness, per shape and M: the kernel's output and F.linear's (both fp32 sums rounded to
bf16, each within half a bf16 unit of the exact value plus fp32 noise) agree within
|a - b| <= 1e-3 + 2^-7 |b| (one bf16 unit in the last place); `agrees` records it and the run
fails loudly at the end if any shape does not.

The run compiles the kernel once per launch it times (BLOCK_M in 1, 2, 4 times each config); on a
fresh machine that is most of its time (Triton caches them on disk for the next run). The JSON
holds every timing, the environment and, per model and M, the four layers summed beside
cuBLAS's and that sum x the model's layer count: an estimate of the matrix-multiply time per
decode step (the LM head stays on cuBLAS and is not in it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from minipaged.benchmark.throughput import environment  # noqa: E402
from minipaged.models.config import ModelConfig  # noqa: E402
from minipaged.models.source import resolve_model  # noqa: E402
from minipaged.models.triton_gemv import (MIN_BLOCK_K, SkinnyConfig,  # noqa: E402
                                          decoder_linear_shapes, skinny_config, skinny_linear)

DEFAULT_OUT = "benchmarks/experiments/decode_step/skinny_gemm_h200.json"
RTOL, ATOL = 2 ** -7, 1e-3  # kernel vs F.linear: one bf16 unit in the last place
SWEEP_ROWS = (1, 2)  # M with the config sweep


def sweep_configs(default: SkinnyConfig, k: int) -> list[SkinnyConfig]:
    """A few launches around the chosen one: half and twice the tile, twice the programs (half
    BLOCK_N, twice BLOCK_K) or half (twice BLOCK_N), half the warps; those equal to it or to
    each other dropped."""
    bn, bk, w = default.block_n, default.block_k, default.num_warps
    k_max = max(MIN_BLOCK_K, triton.next_power_of_2(k))
    candidates = [SkinnyConfig(bn, max(64, bk // 2), max(1, w // 2)),
                  SkinnyConfig(bn, min(k_max, 2 * bk), min(8, 2 * w)),
                  SkinnyConfig(max(1, bn // 2), min(k_max, 2 * bk), w),
                  SkinnyConfig(2 * bn, max(64, bk // 2), w),
                  SkinnyConfig(bn, bk, max(1, w // 2))]
    return [c for c in dict.fromkeys(candidates) if c != default]


def time_calls(fn, calls: int, replays: int, cuda: bool) -> float:
    """Microseconds per call of `fn(i)`, i = 0..calls-1: median over `replays` of one CUDA graph
    of all the calls (on the CPU, plain wall time: plumbing only)."""
    if not cuda:
        times = []
        for _ in range(replays):
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            times.append((time.perf_counter() - t0) / calls * 1e6)
        return statistics.median(times)
    side = torch.cuda.Stream()  # warm-up off the default stream (compiles, cuBLAS workspace)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)  # ms per replay -> us per call
    del graph
    return statistics.median(times)


def measure_shape(n: int, k: int, rows: list[int], args, device, l2_bytes: int) -> list[dict]:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter: fp32 (plumbing only)
    weight_bytes = n * k * torch.tensor([], dtype=dtype).element_size()
    copies = max(1, -(-4 * l2_bytes // weight_bytes)) if cuda else 1
    g = torch.Generator(device=device).manual_seed(n * 31 + k)
    weight = (torch.randn(n, k, generator=g, device=device) / k ** 0.5).to(dtype)
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]  # same values, other bytes
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=g, device=device).to(dtype)
        chosen = skinny_config(n, k, torch.cuda.get_device_properties(device).multi_processor_count
                               if cuda else 1)
        configs = [chosen] + (sweep_configs(chosen, k) if args.sweep and m in SWEEP_ROWS else [])

        def rate(us: float) -> dict:
            return {"us": round(us, 3), "gb_per_s": round(weight_bytes / us / 1e3, 1)}

        cublas = rate(time_calls(lambda i: F.linear(x, weights[i % copies]), args.calls,
                                 args.replays, cuda))
        timed = []
        for c in configs:
            us = time_calls(lambda i, c=c: skinny_linear(x, weights[i % copies], config=c),
                            args.calls, args.replays, cuda)
            timed.append({"config": vars(c)} | rate(us))
        want = F.linear(x, weights[0])
        got = skinny_linear(x, weights[0])
        diff = (got.float() - want.float()).abs()
        agrees = bool((diff <= ATOL + RTOL * want.float().abs()).all())
        best = min(timed, key=lambda t: t["us"])
        out.append({"n": n, "k": k, "m": m, "weight_bytes": weight_bytes, "weight_copies": copies,
                    "cublas": cublas, "skinny": timed[0],
                    "skinny_over_cublas": round(timed[0]["us"] / cublas["us"], 3),
                    "sweep": timed[1:], "best": best,
                    "max_abs_diff_vs_cublas": float(diff.max()), "agrees": agrees})
    del weight, weights
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b", help="dummy presets, comma-separated")
    ap.add_argument("--rows", default="1,2", help="M values (1 to SKINNY_MAX_ROWS)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--dry-run", action="store_true",
                    help="the CPU interpreter, the small draft preset, 2 calls: plumbing only")
    ap.add_argument("--out", default=None, help=f"JSON file (default {DEFAULT_OUT}; none on a dry run)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.models, args.rows, args.calls, args.replays = "qwen3-0.6b-draft", "1,4", 2, 1
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU (--dry-run checks the plumbing on the CPU)")
        device = torch.device("cuda")
        args.out = args.out or DEFAULT_OUT
    rows = [int(r) for r in args.rows.split(",")]
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2 ** 20) if props else 0
    t_start = time.perf_counter()
    results, summary = [], {}
    print(f"{'model':18s} {'layer':13s} {'N x K':>13s} {'M':>2s} {'cuBLAS us':>9s} {'GB/s':>6s} "
          f"{'skinny us':>9s} {'GB/s':>6s} {'ratio':>6s} {'best us':>8s}  best config")
    for preset in args.models.split(","):
        cfg = ModelConfig.from_dict(resolve_model(f"dummy:{preset}").config)
        for layer, (n, k) in decoder_linear_shapes(cfg).items():
            for r in measure_shape(n, k, rows, args, device, l2_bytes):
                r |= {"model": preset, "layer": layer}
                results.append(r)
                b = r["best"]["config"]
                print(f"{preset:18s} {layer:13s} {f'{n} x {k}':>13s} {r['m']:2d} "
                      f"{r['cublas']['us']:9.2f} {r['cublas']['gb_per_s']:6.0f} "
                      f"{r['skinny']['us']:9.2f} {r['skinny']['gb_per_s']:6.0f} "
                      f"{r['skinny_over_cublas']:6.2f} {r['best']['us']:8.2f}  "
                      f"{b['block_n']}x{b['block_k']}/{b['num_warps']}w"
                      + ("" if r["agrees"] else "  DISAGREES"), flush=True)
        for m in rows:
            mine = [r for r in results if r["model"] == preset and r["m"] == m]
            cublas, skinny = (sum(r[key]["us"] for r in mine) for key in ("cublas", "skinny"))
            summary[f"{preset} M={m}"] = {
                "decoder_layer_us": {"cublas": round(cublas, 2), "skinny": round(skinny, 2)},
                "per_step_ms_estimate": {"cublas": round(cublas * cfg.num_hidden_layers / 1e3, 3),
                                         "skinny": round(skinny * cfg.num_hidden_layers / 1e3, 3)},
                "num_hidden_layers": cfg.num_hidden_layers}
    seconds = time.perf_counter() - t_start
    for key, s in summary.items():
        print(f"{key}: one decoder layer's four GEMMs {s['decoder_layer_us']['cublas']:.1f} us "
              f"(cuBLAS) -> {s['decoder_layer_us']['skinny']:.1f} us (skinny); x "
              f"{s['num_hidden_layers']} layers {s['per_step_ms_estimate']['cublas']:.3f} -> "
              f"{s['per_step_ms_estimate']['skinny']:.3f} ms per step")
    print(f"{len(results)} (layer, M) pairs in {seconds:.1f} s")
    report = {"benchmark": "skinny_gemm",
              "command": "python benchmarks/experiments/decode_step/skinny_gemm.py "
                         + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(), "device": str(device),
              "num_sms": props.multi_processor_count if props else 1, "l2_bytes": l2_bytes,
              "dtype": "bfloat16" if props else "float32", "calls_per_graph": args.calls,
              "replays": args.replays, "tolerance": {"rtol": RTOL, "atol": ATOL},
              "seconds": round(seconds, 1), "summary": summary, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    bad = [f"{r['model']} {r['layer']} M={r['m']}" for r in results if not r["agrees"]]
    if bad:
        sys.exit(f"skinny_linear disagrees with F.linear beyond rtol {RTOL}, atol {ATOL}: {bad}")


if __name__ == "__main__":
    main()
