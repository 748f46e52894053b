"""Measurements for lesson 06: memory saved by sharing, and recompute vs swap preemption.

Both run the real engine and read the real `BlockManager` through the trace:

* `sharing_savings(trace)` is the vLLM paper's number (Sec. 6.3, Fig. 15): blocks saved by
  sharing / blocks the same sequences would hold without sharing. Each `StepRecord` has the
  blocks in use and `num_blocks_saved_by_sharing` (block-table entries minus blocks in use);
  summed over steps they weigh every block by how long it is held.
* `sharing_experiment(...)` runs parallel sampling or beam search on Alpaca-like lengths
  (`bench.make_workload("alpaca", ...)`) and returns those numbers; for parallel sampling it also
  runs the same samples as independent requests (sample i of a request is the request with
  `seed + i` alone, token for token), which is the workload *without* sharing, measured.
* `n_samples_two_ways(...)` asks for n samples of one prompt the way minipaged (and vLLM v0)
  does it, one request forked with copy-on-write, and the way vLLM V1 does it, n separate
  requests that share the prompt's full blocks through the prefix cache; the trace says what
  each way computed and held.
* `preemption_experiment(...)` runs one workload under memory pressure with
  `preemption_mode="recompute"` or `"swap"` and reports time, tokens recomputed, bytes swapped.

`benchmarks/sharing.py` and `benchmarks/preemption.py` print the tables; the lesson calls the
same functions on smaller workloads.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class Savings:
    label: str
    width: int  # n samples or beam width
    num_requests: int
    block_size: int
    saving: float  # sum over steps of saved blocks / sum of blocks needed without sharing
    mean_step_saving: float  # the same ratio averaged per step
    peak_blocks: int  # most blocks in use at once, with sharing
    peak_blocks_unshared: int  # ... and what those steps would hold without sharing
    steps: int
    independent_block_steps: Optional[int] = None  # parallel sampling run as n requests each
    shared_block_steps: Optional[int] = None

    @property
    def measured_saving(self) -> Optional[float]:
        """1 - (block-steps with sharing / block-steps of the independent run)."""
        if self.independent_block_steps is None:
            return None
        return 1 - self.shared_block_steps / self.independent_block_steps


def sharing_savings(trace) -> dict:
    """Paper-style saving over a trace (steps that hold no block are skipped)."""
    recs = [r for r in trace if r.num_blocks_used]
    used = sum(r.num_blocks_used for r in recs)
    saved = sum(r.num_blocks_saved_by_sharing for r in recs)
    per_step = [r.num_blocks_saved_by_sharing / (r.num_blocks_used + r.num_blocks_saved_by_sharing)
                for r in recs]
    return {"saving": saved / (used + saved) if used else 0.0,
            "mean_step_saving": sum(per_step) / len(per_step) if per_step else 0.0,
            "peak_blocks": max((r.num_blocks_used for r in recs), default=0),
            "peak_blocks_unshared": max((r.num_blocks_used + r.num_blocks_saved_by_sharing
                                         for r in recs), default=0),
            "block_steps": used, "steps": len(recs)}


def alpaca_workload(num_requests: int, seed: int = 0, max_model_len: int = 512):
    from minipaged.lessons.bench import make_workload
    return make_workload("alpaca", vocab_size=512, num_requests=num_requests, seed=seed, bos=1,
                         max_model_len=max_model_len)


def sharing_experiment(kind: str, width: int, num_requests: int = 100, block_size: int = 16,
                       seed: int = 0, model: str = "stories260K", device: str = "auto",
                       independent: bool = True, max_num_seqs: int = 256) -> Savings:
    """`kind`: "parallel" (SamplingParams(n=width)) or "beam" (BeamSearchParams(beam_width=width))
    on Alpaca-like lengths, EOS ignored (each request runs to its output length), no prefix
    caching (so only forks share), a cache large enough that nothing is preempted."""
    from minipaged import LLM, BeamSearchParams, SamplingParams
    wl = alpaca_workload(num_requests, seed)
    kw = dict(block_size=block_size, enable_prefix_caching=False, max_num_seqs=max_num_seqs,
              device=device, max_model_len=512)
    llm = LLM(model, **kw)
    if kind == "parallel":
        params = [SamplingParams(n=width, temperature=1.0, seed=seed + 1000 * i, max_tokens=m,
                                 ignore_eos=True) for i, m in enumerate(wl.max_tokens)]
        llm.generate(wl.prompts, params, use_tqdm=False)
    elif kind == "beam":
        for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens)):  # own max_tokens each
            llm.engine.add_request(f"beam-{i}", p, BeamSearchParams(beam_width=width, max_tokens=m,
                                                                    ignore_eos=True))
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    else:
        raise ValueError(f"kind must be 'parallel' or 'beam', got {kind!r}")
    s = sharing_savings(llm.trace)
    out = Savings(label=kind, width=width, num_requests=num_requests, block_size=block_size,
                  saving=s["saving"], mean_step_saving=s["mean_step_saving"],
                  peak_blocks=s["peak_blocks"], peak_blocks_unshared=s["peak_blocks_unshared"],
                  steps=s["steps"], shared_block_steps=s["block_steps"])
    if kind == "parallel" and independent:
        alone = LLM(model, **kw)
        prompts = [p for p in wl.prompts for _ in range(width)]
        params = [SamplingParams(temperature=1.0, seed=seed + 1000 * i + j, max_tokens=m,
                                 ignore_eos=True)
                  for i, m in enumerate(wl.max_tokens) for j in range(width)]
        alone.generate(prompts, params, use_tqdm=False)
        out.independent_block_steps = sharing_savings(alone.trace)["block_steps"]
    return out


def format_savings(rows: Sequence[Savings], paper: bool = True) -> str:
    """Markdown table; `paper` adds the vLLM paper's Alpaca ranges (OPT-13B, Fig. 15)."""
    ref = {"parallel": "6.1-9.8%", "beam": "37.6-55.2%"}
    head = ("| sharing | n / beam width | requests | block size | saving (block-steps) | "
            "per-step mean | peak blocks (unshared) | measured vs independent |"
            + (" paper (Alpaca) |" if paper else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        measured = f"{r.measured_saving:.1%}" if r.measured_saving is not None else "-"
        lines.append(f"| {'parallel sampling' if r.label == 'parallel' else 'beam search'} | "
                     f"{r.width} | {r.num_requests} | {r.block_size} | {r.saving:.1%} | "
                     f"{r.mean_step_saving:.1%} | {r.peak_blocks} ({r.peak_blocks_unshared}) | "
                     f"{measured} |" + (f" {ref[r.label]} |" if paper else ""))
    return "\n".join(lines)


# --- n samples: fork + copy-on-write, or n requests and the prefix cache ----------------------
@dataclass
class NWayRun:
    way: str
    prefill_tokens: int  # prompt tokens the model computed (StepRecord.num_prefill_tokens)
    prefix_hit_tokens: int  # prompt tokens the prefix cache served instead
    cow_copies: int  # blocks copied on write
    peak_blocks: int  # most blocks in use at once
    block_steps: int  # blocks in use, summed over steps
    saved_block_steps: int  # table entries pointing at a block another table uses, summed
    steps: int
    outputs: list  # token ids of each sample, in sample order

    @property
    def saving(self) -> float:
        """The paper's ratio: blocks saved by sharing / blocks without sharing (block-steps)."""
        total = self.block_steps + self.saved_block_steps
        return self.saved_block_steps / total if total else 0.0


N_WAYS = ("fork", "requests", "requests, first ahead")


def n_samples_two_ways(prompt: list[int], n: int = 4, max_tokens: int = 16, block_size: int = 8,
                       seed: int = 1, model: str = "stories260K") -> list[NWayRun]:
    """n samples of `prompt` (temperature 1, sample i seeded `seed + i`, EOS ignored), three ways,
    each on a fresh engine:

    * "fork": `SamplingParams(n=n)`, one request; the prompt is prefilled once, forked into n
      sequences that share its blocks, and copy-on-write splits the partial last block
      (minipaged, vLLM v0, the paper). Prefix caching off, so only the fork shares.
    * "requests": n requests of the same prompt, prefix caching on, all arriving together (what
      vLLM V1 turns n > 1 into). minipaged publishes a block to the prefix cache once its K/V is
      computed, after the step; requests admitted in the same step therefore find nothing.
    * "requests, first ahead": the same n requests, the first one a step ahead: the others find
      the prompt's full blocks in the cache and compute only the partial last block. This is what
      vLLM V1 gets in one step, because it publishes a block's hash when it allocates the block
      (`KVCacheManager.allocate_slots` -> `cache_blocks`), before the forward pass that fills it.
    """
    from minipaged import LLM, SamplingParams
    runs = []
    for way in N_WAYS:
        llm = LLM(model, block_size=block_size, max_model_len=256,
                  enable_prefix_caching=way != "fork")
        eng = llm.engine
        sample = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_tokens,
                                 ignore_eos=True) for i in range(n)]
        if way == "fork":
            outs = llm.generate([prompt], SamplingParams(n=n, temperature=1.0, seed=seed,
                                                         max_tokens=max_tokens, ignore_eos=True),
                                use_tqdm=False)
            tokens = [c.token_ids for c in outs[0].outputs]
        else:
            done = {}
            eng.add_request("0", prompt, sample[0])
            if way == "requests, first ahead":
                for o in eng.step():
                    done[o.request_id] = o
            for i in range(1, n):
                eng.add_request(str(i), prompt, sample[i])
            while eng.has_unfinished_requests():
                for o in eng.step():
                    done[o.request_id] = o
            tokens = [done[str(i)].outputs[0].token_ids for i in range(n)]
        t = [r for r in llm.trace if r.num_batched_tokens]
        runs.append(NWayRun(way=way, prefill_tokens=sum(r.num_prefill_tokens for r in t),
                            prefix_hit_tokens=sum(r.num_prefix_hit_tokens for r in t),
                            cow_copies=sum(r.num_cow_copies for r in t),
                            peak_blocks=max(r.num_blocks_used for r in t),
                            block_steps=sum(r.num_blocks_used for r in t),
                            saved_block_steps=sum(r.num_blocks_saved_by_sharing for r in t),
                            steps=len(t), outputs=tokens))
    return runs


