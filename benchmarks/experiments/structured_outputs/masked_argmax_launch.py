"""Host time of the greedy grammar-masked step's launches on the GPU: what the main thread spends,
per call, on `masked_argmax` (through `kernel_launch.CompiledLaunch`, the compiled variant's launcher),
on the same kernel through Triton's own dispatch (`kernel[grid](...)`), on a torch argmax over
the same logits (an unmasked greedy step's launch, for scale) and on copying a step's host
bitmask to the GPU (what `StructuredOutputManager.token_mask` does). 64 rows of Qwen3's 151,936
bf16 logits, random masks; both launch paths are first checked to give the same tokens. Each
is timed back to back (warm caches: a step's calls in the engine take longer, see
benchmarks/experiments/structured_outputs/structured_fill_threads.py). Needs a CUDA GPU.

    python benchmarks/experiments/structured_outputs/masked_argmax_launch.py

writes masked_argmax_launch_<gpu>.json beside this script.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def host_us(fn, calls: int = 2000, repeats: int = 7) -> float:
    """Median over `repeats` of the host time per call of `calls` calls in a row."""
    import torch
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return round(1e6 * statistics.median(times), 2)


def main() -> None:
    import torch
    import triton

    from minipaged.lessons.bench import environment
    from minipaged.sampling import kernels as K
    from minipaged.sampling.params import TokenMask
    dev, vocab, rows = "cuda", 151936, 64
    words = (vocab + 31) // 32
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(rows, vocab, device=dev, generator=g).to(torch.bfloat16)
    host_bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), device=dev, generator=g,
                                 dtype=torch.int64).to(torch.int32).cpu().pin_memory()
    mask = TokenMask(host_bitmask.to(dev), torch.ones(rows, dtype=torch.int32, device=dev),
                     torch.full((words,), -1, dtype=torch.int32, device=dev))
    block = 16384
    out = torch.empty((2, rows), dtype=torch.int64, device=dev)

    def triton_dispatch():
        K.masked_argmax_kernel[(rows,)](logits, mask.bitmask, mask.masked, mask.keep, out,
                                        logits.stride(0), mask.bitmask.stride(0), vocab,
                                        BLOCK=block, num_warps=block // 1024)

    def compiled_launch():
        K._masked_argmax_launch((rows,), logits, mask.bitmask, mask.masked, mask.keep, out,
                                logits.stride(0), mask.bitmask.stride(0), vocab, BLOCK=block,
                                num_warps=block // 1024)

    expect = K.masked_argmax(logits, mask)  # (its first launch: Triton's path)
    for launch in (triton_dispatch, compiled_launch):
        out.zero_()
        launch()
        assert torch.equal(out, expect), launch.__name__
    copy_done = torch.cuda.Event()

    def copy_bitmask():
        host_bitmask.to(dev, non_blocking=True)
        copy_done.record()
    results = {
        "masked_argmax (CompiledLaunch; with its output tensor and checks)":
            host_us(lambda: K.masked_argmax(logits, mask)),
        "launch through the compiled variant's launcher": host_us(compiled_launch),
        "launch through Triton's dispatch (kernel[grid])": host_us(triton_dispatch),
        "torch argmax over the logits": host_us(lambda: logits.argmax(dim=-1)),
        "bitmask to the GPU (non_blocking, pinned) + event": host_us(copy_bitmask),
    }
    for name, us in results.items():
        print(f"{name}: {us} us")
    gpu = "h200" if "H200" in torch.cuda.get_device_name() else "cuda"
    path = Path(__file__).resolve().parent / f"masked_argmax_launch_{gpu}.json"
    path.write_text(json.dumps({
        "benchmark": "masked_argmax_launch",
        "command": "python benchmarks/experiments/structured_outputs/masked_argmax_launch.py",
        "rows": rows, "vocab": vocab, "dtype": "bfloat16", "block": block,
        "num_warps": block // 1024, "host_us_per_call_median": results,
        "triton": triton.__version__, "environment": environment()}, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
