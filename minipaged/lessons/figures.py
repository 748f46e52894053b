"""Regenerate every PNG in `figures/` from the experiments the lessons run.

    python -m minipaged.lessons.figures                 # all of them, into ./figures
    python -m minipaged.lessons.figures --only memory_waste,gantt_static_vs_continuous
    make figures

Each `fig_*` function runs one small, seeded experiment on the real engine (stories260K on CPU)
or on the real `BlockManager` / `Scheduler` (`minipaged.lessons.memory_waste`), and draws it with
`minipaged.lessons.viz`. The lessons call the same experiment functions (`fig2_results`,
`lesson_workload`, ...), so a number in a lesson, in the README and in a PNG is the same number.
Throughput is the only measurement that changes from run to run (and machine to machine).
"""
from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Callable, Optional

# --- shared experiment settings --------------------------------------------------------------
# Fig. 2 reproduction (lesson 01): the paper served OPT-13B with a 2048-token context on one A100.
FIG2_MAX_MODEL_LEN = 2048
FIG2_CAPACITY = 16 * 2048  # KV slots: room for 16 max-length requests
FIG2_NUM_REQUESTS = {"sharegpt": 300, "alpaca": 600}
FIG2_SEED = 0

# The Qwen2.5-7B configuration from the course note (config.json values).
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
             "hidden_size": 3584, "intermediate_size": 18944,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "vocab_size": 152064, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
             "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False}

SHARED_PREFIX = ("Once upon a time, there was a little girl named Lily. She loved to play "
                 "outside in the park with her friends.")


def cpu_threads(n: int = 1) -> None:
    """stories260K's matrices are tiny (64 wide): a second thread costs more than it gives, and
    on a shared 2-core machine an OpenMP thread waiting for a busy core stalls every layer."""
    import torch
    torch.set_num_threads(n)


@functools.lru_cache(maxsize=None)
def fig2_results(dataset: str = "sharegpt", num_requests: Optional[int] = None,
                 block_sizes: tuple = (8, 16, 32, 128)):
    """Every memory strategy on the same trace and cache (lesson 01, `memory_waste.png`)."""
    from minipaged.lessons.memory_waste import compare_strategies, make_trace
    reqs = make_trace(dataset, num_requests or FIG2_NUM_REQUESTS[dataset], seed=FIG2_SEED,
                      max_model_len=FIG2_MAX_MODEL_LEN)
    return tuple(compare_strategies(reqs, FIG2_CAPACITY, block_sizes=block_sizes,
                                    max_model_len=FIG2_MAX_MODEL_LEN))


