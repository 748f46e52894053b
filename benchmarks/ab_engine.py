"""A/B of two checkouts' engines on the nano-vllm workload, in one run, with one driver.

Each side is a folder holding a `minipaged` package (this checkout, or another revision's
`git archive REV minipaged | tar -x -C DIR`). Every run is a fresh process that imports that
side's package and nothing else of it: this script builds the engine, draws the workload itself
(nano-vllm's bench: `random.seed(0)`, 256 prompts of `randint(100, 1024)` ids below 10,000,
`max_tokens = randint(100, 1024)`, temperature 0.6, EOS ignored), runs the whole workload once
untimed (kernels compiled, graphs captured, every shape met), then times it once. So both sides
get the same warm-up and the same clock, whatever their own `minipaged bench` does. Sides
alternate A, B, B, A, A, B, ... so that drift of the machine falls on both alike; the summary is
the median over rounds of each round's B / A ratio (paired) beside each side's median tok/s.

    python benchmarks/ab_engine.py --a OLD_DIR --b . --rounds 4 --out FILE.json \
        [--label-a c32a5d0 --label-b HEAD] [--model dummy:qwen3-0.6b --block-size 128]

Two settings of one checkout: the same folder on both sides, each with its own `LLM` keywords
(JSON) over the common ones; `--block-size 0` / `--max-num-batched-tokens 0` leave a knob to the
engine's default. The engine with no flags against a tuned one:

    python benchmarks/ab_engine.py --a . --b . --block-size 0 --max-num-batched-tokens 0 \
        --a-kwargs '{"block_size": 128, "max_num_batched_tokens": 8192}' --label-a tuned \
        --label-b "no flags" --rounds 4 --out FILE.json

Needs the GPU it is measured on (`--device cpu` runs it anywhere, for a smoke test with
`--num-requests 4 --model stories260K`).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from ab_script import paired, run_rounds  # the alternating rounds and their pairing


def workload(num_requests: int, max_input: int, max_output: int, seed: int = 0):
    """nano-vllm's bench, drawn as it draws it (lengths capped by the two maxima)."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input))]
               for _ in range(num_requests)]
    max_tokens = [random.randint(100, max_output) for _ in range(num_requests)]
    return prompts, max_tokens


def run_side(a: argparse.Namespace) -> dict:
    """One timed run of the side's engine in this process (after one untimed run)."""
    sys.path.insert(0, os.path.abspath(a.run))
    import torch

    from minipaged import LLM, SamplingParams
    kwargs = dict(dtype=a.dtype, device=a.device, seed=0)
    if a.block_size:
        kwargs["block_size"] = a.block_size
    if a.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = a.max_num_batched_tokens
    kwargs.update(json.loads(a.kwargs))
    llm = LLM(a.model, **kwargs)
    prompts, max_tokens = workload(a.num_requests, a.max_input, a.max_output)
    if llm.engine.model_config.vocab_size <= 10000:  # a small model (the CPU smoke test)
        prompts = [[t % llm.engine.model_config.vocab_size for t in p] for p in prompts]
    params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in max_tokens]
    t0 = time.perf_counter()
    llm.generate([p[::-1] for p in prompts], params, use_tqdm=False)  # warm-up, untimed
    warm_sec = time.perf_counter() - t0
    if a.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if a.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cfg = llm.engine.config
    return {"tokens_per_sec": round(tokens / elapsed, 1), "elapsed_sec": round(elapsed, 3),
            "output_tokens": tokens, "block_size": cfg.block_size,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_num_seqs": cfg.max_num_seqs, "steps_with_warmup": len(llm.engine.trace),
            "warmup": {"requests": len(prompts), "output_tokens": tokens,
                       "seconds": round(warm_sec, 2)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a"), ap.add_argument("--b")
    ap.add_argument("--label-a", default="A"), ap.add_argument("--label-b", default="B")
    ap.add_argument("--a-kwargs", default="{}", help="JSON: side A's own LLM keywords")
    ap.add_argument("--b-kwargs", default="{}", help="JSON: side B's own LLM keywords")
    ap.add_argument("--kwargs", default="{}", help="(internal) this run's own LLM keywords")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--run", default=None, help="(internal) time this side's engine once")
    ap.add_argument("--json", default=None, help="(internal) where --run writes its result")
    ap.add_argument("--model", default="dummy:qwen3-0.6b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=1024)
    a = ap.parse_args()
    if a.run:
        with open(a.json, "w") as f:
            json.dump(run_side(a), f)
        return
    engine_args = ["--model", a.model, "--dtype", a.dtype, "--device", a.device,
                   "--block-size", str(a.block_size),
                   "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                   "--num-requests", str(a.num_requests), "--max-input", str(a.max_input),
                   "--max-output", str(a.max_output)]

    def command(side: str, path: str):
        return [sys.executable, __file__, "--run", getattr(a, side), "--json", path,
                "--kwargs", getattr(a, side + "_kwargs")] + engine_args, None

    runs = run_rounds(a.rounds, command, lambda side, result: (
        f"{getattr(a, 'label_' + side)}: {result['tokens_per_sec']:,.0f} tok/s"))
    tps = {s: [x["tokens_per_sec"] for x in runs[s]] for s in "ab"}
    summary = {
        "benchmark": "ab_engine",
        "command": f"python benchmarks/ab_engine.py --a A --b B --rounds {a.rounds} "
                   + " ".join(engine_args),
        "workload": f"nano-vllm: {a.num_requests} requests, input U[100, {a.max_input}], output "
                    f"U[100, {a.max_output}], seed 0, temperature 0.6, EOS ignored; {a.model} "
                    f"{a.dtype}, block_size {a.block_size}, max_num_batched_tokens "
                    f"{a.max_num_batched_tokens}; each run after one untimed run of the same",
        "order": "A, B, then B, A, ... (alternating by round)",
        **{s: {"label": getattr(a, "label_" + s), "kwargs": json.loads(getattr(a, s + "_kwargs")),
               "tokens_per_sec": tps[s], "median": statistics.median(tps[s])} for s in "ab"},
        **paired(tps["a"], tps["b"]),
        "runs": runs}
    if a.device == "cuda":
        import torch
        summary["gpu"] = torch.cuda.get_device_name(0)
    print(f"{a.label_a} median {summary['a']['median']:,.0f} tok/s, {a.label_b} median "
          f"{summary['b']['median']:,.0f} tok/s; B/A paired median "
          f"{summary['b_over_a_paired_median']:.4f} (per round {summary['b_over_a_per_round']})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
