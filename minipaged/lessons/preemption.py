"""Measurements for lesson 06's memory pressure: recompute vs swap preemption.

* `preemption_experiment(...)` runs one workload under memory pressure with
  `preemption_mode="recompute"` or `"swap"` (or recompute with prefix caching, or a cache big
  enough for no preemption at all) on the real engine and reports time (best wall time, least
  CPU time of `repeats` fresh engines, each warmed up first with the workload's shapes under the
  same pressure: `lessons.bench.warm_up`), tokens recomputed, prefix-cache hits and bytes
  swapped, read from the trace; `preemption_verdict` says which was cheaper, from those numbers.
* `swap_copy_microbenchmark(...)` times the swap copy alone: minipaged's gather-then-copy
  against one copy per block and layer (vLLM v0's way).

`benchmarks/preemption.py` prints the tables; the lesson calls the same functions on a smaller
workload. The memory saved by sharing is `lessons/sharing.py`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class PreemptionRun:
    mode: str
    block_size: int
    num_blocks: int
    wall_s: float  # best of `repeats`
    cpu_s: float  # least process time over the `repeats` (less disturbed by other processes)
    steps: int
    preemptions: int
    swapped_out: int  # sequences swapped out
    recomputed_tokens: int  # prefill work redone (prefix-cache hits excluded)
    prefix_hit_tokens: int  # tokens readmissions found in the prefix cache
    swapped_bytes: int  # out and back in
    output_tokens: int
    outputs: list = None  # token ids, to check that modes agree
    same_as_first: Optional[int] = None  # requests with the same tokens as the first mode run
    warmup: Optional[dict] = None  # lessons.bench.Warmup.to_dict() of the fastest run's engine
    step_ms: Optional[dict] = None  # lessons.bench.step_ms of the fastest run

    def row(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "outputs"}


PREEMPTION_MODES = ("none", "recompute", "recompute+prefix", "swap")


def preemption_workload(num_requests: int = 64, seed: int = 0, vocab_size: int = 512):
    from minipaged.benchmark.throughput import make_workload
    return make_workload("cpu", vocab_size=vocab_size, num_requests=num_requests, seed=seed, bos=1)


def preemption_experiment(mode: str, block_size: int, cache_tokens: int, wl, *,
                          model: str = "stories260K", device: str = "auto", repeats: int = 1,
                          max_num_seqs: int = 64, dtype: str = "auto",
                          num_cpu_blocks: Optional[int] = None) -> PreemptionRun:
    """Greedy, EOS ignored; `cache_tokens` KV slots (num_blocks = cache_tokens / block_size).

    `mode`: "none" (a cache with room for everything: no preemption), "recompute", "swap", or
    "recompute+prefix": recompute with prefix caching on, so a preempted sequence's freed
    blocks stay cached and its readmission finds whatever was not evicted meanwhile."""
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"mode must be one of {PREEMPTION_MODES}, got {mode!r}")
    import torch

    from minipaged import LLM, SamplingParams
    from minipaged.lessons.bench import step_ms, warm_up
    need = sum(len(p) + m for p, m in zip(wl.prompts, wl.max_tokens))
    num_blocks = (-(-need // block_size) + len(wl.prompts)) if mode == "none" else \
        cache_tokens // block_size
    max_len = max(len(p) + m for p, m in zip(wl.prompts, wl.max_tokens))
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    best, least_cpu = None, float("inf")
    for _ in range(repeats):  # a fresh engine each time: an empty prefix cache
        llm = LLM(model, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                  enable_prefix_caching=mode == "recompute+prefix", device=device, dtype=dtype,
                  max_model_len=-(-max_len // block_size) * block_size,
                  preemption_mode="swap" if mode == "swap" else "recompute",
                  num_cpu_blocks=num_cpu_blocks)
        # The workload's shapes once, untimed (it preempts as the timed run will): a fresh
        # engine's first steps, preemptions and swaps allocate, and compile on a GPU.
        warm = warm_up(llm, wl.prompts, params)
        start = len(llm.trace)
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        if llm.engine.device.type == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        trace = llm.trace[start:]
        run = PreemptionRun(
            mode=mode, block_size=block_size, num_blocks=num_blocks, wall_s=wall, cpu_s=cpu,
            steps=len(trace), preemptions=sum(len(r.preempted) for r in trace),
            swapped_out=sum(len(r.swapped_out) for r in trace),
            recomputed_tokens=sum(r.num_recomputed_tokens for r in trace),
            prefix_hit_tokens=sum(r.num_prefix_hit_tokens for r in trace),
            swapped_bytes=sum(r.num_swapped_bytes for r in trace),
            output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
            outputs=[o.outputs[0].token_ids for o in outs], warmup=warm.to_dict(),
            step_ms=step_ms(trace))
        least_cpu = min(least_cpu, cpu)
        if best is None or run.wall_s < best.wall_s:
            best = run
    best.cpu_s = least_cpu  # the wall time of the fastest run, the least CPU time of any
    return best


def swap_copy_microbenchmark(block_sizes: Sequence[int] = (8, 16, 32, 64), total_tokens: int = 8192,
                             num_layers: int = 28, kv_heads: int = 8, head_dim: int = 128,
                             dtype=None, device: str = "cpu", repeats: int = 5) -> list[dict]:
    """Time to copy `total_tokens` tokens of K/V to the CPU pool, per block size, two ways: ours
    (`worker/swap.py`'s `swap_out_blocks`: one gather, a few large copies) and vLLM v0's (one copy per
    block, layer and K/V). Shapes default to Qwen3-0.6B's KV (28 layers, 8 KV heads x 128, bf16
    on CUDA)."""
    import torch

    from minipaged.worker.swap import allocate_cpu_cache, swap_out_blocks
    dev = torch.device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    rows = []
    for bs in block_sizes:
        n = total_tokens // bs
        kv = torch.randn(num_layers, 2, 2 * n, bs, kv_heads, head_dim, device=dev).to(dtype)
        cpu = allocate_cpu_cache(kv, n)
        mapping = [(2 * i, i) for i in range(n)]  # every other GPU block: a scattered table

        def ours():
            swap_out_blocks(kv, cpu, mapping)

        def per_block():  # vLLM v0: per layer, K and V each: one cudaMemcpyAsync per block
            for layer in range(num_layers):
                for kv_idx in range(2):
                    for g, c in mapping:
                        cpu[c, layer, kv_idx].copy_(kv[layer, kv_idx, g], non_blocking=True)

        res = {"block_size": bs, "blocks": n,
               "bytes": n * bs * 2 * num_layers * kv_heads * head_dim * kv.element_size()}
        for name, fn in (("batched", ours), ("per_block", per_block)):
            times = []
            for _ in range(repeats):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            res[f"{name}_s"] = min(times)
            res[f"{name}_gb_per_s"] = res["bytes"] / min(times) / 1e9
        rows.append(res)
    return rows


def format_preemption(runs: Sequence[PreemptionRun]) -> str:
    """Markdown table of `preemption_experiment` runs, grouped by block size; the ratios are of
    CPU time, which a busy shared machine disturbs less than wall time."""
    lines = ["| block size | mode | wall s | CPU s | vs none (CPU) | vs swap (CPU) | steps | preemptions | "
             "swapped seqs | tokens recomputed | prefix hits | MB swapped |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for bs in sorted({r.block_size for r in runs}):
        sel = {r.mode: r for r in runs if r.block_size == bs}
        for r in sel.values():
            none, swap = sel.get("none"), sel.get("swap")
            lines.append(
                f"| {bs} | {r.mode} | {r.wall_s:.2f} | {r.cpu_s:.2f} | "
                f"{r.cpu_s / none.cpu_s:.2f}x | "
                f"{(r.cpu_s / swap.cpu_s) if swap else float('nan'):.2f}x | {r.steps} | "
                f"{r.preemptions} | {r.swapped_out} | {r.recomputed_tokens} | "
                f"{r.prefix_hit_tokens} | {r.swapped_bytes / 1e6:.1f} |")
    return "\n".join(lines)


def preemption_verdict(run: PreemptionRun, swap: PreemptionRun, tolerance: float = 0.10) -> str:
    """One sentence comparing `run` with the swap run, computed from the numbers. The verdict
    reads CPU time (the least over the repeats), which another process on a shared machine
    disturbs far less than wall time; wall time and steps are printed beside it."""
    cpu, wall = run.cpu_s / swap.cpu_s, run.wall_s / swap.wall_s
    head = (f"{run.mode} vs swap: CPU time {cpu:.2f}x (wall {wall:.2f}x), "
            f"{run.steps} steps vs {swap.steps} ({run.steps / swap.steps:.2f}x)")
    if abs(cpu - 1) <= tolerance:
        return head + f" -> about the same here (CPU time within {tolerance:.0%})"
    return head + (f" -> {run.mode} {abs(cpu - 1):.0%} {'slower' if cpu > 1 else 'faster'} than "
                   "swap in this run (CPU time)")


def format_swap_copies(rows: list[dict]) -> str:
    """Markdown table of `swap_copy_microbenchmark`."""
    lines = ["| block size | blocks | MB | batched ms | batched GB/s | per-block ms | "
             "per-block GB/s | per-block / batched |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['block_size']} | {r['blocks']} | {r['bytes'] / 1e6:.0f} | "
                     f"{1e3 * r['batched_s']:.1f} | {r['batched_gb_per_s']:.1f} | "
                     f"{1e3 * r['per_block_s']:.1f} | {r['per_block_gb_per_s']:.1f} | "
                     f"{r['per_block_s'] / r['batched_s']:.1f}x |")
    return "\n".join(lines)


# --- pictures (lesson 06, benchmarks/) ---------------------------------------------------------


MODE_COLOURS = {"none": "#999999", "recompute": "#e31a1c", "recompute+prefix": "#fd8d3c",
                "swap": "#2b8cbe"}


def plot_preemption(runs: Sequence[PreemptionRun], micro: Optional[list] = None,
                    title: str = ""):
    """Left: end-to-end time per block size and mode. Right (`micro`): the swap copy alone,
    batched vs one copy per block and layer."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2 if micro else 1, figsize=(10 if micro else 5.5, 3.6))
    ax = axes[0] if micro else axes
    sizes = sorted({r.block_size for r in runs})
    modes = [m for m in PREEMPTION_MODES if any(r.mode == m for r in runs)]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        ys = [next((r.wall_s for r in runs if r.block_size == bs and r.mode == mode), 0)
              for bs in sizes]
        ax.bar([j + (i - (len(modes) - 1) / 2) * width for j in range(len(sizes))], ys, width,
               label=mode, color=MODE_COLOURS[mode])
    ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
    ax.set_xlabel("block size")
    ax.set_ylabel("end-to-end time (s)")
    ax.set_ylim(0, 1.3 * max(r.wall_s for r in runs))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    if micro:
        ax = axes[1]
        xs = [r["block_size"] for r in micro]
        ax.plot(xs, [r["batched_gb_per_s"] for r in micro], "o-",
                label="one gather, few copies (minipaged)")
        ax.plot(xs, [r["per_block_gb_per_s"] for r in micro], "s-",
                label="one copy per block, layer and K/V (vLLM v0)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("block size")
        ax.set_ylabel("swap-out copy, GB/s")
        ax.set_title("the copy alone, same bytes", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
