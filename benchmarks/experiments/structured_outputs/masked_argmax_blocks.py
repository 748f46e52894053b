"""The greedy rows' grammar-mask kernel (`sampling/kernels.py`, `masked_argmax_kernel`) at several
block widths and warp counts: GPU time per launch for 64 rows of Qwen3's 151,936 bf16 logits
(random logits and masks; each configuration first checked to give `masked_argmax`'s tokens).
Needs a CUDA GPU. `masked_argmax` launches the fastest one (blocks of 16,384, 16 warps).

    python benchmarks/experiments/structured_outputs/masked_argmax_blocks.py

writes masked_argmax_blocks_<gpu>.json beside this script.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

CONFIGS = [(4096, 8), (2048, 4), (4096, 4), (8192, 8), (8192, 16), (16384, 16), (16384, 32)]


def main() -> None:
    import torch

    from minipaged.lessons.bench import environment
    from minipaged.sampling import kernels as K
    from minipaged.sampling.params import TokenMask
    dev, vocab, rows, launches = "cuda", 151936, 64, 200
    words = (vocab + 31) // 32
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(rows, vocab, device=dev, generator=g).to(torch.bfloat16)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, device=dev,
                            generator=g)
    masked = torch.ones(rows, dtype=torch.int32, device=dev)
    keep = torch.full((words,), -1, dtype=torch.int32, device=dev)
    expect = K.masked_argmax(logits, TokenMask(bitmask, masked, keep))

    def launch(block, warps):
        out = torch.empty((2, rows), dtype=torch.int64, device=dev)
        K.masked_argmax_kernel[(rows,)](logits, bitmask, masked, keep, out, logits.stride(0),
                                        bitmask.stride(0), vocab, BLOCK=block, num_warps=warps)
        return out

    results = []
    for block, warps in CONFIGS:
        assert torch.equal(launch(block, warps), expect), (block, warps)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(launches):
            launch(block, warps)
        b.record()
        torch.cuda.synchronize()
        us = 1e3 * a.elapsed_time(b) / launches
        results.append({"block": block, "num_warps": warps, "gpu_us_per_launch": round(us, 1)})
        print(f"BLOCK {block:6d} warps {warps:3d}: {us:6.1f} us")
    gpu = "h200" if "H200" in torch.cuda.get_device_name() else "cuda"
    out = {"benchmark": "masked_argmax_blocks",
           "command": "python benchmarks/experiments/structured_outputs/masked_argmax_blocks.py",
           "rows": rows, "vocab": vocab,
           "dtype": "bfloat16", "launches": launches, "results": results,
           "environment": environment()}
    path = Path(__file__).resolve().parent / f"masked_argmax_blocks_{gpu}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