@functools.lru_cache(maxsize=None)
def block_size_rows(dataset: str = "alpaca", num_requests: int = 300):
    from minipaged.lessons import viz
    from minipaged.lessons.memory_waste import make_trace
    reqs = make_trace(dataset, num_requests, seed=FIG2_SEED, max_model_len=FIG2_MAX_MODEL_LEN)
    return viz.block_size_tradeoff(reqs, FIG2_CAPACITY // 4, max_model_len=FIG2_MAX_MODEL_LEN)


def lesson_workload(num_requests: int = 12, seed: int = 0, output_scale: int = 4,
                    max_model_len: int = 256):
    """A small CPU workload (prompts U[4, 64], outputs U[16, 256] / `output_scale`), real token
    ids from stories260K's vocabulary starting with BOS, EOS ignored."""
    from minipaged.benchmark.throughput import make_workload
    wl = make_workload("cpu", 512, num_requests, seed=seed, bos=1, max_model_len=max_model_len)
    wl.max_tokens = [max(2, m // output_scale) for m in wl.max_tokens]
    return wl


def sampling_params_for(wl, **kw):
    from minipaged import SamplingParams
    return [SamplingParams(max_tokens=m, ignore_eos=True, temperature=kw.get("temperature", 0.0))
            for m in wl.max_tokens]


def run_traced(wl, **llm_kw):
    """Run `wl` through a fresh `LLM("stories260K", record_block_tables=True, ...)`."""
    from minipaged import LLM
    llm = LLM("stories260K", record_block_tables=True, **llm_kw)
    llm.generate(wl.prompts, sampling_params_for(wl), use_tqdm=False)
    return llm


def preemption_run(num_blocks: int = 24, block_size: int = 8):
    """Lesson 03: the lesson workload in a cache far too small for it (preemptions happen)."""
    return run_traced(lesson_workload(), num_blocks=num_blocks, block_size=block_size,
                      max_model_len=num_blocks * block_size, max_num_batched_tokens=64)


def shared_prefix_run():
    """Lesson 02: one request fills the prefix cache, then three more reuse its blocks."""
    from minipaged import LLM, SamplingParams
    llm = LLM("stories260K", block_size=8, num_blocks=48, max_model_len=256,
              record_block_tables=True)
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    llm.generate([SHARED_PREFIX + " One day"], sp, use_tqdm=False)
    first = len(llm.trace)
    llm.generate([SHARED_PREFIX + " She", SHARED_PREFIX + " Her mom", SHARED_PREFIX + " Tom"],
                 SamplingParams(max_tokens=12, temperature=0.8, seed=1), use_tqdm=False)
    return llm, first


HF_STATIC_BATCH_SIZES = (4, 8, 16, 32)


def side_by_side(llm, hf, wl, hf_batch_sizes: tuple = HF_STATIC_BATCH_SIZES, repeats: int = 3):
    """minipaged and the three HF baselines on `wl` in one run (lessons 03 and 08).

    HF's static batching is swept over `hf_batch_sizes` (sizes above the request count are one
    batch of everything, so they collapse into it); static rows are named `hf-static (batch B)`.
    Then minipaged and the fastest HF row run `repeats - 1` more times, interleaved, each keeping
    its best: "vs best HF" is the best minipaged run against HF's best setting at its best run,
    not one picked in advance, and a busy moment of a shared machine does not decide it."""
    import dataclasses

    from minipaged.benchmark.throughput import run_hf, run_minipaged
    n = len(wl.prompts)
    runners = {"minipaged": lambda: run_minipaged(llm, wl),
               "hf-sequential": lambda: run_hf("hf-sequential", hf, wl, 1, False)}
    for b in sorted({min(b, n) for b in hf_batch_sizes}):
        runners[f"hf-static (batch {b})"] = (
            lambda b=b: dataclasses.replace(run_hf("hf-static", hf, wl, b, False),
                                            backend=f"hf-static (batch {b})"))
    runners["hf-cb"] = lambda: run_hf("hf-cb", hf, wl, n, False)
    results = {name: run() for name, run in runners.items()}
    best = best_hf(results.values()).backend
    for _ in range(repeats - 1):
        for name in ("minipaged", best):
            r = runners[name]()
            if r.tokens_per_sec > results[name].tokens_per_sec:
                results[name] = r
    return list(results.values())


def throughput_results(num_requests: int = 32, hf_batch_sizes: tuple = HF_STATIC_BATCH_SIZES,
                       repeats: int = 3):
    """`side_by_side` on the lesson workload of `num_requests` (lesson 03, `throughput.png`)."""
    from minipaged import LLM
    from minipaged.benchmark.hf_baselines import load_hf_model
    wl = lesson_workload(num_requests, output_scale=2)
    llm = LLM("stories260K", max_model_len=256)
    hf = load_hf_model(str(llm.engine.source.path))
    return side_by_side(llm, hf, wl, hf_batch_sizes, repeats), wl


def best_hf(results):
    """The fastest Hugging Face row of `results` (BenchResults)."""
    return max((r for r in results if r.backend.startswith("hf")), key=lambda r: r.tokens_per_sec)


# --- the figures ------------------------------------------------------------------------------
def fig_kv_cache_size():
    from minipaged.lessons import viz
    from minipaged.models.config import ModelConfig
    import torch
    q = ModelConfig.from_dict(QWEN25_7B).kv_bytes_per_token(torch.bfloat16)
    return viz.plot_kv_cache_size({"Qwen2.5-7B, bf16": q,
                                   "stories260K, fp32": 2 * 5 * 4 * 8 * 4}, budget_gib=5.49,
                                  title="KV cache size; the course note's 24 GB card has 5.49 GiB "
                                        "for it")


def fig_memory_waste():
    import matplotlib.pyplot as plt
    from minipaged.lessons import viz
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, ds in zip(axes, ("sharegpt", "alpaca")):
        viz.plot_memory_waste(fig2_results(ds), ax=ax, paper=(ds == "sharegpt"),
                              title=f"{ds}: {FIG2_NUM_REQUESTS[ds]} requests, "
                                    f"{FIG2_CAPACITY} KV slots")
    fig.suptitle("Share of KV memory holding token states (vLLM paper Fig. 2, reproduced)",
                 fontsize=11)
    fig.tight_layout()
    return fig


def fig_memory_waste_over_time():
    import matplotlib.pyplot as plt
    from minipaged.lessons import viz
    res = {r.label: r for r in fig2_results("sharegpt")}
    fig, axes = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    viz.plot_waste_over_time(res["Orca (Oracle)"], ax=axes[0])
    viz.plot_waste_over_time(res["paged (block 16)"], ax=axes[1])
    axes[0].legend(fontsize=7, loc="upper right")
    axes[0].set_xlabel("")
    fig.tight_layout()
    return fig


def fig_block_size_tradeoff():
    from minipaged.lessons import viz
    return viz.plot_block_size_tradeoff(block_size_rows("alpaca"),
                                        title="Block size on Alpaca-like lengths: waste vs "
                                              "table entries")


def fig_block_table():
    from minipaged.lessons import viz
    llm, first = shared_prefix_run()
    trace = llm.trace
    pos = first + 4
    return viz.plot_block_tables(trace, pos, max_physical=48,
                                 title="3 requests sharing a cached prefix, "
                                       f"step {trace[pos].step}")


def fig_copy_on_write():
    from minipaged.lessons import viz
    from minipaged.engine.block_manager import BlockManager
    from minipaged.sampling import SamplingParams
    from minipaged.engine.sequence import Sequence
    bm = BlockManager(num_blocks=16, block_size=4)
    parent = Sequence("parent", list(range(10, 20)), SamplingParams())
    bm.allocate(parent, [], parent.num_tokens)
    parent.num_computed_tokens = parent.num_tokens
    child = Sequence("child", list(range(10, 20)), SamplingParams())
    bm.fork(parent, child)
    bm.append_slots(child, 1)  # the child writes token 11: copy-on-write of the shared last block
    names = {parent.seq_id: "parent", child.seq_id: "child"}
    return viz.plot_block_tables(bm, names=names, max_physical=16,
                                 title="fork, then the child appends: its last block is copied")


def fig_gantt_static_vs_continuous(seats: int = 4):
    """HF static batches of `seats` against minipaged with `max_num_seqs=seats` (the same
    seats), then minipaged with a seat for every request (the gain of more seats, apart)."""
    from minipaged.lessons import viz
    wl = lesson_workload()
    same = run_traced(wl, max_model_len=256, max_num_seqs=seats)
    wide = run_traced(wl, max_model_len=256, max_num_seqs=len(wl.prompts))
    return viz.plot_static_vs_continuous(same.trace, [len(p) for p in wl.prompts], wl.max_tokens,
                                         batch_size=seats, more_seats=wide.trace)


def fig_gantt_preemption():
    import matplotlib.pyplot as plt
    from minipaged.lessons import viz
    llm = preemption_run()
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 2]})
    viz.plot_batch_gantt(llm.trace, ax=a1, title="num_blocks=24, block_size=8: requests are "
                         "preempted (recompute) and come back")
    a1.set_xlabel("")
    viz.plot_kv_utilization(llm.trace, ax=a2)
    fig.tight_layout()
    return fig


