"""Where a decode step's time goes over the nano-vllm run, with CUDA graphs on (the served path).

    # Qwen3-0.6B dummy weights, H200
    python benchmarks/experiments/decode_step/decode_breakdown.py
    # the engine's default blocks
    python benchmarks/experiments/decode_step/decode_breakdown.py --block-size 16

Runs the workload the way `minipaged bench --workload nanovllm` does (256 requests, blocks of 128
tokens, 8,192 batched tokens), and at a few points of the decode phase (the batch shrinks from
256 sequences to a handful as requests finish):

* wall time per step: 10 steps timed without a profiler;
* GPU time per kernel family over 10 more steps (torch.profiler sees the kernels inside the graph
  replays): attention, the cuBLAS matrix multiplies, the element-wise kernels, the sampler;
* busy = the union of the kernels' intervals; idle = wall - busy: launch gaps between the ~270
  kernels of a step and any wait for the host;
* attention's achieved read rate (K + V of every context, all layers) next to what a plain
  streaming read reaches on the same GPU (a Triton kernel summing a 2 GiB tensor, and torch.sum):
  the ceiling a memory-bound kernel can approach.

JSON to decode_breakdown_h200.json beside this script (or OUT_JSON); the plot is
`python benchmarks/plot.py decode_breakdown`. Lesson 08 reads both.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

from minipaged import LLM, SamplingParams
from minipaged.lessons.bench import make_workload

ROOT = Path(__file__).resolve().parents[3]


def family(name: str) -> str:
    """Kernel name -> the part of the step it belongs to."""
    n = name.lower()
    if "paged_attention" in n or "reduce_splits" in n:
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "sm90", "cutlass", "xmma", "splitkreduce")):
        return "matmul"
    if "chunk_stats" in n or "pick_kernel" in n:
        return "sampler"
    if any(s in n for s in ("rms_norm", "qkv_rope", "silu_and_mul")):
        return "norm/rope/silu"
    return "other"  # input copies, gathers of the sampled rows


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: time the GPU ran at least one kernel."""
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_per_prog, BLOCK: tl.constexpr):
    """Each program sums its contiguous share of x: a pure streaming read."""
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, n_per_prog, BLOCK):
        acc += tl.load(x_ptr + pid * n_per_prog + i + offs).to(tl.float32)
    tl.store(out_ptr + pid * BLOCK + offs, acc)


def read_ceiling(device) -> dict:
    """TB/s of a plain read of 2 GiB: the best of a few Triton grid shapes, and torch.sum."""
    x = torch.randn(2 ** 30, device=device, dtype=torch.bfloat16)  # 2 GiB
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def rate(fn, nbytes):
        return nbytes / triton.testing.do_bench(fn, warmup=50, rep=200) / 1e9  # bytes/ms -> TB/s

    best = 0.0
    for block, per_sm, warps in [(4096, 8, 4), (8192, 4, 4), (8192, 4, 8), (8192, 16, 8)]:
        nprog = sms * per_sm
        n_per = x.numel() // nprog // block * block  # elements per program (a whole number of blocks)
        out = torch.empty(nprog * block, device=device, dtype=torch.float32)
        best = max(best, rate(lambda: _read_kernel[(nprog,)](x, out, n_per, BLOCK=block,
                                                             num_warps=warps), n_per * nprog * 2))
    torch_sum = rate(lambda: x.sum(dtype=torch.float32), x.numel() * 2)
    del x
    torch.cuda.empty_cache()
    return {"triton_read_tbs": best, "torch_sum_tbs": torch_sum}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:qwen3-0.6b")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10, help="steps timed, then steps profiled")
    a = ap.parse_args()
    device = torch.device("cuda")
    ceiling = read_ceiling(device)
    print(f"streaming read: Triton {ceiling['triton_read_tbs']:.2f} TB/s, torch.sum "
          f"{ceiling['torch_sum_tbs']:.2f} TB/s", flush=True)

    llm = LLM(a.model, max_num_seqs=256, max_num_batched_tokens=a.max_num_batched_tokens,
              block_size=a.block_size, dtype="bfloat16")
    eng = llm.engine
    cfg = eng.model_config
    wl = make_workload("nanovllm", cfg.vocab_size, 256)
    llm.generate([[1] * 900, [2] * 50], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # compile every kernel variant before timing
    for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens)):
        eng.add_request(str(i), p, SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True))
    while eng.scheduler.waiting or any(s.is_prefill for s in eng.scheduler.running):
        eng.step()
    kv_bytes_per_token = cfg.kv_bytes_per_token(eng.kv_dtype)  # what attention reads per context token
    rows, done = [], 0
    for target in (5, 300, 600, 800, 900, 980):
        while done < target and eng.has_unfinished_requests():
            eng.step()
            done += 1
        running = eng.scheduler.running
        if len(running) < 2:
            break
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(a.steps):
            eng.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t) / a.steps * 1e3
        contexts = [s.num_computed_tokens for s in eng.scheduler.running]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                eng.step()
            torch.cuda.synchronize()
        done += 2 * a.steps
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        per = collections.Counter()
        for e in events:
            per[family(e.name)] += e.device_time / 1e3 / a.steps  # us -> ms per step
        busy = busy_time([(e.time_range.start, e.time_range.end) for e in events]) / 1e3 / a.steps
        attn_bytes = sum(contexts) * kv_bytes_per_token  # contexts at the first profiled step
        row = {"decode_step": target, "running": len(contexts), "mean_context": sum(contexts) / len(contexts),
               "wall_ms": wall_ms, "busy_ms": busy, "idle_ms": max(wall_ms - busy, 0.0),
               "kernels_per_step": len(events) / a.steps,
               "ms": {k: per[k] for k in ("attention", "matmul", "norm/rope/silu", "sampler", "other")},
               "attention_tbs": attn_bytes / (per["attention"] / 1e3) / 1e12}
        rows.append(row)
        print(f"step {target:4d}: {row['running']:3d} running, wall {wall_ms:.2f} ms = busy "
              f"{busy:.2f} + idle {row['idle_ms']:.2f}; " + ", ".join(
                  f"{k} {v:.2f}" for k, v in row["ms"].items())
              + f"; attention {row['attention_tbs']:.2f} TB/s", flush=True)
    out = (os.environ.get("OUT_JSON")
           or str(Path(__file__).resolve().parent / "decode_breakdown_h200.json"))
    Path(out).write_text(json.dumps({
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"), "model": a.model, "block_size": a.block_size,
        "command": "python benchmarks/experiments/decode_step/decode_breakdown.py"
                   + (f" --block-size {a.block_size}" if a.block_size != 128 else ""),
        "read_ceiling": ceiling, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
