"""Decode attention shaped like the nano-vllm workload: which kernel config reads fastest there.

benchmarks/attention.py times uniform contexts (every sequence equally long). A real decode step
of the nano-vllm workload has 256 sequences whose contexts are spread between about 100 and 2,000
tokens, and the spread shrinks the batch as it runs. This script builds such steps (Qwen3-0.6B
attention shapes, bf16, block 16, shuffled blocks; contexts = prompt lengths randint(100, 1024)
plus the tokens generated so far) and times the Triton decode kernel for a grid of tile configs,
in the batch order the engine uses (longest first) and in arrival order.

    python benchmarks/attention_workload.py             # table to stdout, JSON to benchmarks/results/
    python benchmarks/attention_workload.py --fp8       # the same over a float8 e4m3 cache

Bandwidth = K + V bytes of every context (+ Q and O) / time: the figure a decode step needs.
"""
from __future__ import annotations

import json
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention as A  # noqa: E402  (shapes, timing, the kernels)

tk = A.tk


def make_step(contexts: list[int], device, seed: int = 0, kv_dtype=None):
    """One decode step: q (batch, heads, dim), caches with shuffled blocks, metadata tensors."""
    g = torch.Generator(device=device).manual_seed(seed)
    batch = len(contexts)
    blocks = [math.ceil(c / A.BLOCK_SIZE) for c in contexts]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    width = max(blocks)
    tables = torch.zeros(batch, width, dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start:start + n]
        start += n
    shape = (num_blocks, A.BLOCK_SIZE, A.KV_HEADS, A.HEAD_DIM)
    kv_dtype = kv_dtype or A.DTYPE
    k_cache = torch.randn(shape, device=device, dtype=A.DTYPE, generator=g).to(kv_dtype)
    v_cache = torch.randn(shape, device=device, dtype=A.DTYPE, generator=g).to(kv_dtype)
    q = torch.randn(batch, A.HEADS, A.HEAD_DIM, device=device, dtype=A.DTYPE, generator=g)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    nbytes = (2 * sum(contexts) * A.KV_HEADS * A.HEAD_DIM * k_cache.element_size()
              + 2 * batch * A.HEADS * A.HEAD_DIM * 2)
    return q, k_cache, v_cache, tables, ctx, cu, nbytes


def main():
    device = torch.device("cuda")
    kv_dtype = torch.float8_e4m3fn if "--fp8" in sys.argv else A.DTYPE
    random.seed(0)
    prompts = [random.randint(100, 1024) for _ in range(256)]
    outputs = [random.randint(100, 1024) for _ in range(256)]
    phases = []  # (name, contexts) at a few points of the run
    for t in (0, 300, 600, 900):
        ctxs = [p + t for p, o in zip(prompts, outputs) if o > t]
        phases.append((f"step {t}: {len(ctxs)} seqs, mean ctx {sum(ctxs) // len(ctxs)}", ctxs))
    configs = [tk.KernelConfig(16, bn, w, st) for bn in (32, 64, 128) for w in (2, 4)
               for st in (2, 3, 4) if not (bn == 128 and st == 4)]
    default = tk.decode_config(A.HEAD_DIM, A.HEADS // A.KV_HEADS, False)
    rows = []
    scale = 1 / math.sqrt(A.HEAD_DIM)
    for phase, ctxs in phases:
        line = []
        for order in ("longest first", "arrival"):
            cs = sorted(ctxs, reverse=True) if order == "longest first" else ctxs
            q, kc, vc, bt, ctx, cu, nbytes = make_step(cs, device, kv_dtype=kv_dtype)
            splits = tk.choose_num_splits(len(cs) * A.KV_HEADS, max(cs), default, 132)
            for cfg in configs if order == "longest first" else [default]:
                out = torch.empty_like(q)

                def fn(cfg=cfg):
                    return tk.paged_attention(q, kc, vc, bt, ctx, cu, scale, num_seqs=len(cs),
                                              max_query_len=1, config=cfg, num_splits=splits,
                                              out=out)
                ms = A.timeit(fn, device, rep_ms=40)
                tbs = nbytes / ms / 1e9
                rows.append({"phase": phase, "order": order, **cfg.__dict__, "splits": splits,
                             "ms": ms, "tbs": tbs, "default": cfg == default})
                line.append((tbs, cfg, order))
            del q, kc, vc
            torch.cuda.empty_cache()
        best = max(line, key=lambda x: x[0])
        dflt = [x for x in line if x[1] == default]
        print(f"{phase}: default {dflt[0][0]:.2f} TB/s (longest first), {dflt[1][0]:.2f} (arrival); "
              f"best {best[0]:.2f} TB/s with {best[1]}", flush=True)
    name = "attention_workload_h200" + ("_fp8" if "--fp8" in sys.argv else "") + ".json"
    out = os.path.join(os.path.dirname(__file__), "results", name)
    with open(os.environ.get("OUT_JSON", out), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": A.triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