def format_n_ways(runs: Sequence[NWayRun], prompt_len: int, n: int) -> str:
    """Markdown table of `n_samples_two_ways`."""
    names = {"fork": "1 request, `n=%d`: fork + copy-on-write" % n,
             "requests": "%d requests, prefix cache, arriving together" % n,
             "requests, first ahead": "%d requests, prefix cache, the first a step ahead" % n}
    lines = [f"| {n} samples of a {prompt_len}-token prompt | prompt tokens computed | "
             "served by the prefix cache | CoW copies | peak blocks | block-steps | "
             "saved by sharing | steps |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {names.get(r.way, r.way)} | {r.prefill_tokens} | {r.prefix_hit_tokens} | "
                     f"{r.cow_copies} | {r.peak_blocks} | {r.block_steps} | {r.saving:.0%} | "
                     f"{r.steps} |")
    return "\n".join(lines)


# --- recompute vs swap ------------------------------------------------------------------------
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

    def row(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "outputs"}


PREEMPTION_MODES = ("none", "recompute", "recompute+prefix", "swap")


def preemption_workload(num_requests: int = 64, seed: int = 0, vocab_size: int = 512):
    from minipaged.lessons.bench import make_workload
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
        warm = [[1] + [3] * 8]  # a prompt of none of the requests
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        start = len(llm.trace)
        if llm.engine.device.type == "cuda":
            torch.cuda.synchronize()
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
            outputs=[o.outputs[0].token_ids for o in outs])
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
PAPER_ALPACA = {"parallel": (6.1, 9.8), "beam": (37.6, 55.2)}  # vLLM paper, Fig. 15, OPT-13B


def plot_savings(rows: Sequence[Savings], title: Optional[str] = None):
    """Bars: our saving per n / beam width; band: the paper's Alpaca range."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    bs = rows[0].block_size
    for ax, kind, name in zip(axes, ("parallel", "beam"), ("parallel sampling", "beam search")):
        sel = [r for r in rows if r.label == kind and r.block_size == bs]
        xs = [str(r.width) for r in sel]
        ax.bar(xs, [100 * r.saving for r in sel], color="#2b8cbe", label="minipaged, measured")
        lo, hi = PAPER_ALPACA[kind]
        ax.axhspan(lo, hi, color="#fdae61", alpha=0.5, label="vLLM paper, Alpaca (OPT-13B)")
        for x, r in zip(xs, sel):
            ax.text(x, 100 * r.saving + 1, f"{r.saving:.0%}", ha="center", fontsize=9)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("n" if kind == "parallel" else "beam width")
    axes[0].set_ylabel("KV blocks saved by sharing (%)")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title or f"Memory saved by sharing, Alpaca-like lengths, block size {bs}",
                 fontsize=11)
    fig.tight_layout()
    return fig


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
