"""One side of `benchmarks/vs_vllm.py`: one engine (vLLM or minipaged) in this process, with its
defaults, timing the workloads of a JSON file written by vs_vllm.py.

    python benchmarks/lib/peer_side.py --engine minipaged --model dummy:qwen3-0.6b \
        --workloads W.json --out SIDE.json
    python3 benchmarks/lib/peer_side.py --engine vllm --model DIR_WITH_CONFIG_JSON \
        --workloads W.json --out SIDE.json      # in vLLM's environment

The file holds token-id prompts and `max_tokens` per request, so both engines run the very same
requests (temperature 0.6, EOS ignored; no tokenizer on either side). The side builds its engine
with no flags but the shared ones (dtype bfloat16, max_model_len, dummy weights), runs the first
workload once untimed (kernels compiled, graphs captured, every shape met), then times each
workload: a batch workload once (all requests submitted together), `one_stream` three times,
keeping the median. It imports nothing of minipaged on the vLLM side. minipaged's runs also
record their steps from the engine's trace (count, median and slowest step, and the steps over
five times the median: a stall shows there, not in tok/s alone).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def vllm_engine(model: str, max_model_len: int):
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # not in the slim payload
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    import vllm
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, load_format="dummy", dtype="bfloat16", max_model_len=max_model_len,
              skip_tokenizer_init=True, seed=0)
    cfg = llm.llm_engine.vllm_config
    config = {"engine": "vllm", "version": vllm.__version__,
              "block_size": cfg.cache_config.block_size,
              "max_num_seqs": cfg.scheduler_config.max_num_seqs,
              "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
              "compilation_mode": str(cfg.compilation_config.mode),
              "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
              "gpu_memory_utilization": cfg.cache_config.gpu_memory_utilization}
    return sampler(llm, SamplingParams, lambda p: {"prompt_token_ids": p}), config, None


def minipaged_engine(model: str, max_model_len: int):
    import minipaged
    from minipaged import LLM, SamplingParams
    llm = LLM(model, dtype="bfloat16", max_model_len=max_model_len)
    cfg = llm.engine.config
    config = {"engine": "minipaged", "version": minipaged.__version__,
              "block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
              "max_num_batched_tokens": cfg.max_num_batched_tokens,
              "enforce_eager": cfg.enforce_eager, "async_scheduling": cfg.async_scheduling,
              "fused_ops": cfg.fused_ops, "attention_backend": cfg.attention_backend,
              "gpu_memory_utilization": cfg.gpu_memory_utilization}
    return sampler(llm, SamplingParams, lambda p: p), config, llm.engine.trace


def sampler(llm, sampling_params_cls, prompt):
    """`generate(prompts, max_tokens) -> output tokens` for either engine: both take a list of
    prompts (`prompt` turns token ids into the engine's form) with one SamplingParams each."""
    def generate(prompts, max_tokens):
        params = [sampling_params_cls(temperature=0.6, ignore_eos=True, max_tokens=m)
                  for m in max_tokens]
        outs = llm.generate([prompt(p) for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)
    return generate


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(generate, prompts, max_tokens, trace=None) -> dict:
    """One run of a workload; with minipaged's step trace, also its steps' wall times."""
    first = len(trace) if trace is not None else 0
    _sync()
    t0 = time.perf_counter()
    tokens = generate(prompts, max_tokens)
    _sync()
    elapsed = time.perf_counter() - t0
    run = {"output_tokens": tokens, "seconds": round(elapsed, 4),
           "tok_per_s": round(tokens / elapsed, 1)}
    if trace is not None:
        run["steps"] = step_stats([r.duration for r in list(trace)[first:]])
    return run


def step_stats(durations: list[float]) -> dict:
    """How a run's time splits over its steps: count, median and slowest step, and the steps
    over five times the median with the seconds they took (a stall, not the workload)."""
    if not durations:
        return {"steps": 0}
    median = statistics.median(durations)
    slow = [d for d in durations if d > 5 * median]
    return {"steps": len(durations), "median_ms": round(median * 1e3, 3),
            "max_ms": round(max(durations) * 1e3, 3), "slow_steps": len(slow),
            "slow_seconds": round(sum(slow), 4)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("vllm", "minipaged"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    spec = json.load(open(a.workloads))
    build = vllm_engine if a.engine == "vllm" else minipaged_engine
    t0 = time.perf_counter()
    generate, config, trace = build(a.model, spec["max_model_len"])
    config["build_seconds"] = round(time.perf_counter() - t0, 1)
    first = spec["workloads"][0]
    warm = timed(generate, first["prompts"], first["max_tokens"])  # untimed in the results
    results = {}
    for wl in spec["workloads"]:
        runs = [timed(generate, wl["prompts"], wl["max_tokens"], trace)
                for _ in range(wl["repeats"])]
        run = sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]  # the median
        expected = sum(wl["max_tokens"])
        if run["output_tokens"] != expected:
            raise SystemExit(f"{a.engine} {wl['name']}: {run['output_tokens']} output tokens, "
                             f"expected {expected}")
        results[wl["name"]] = dict(run, runs=[r["seconds"] for r in runs])
        if len(wl["prompts"]) == 1:  # one stream: the time per output token
            results[wl["name"]]["ms_per_token"] = round(1e3 * run["seconds"] / expected, 4)
        print(f"{a.engine:9s} {wl['name']:10s} {run['tok_per_s']:10,.0f} tok/s "
              f"(median of {len(runs)}: {statistics.median(r['seconds'] for r in runs):.2f} s)",
              flush=True)
    json.dump({"config": config, "warmup": dict(warm, workload=first["name"]),
               "results": results}, open(a.out, "w"), indent=1)


if __name__ == "__main__":  # vLLM may spawn its engine-core process
    main()