def fig_kv_utilization():
    from minipaged.lessons import viz
    wl = lesson_workload(24)
    llm = run_traced(wl, max_model_len=256, num_blocks=64, block_size=8, max_num_seqs=8)
    return viz.plot_kv_utilization(llm.trace, title="max_num_seqs=8, 64 blocks of 8: the queue "
                                   "drains as seats free up")


def fig_throughput():
    from minipaged.lessons import viz
    results, wl = throughput_results()
    best = best_hf(results)
    return viz.plot_throughput(results, baseline=best.backend,
                               title=f"stories260K on CPU, {len(wl.prompts)} requests, "
                                     f"{sum(wl.max_tokens)} output tokens (ratios vs HF's best: "
                                     f"{best.backend})",
                               note="one run on this machine; HF static batching swept over "
                                    "batch sizes in the same run; ratios matter, absolute "
                                    "numbers vary")


SAMPLING_PROMPT = "Tom liked to"


def next_token_logits(llm, prompt: str):
    """Last-token log-probabilities over the whole vocabulary, through the engine itself:
    `SamplingParams(logprobs=vocab_size)` returns the raw model log-probs of every token, and
    log-probs are logits up to a constant (softmax cannot tell them apart). `llm` must allow that
    many: `LLM(..., max_logprobs=-1)` (the default limit is vLLM's 20)."""
    import torch
    from minipaged import SamplingParams
    vocab = llm.engine.model_config.vocab_size
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=vocab),
                       use_tqdm=False)[0]
    logits = torch.full((vocab,), float("-inf"))
    for tid, lp in out.outputs[0].logprobs[0].items():
        logits[tid] = lp.logprob
    return logits


