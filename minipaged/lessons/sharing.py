"""Measurements for lesson 06's sharing: the KV memory parallel sampling and beam search save,
and n samples both ways (fork + copy-on-write, and vLLM V1's n requests through the prefix cache).

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

`benchmarks/sharing.py` prints the table; the lesson calls the same functions on smaller
workloads. Recompute vs swap preemption (lesson 06, section 5) is `lessons/preemption.py`.
"""
from __future__ import annotations

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
    from minipaged.benchmark.throughput import make_workload
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
      vLLM V1 turns n > 1 into). A block is published to the prefix cache when its slots are
      allocated, before the forward that fills it (vLLM V1's `KVCacheManager.allocate_slots` ->
      `cache_blocks`), so the later requests, admitted in the same step, find the first one's
      full prompt blocks and compute only the partial last block.
    * "requests, first ahead": the same n requests, the first one a step ahead: the same hits,
      one step later.
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
