"""Decode attention shaped like the nano-vllm workload: which kernel config reads fastest there.

benchmarks/attention.py times uniform contexts (every sequence equally long). A real decode step
of the nano-vllm workload has 256 sequences whose contexts are spread between about 100 and 2,000
tokens, and the spread shrinks the batch as it runs. This script builds such steps (Qwen3-0.6B
attention shapes, bf16, block 16, shuffled blocks; contexts = prompt lengths randint(100, 1024)
plus the tokens generated so far) and times the Triton decode kernel for a grid of tile configs,
in the batch order the engine uses (longest first) and in arrival order.

    # table to stdout, JSON beside this script
    python benchmarks/experiments/attention_tiles/attention_workload.py
    # the same over a float8 e4m3 cache
    python benchmarks/experiments/attention_tiles/attention_workload.py --fp8
    # blocks stored (block, kv_head, slot, dim)
    python benchmarks/experiments/attention_tiles/attention_workload.py --head-major
    # bigger blocks; 2 configs
    python benchmarks/experiments/attention_tiles/attention_workload.py --block-size 128 --quick
    # a prefill step: the first prompts, 8,192 tokens
    python benchmarks/experiments/attention_tiles/attention_workload.py --prefill

Each row also records the compiled kernel's registers, shared memory and whether its K/V loads
became asynchronous copies (cp.async in the PTX): what decides how many programs share an SM.

Bandwidth = K + V bytes of every context (+ Q and O) / time: the figure a decode step needs.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import random
import sys

import torch

# benchmarks/, for attention.py
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import attention as A  # noqa: E402  (shapes, timing, the kernels)

tk = A.tk


def make_step(contexts: list[int], device, seed: int = 0, kv_dtype=None, head_major=False,
              block_size=A.BLOCK_SIZE):
    """One decode step: q (batch, heads, dim), caches with shuffled blocks, metadata tensors."""
    g = torch.Generator(device=device).manual_seed(seed)
    batch = len(contexts)
    blocks = [math.ceil(c / block_size) for c in contexts]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    width = max(blocks)
    tables = torch.zeros(batch, width, dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start:start + n]
        start += n
    # head-major: each (block, KV head) is one contiguous block_size x head_dim slab; the kernel
    # sees the usual (block, slot, kv_head, dim) view and follows its strides
    shape = ((num_blocks, A.KV_HEADS, block_size, A.HEAD_DIM) if head_major
             else (num_blocks, block_size, A.KV_HEADS, A.HEAD_DIM))
    kv_dtype = kv_dtype or A.DTYPE
    k_cache = torch.randn(shape, device=device, dtype=A.DTYPE, generator=g).to(kv_dtype)
    v_cache = torch.randn(shape, device=device, dtype=A.DTYPE, generator=g).to(kv_dtype)
    if head_major:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    q = torch.randn(batch, A.HEADS, A.HEAD_DIM, device=device, dtype=A.DTYPE, generator=g)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    nbytes = (2 * sum(contexts) * A.KV_HEADS * A.HEAD_DIM * k_cache.element_size()
              + 2 * batch * A.HEADS * A.HEAD_DIM * 2)
    return q, k_cache, v_cache, tables, ctx, cu, nbytes


def prefill_main(device, block_size: int):
    """Time the prefill configs on the workload's first step: fresh prompts (randint(100, 1024)
    tokens each) filling 8,192 tokens, as the engine schedules them (longest first)."""
    random.seed(0)
    prompts = [random.randint(100, 1024) for _ in range(256)]
    lens, total = [], 0
    for n in prompts:
        if total + n > 8192:
            break
        lens.append(n)
        total += n
    lens.sort(reverse=True)
    q1, kc, vc, bt, ctx, _, _ = make_step(lens, device, block_size=block_size)
    q = torch.randn(total, A.HEADS, A.HEAD_DIM, device=device, dtype=A.DTYPE)
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=device)
    flops = sum(4 * n * (n + 1) / 2 * A.HEAD_DIM * A.HEADS for n in lens)  # causal QK^T and PV
    group = A.HEADS // A.KV_HEADS
    default = tk.prefill_config(A.HEAD_DIM, group, max(lens), False)
    configs = [default] + [tk.KernelConfig(m, n, w, st) for m, n, w, st in [
        (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2),
        (64, 64, 4, 3), (64, 128, 4, 2), (32, 64, 4, 2)]]
    rows = []
    for cfg in configs:
        out = torch.empty_like(q)

        def fn(cfg=cfg):
            return tk.paged_attention(q, kc, vc, bt, ctx, cu, 1 / math.sqrt(A.HEAD_DIM),
                                      num_seqs=len(lens), max_query_len=max(lens), config=cfg,
                                      out=out)
        ms = A.timeit(fn, device, rep_ms=40)
        rows.append({"phase": f"prefill: {len(lens)} prompts, {total} tokens", **cfg.__dict__,
                     "ms": ms, "tflops": flops / ms / 1e9, "default": cfg == default})
        print(f"  prefill {len(lens)} prompts / {total} tokens: {cfg}: {ms * 1e3:.0f} us, "
              f"{flops / ms / 1e9:.0f} TFLOP/s{'  (default)' if cfg == default else ''}", flush=True)
    return rows


def _compiled() -> dict:
    """The compiled variants of the attention kernel so far, by cache key (Triton-internal)."""
    found = {}
    for cache in getattr(tk.paged_attention_kernel, "device_caches", {}).values():
        found.update(cache[0])
    return found


def kernel_info(kernel) -> dict:
    """Registers, shared memory and cp.async presence of one compiled variant."""
    try:
        return {"n_regs": kernel.n_regs, "shared": kernel.metadata.shared,
                "cp_async": "cp.async" in kernel.asm.get("ptx", "")}
    except Exception as e:  # noqa: BLE001  (attribute names are Triton-internal)
        return {"info_error": repr(e)}


def main():
    device = torch.device("cuda")
    fp8 = "--fp8" in sys.argv
    head_major = "--head-major" in sys.argv
    block_size = int(sys.argv[sys.argv.index("--block-size") + 1]) if "--block-size" in sys.argv \
        else A.BLOCK_SIZE
    kv_dtype = torch.float8_e4m3fn if fp8 else A.DTYPE
    if "--prefill" in sys.argv:
        rows = prefill_main(device, block_size)
        with open(os.environ.get("OUT_JSON", os.path.join(os.path.dirname(__file__),
                                                          "attention_prefill_h200.json")), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": A.triton.__version__, "rows": rows}, f, indent=1)
        return
    random.seed(0)
    prompts = [random.randint(100, 1024) for _ in range(256)]
    outputs = [random.randint(100, 1024) for _ in range(256)]
    phases = []  # (name, contexts) at a few points of the run
    for t in (0, 300, 600, 750, 900):
        ctxs = [p + t for p, o in zip(prompts, outputs) if o > t]
        phases.append((f"step {t}: {len(ctxs)} seqs, mean ctx {sum(ctxs) // len(ctxs)}", ctxs))
    configs = [tk.KernelConfig(16, bn, w, st) for bn in (64, 128) for w in (4, 8)
               for st in (2, 3)]
    if "--quick" in sys.argv:
        configs = [tk.KernelConfig(16, bn, 4, 2) for bn in (64, 128)]
    default = tk.decode_config(A.HEAD_DIM, A.HEADS // A.KV_HEADS, False)
    rows = []
    infos = {}  # (config, split?) -> what the compiler made of it
    scale = 1 / math.sqrt(A.HEAD_DIM)
    for phase, ctxs in phases:
        line = []
        cs = sorted(ctxs, reverse=True)  # the engine's batch order
        q, kc, vc, bt, ctx, cu, nbytes = make_step(cs, device, kv_dtype=kv_dtype,
                                                   head_major=head_major, block_size=block_size)
        auto = tk.choose_num_splits(len(cs) * A.KV_HEADS, max(cs), default, 132)
        for cfg in configs:
            for splits in sorted({auto, 2, 4} if len(cs) <= 128 else {auto}):
                out = torch.empty_like(q)

                def fn(cfg=cfg, splits=splits):
                    return tk.paged_attention(q, kc, vc, bt, ctx, cu, scale, num_seqs=len(cs),
                                              max_query_len=1, config=cfg, num_splits=splits,
                                              out=out)
                before = set(_compiled())
                ms = A.timeit(fn, device, rep_ms=40)
                new = [k for key, k in _compiled().items() if key not in before]
                variant = (cfg, splits > 1)
                if new:
                    infos[variant] = kernel_info(new[0])
                tbs = nbytes / ms / 1e9
                rows.append({"phase": phase, "layout": "head-major" if head_major else "token-major",
                             "block_size": block_size,
                             **cfg.__dict__, "splits": splits, "ms": ms, "tbs": tbs,
                             "default": cfg == default and splits == auto, **infos.get(variant, {})})
                line.append((tbs, cfg, splits))
                print(f"  {phase[:28]:28s} n={cfg.block_n:3d} w={cfg.num_warps} s={cfg.num_stages} "
                      f"splits={splits}: {tbs:.2f} TB/s  {rows[-1].get('n_regs')} regs, "
                      f"{rows[-1].get('shared')} B smem, cp.async {rows[-1].get('cp_async')}",
                      flush=True)
        del q, kc, vc
        torch.cuda.empty_cache()
        best = max(line, key=lambda x: x[0])
        dflt = [x for x in line if x[1] == default and x[2] == auto]
        print(f"{phase}: default {dflt[0][0]:.2f} TB/s; best {best[0]:.2f} TB/s with {best[1]}, "
              f"splits {best[2]}", flush=True)
    name = ("attention_workload_h200" + ("_fp8" if fp8 else "")
            + ("_head_major" if head_major else "")
            + (f"_block{block_size}" if block_size != A.BLOCK_SIZE else "") + ".json")
    out = os.path.join(os.path.dirname(__file__), name)
    with open(os.environ.get("OUT_JSON", out), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": A.triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