def fig_sampling():
    from minipaged import LLM
    from minipaged.lessons import viz
    llm = LLM("stories260K", max_model_len=256, max_logprobs=-1)
    tok = llm.get_tokenizer()
    logits = next_token_logits(llm, SAMPLING_PROMPT)
    stages = viz.sampling_stages(logits, temperature=0.7, top_k=5, top_p=0.8, min_p=0.1)
    labels = tok.convert_ids_to_tokens(list(range(len(logits))))
    return viz.plot_token_distributions(stages, labels, top=16,
                                        title=f"{SAMPLING_PROMPT!r} -> next token (stories260K)")


FIGURES: dict[str, Callable] = {
    "kv_cache_size": fig_kv_cache_size,
    "memory_waste": fig_memory_waste,
    "memory_waste_over_time": fig_memory_waste_over_time,
    "block_size_tradeoff": fig_block_size_tradeoff,
    "block_table": fig_block_table,
    "copy_on_write": fig_copy_on_write,
    "gantt_static_vs_continuous": fig_gantt_static_vs_continuous,
    "gantt_preemption": fig_gantt_preemption,
    "kv_utilization": fig_kv_utilization,
    "throughput": fig_throughput,
    "sampling": fig_sampling,
}


def main(argv=None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ap = argparse.ArgumentParser(prog="python -m minipaged.lessons.figures", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="figures", help="folder for the PNGs (default: figures)")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {list(FIGURES)}")
    ap.add_argument("--dpi", type=int, default=90)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(FIGURES)
    unknown = set(names) - set(FIGURES)
    if unknown:
        ap.error(f"unknown figures {sorted(unknown)}; choose from {list(FIGURES)}")
    cpu_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        fig = FIGURES[name]()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=args.dpi, bbox_inches="tight")
        plt.close(fig)
        print(f"{path}  {path.stat().st_size / 1024:6.0f} KB  {time.perf_counter() - t0:5.1f} s",
              flush=True)
    print(f"{len(names)} figures in {time.perf_counter() - t_all:.1f} s")


if __name__ == "__main__":
    main()
