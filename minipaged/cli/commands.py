"""The `minipaged` command: `demo`, `generate`, `bench` and `serve`.

    minipaged demo                                    stories260K: minipaged vs naive HF, side by side
    minipaged generate --prompt "Once upon a time"    one-off generation
    minipaged bench --workload cpu                    throughput table vs the HF baselines
    minipaged serve stories260K --port 8000           OpenAI-compatible server
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

from minipaged.cli.args import HelpFormatter, add_engine_args, engine_kwargs

DEMO_OPENINGS = [
    "Once upon a time", "One day, a little girl named Lily", "Tom had a big red ball",
    "The sun was shining and", "There was a small dog who", "Sara wanted to play with",
    "In a big forest, there lived", "Ben and his mom went to the park", "The cat saw a bird",
    "Lucy found a shiny stone", "Max did not like to share", "A little boy named Tim",
    "Once there was a happy frog", "Mom said, \"Time for bed", "The old tree in the garden",
    "Anna liked to draw pictures", "It was a rainy day and", "A bunny hopped into the",
    "The little car could not", "Jack and Jill went up", "Once upon a time, in a small house",
    "The bird sang a song", "Sue had a pretty doll", "The boy looked at the sky",
    "A big bear lived in", "Tim's dad made a cake", "One morning, the duck",
    "The princess had a magic", "Lily and Tom were friends", "The fish swam in the",
    "Grandma gave Amy a", "The dog barked at the",
]


def cmd_generate(a) -> int:
    from minipaged import LLM, SamplingParams
    llm = LLM(**engine_kwargs(a))
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            max_tokens=a.max_tokens)  # unseeded rows draw from --seed's stream
    for out in llm.generate(a.prompt, params, use_tqdm=False):
        print(f"{out.prompt}{out.outputs[0].text}")
        print(f"[{len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason}]")
    return 0


def cmd_demo(a) -> int:
    import torch

    from minipaged import LLM, SamplingParams
    from minipaged.lessons.baseline import hf_sequential, load_hf_model

    prompts = DEMO_OPENINGS[:a.num_requests]
    print(f"minipaged demo: {len(prompts)} stories260K requests, greedy, up to {a.max_tokens} "
          f"new tokens each, on {torch.get_num_threads()} CPU threads\n")
    llm = LLM("stories260K", block_size=a.block_size, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    t_mp = time.perf_counter() - t0
    usage_peak = max(r.num_blocks_used for r in llm.trace)

    tok = llm.get_tokenizer()
    hf = load_hf_model(str(llm.engine.source.path))
    ids = [tok(p).input_ids for p in prompts]
    hf_sequential(hf, ids[:2], [4, 4], ignore_eos=False)  # warm-up
    base = hf_sequential(hf, ids, [a.max_tokens] * len(ids), ignore_eos=False)

    for p, o in zip(prompts[:a.show], outs):
        first = (p + o.outputs[0].text).split("\n")[0]
        print(f"  {first[:110]}{'...' if len(first) > 110 else ''}")
    n_mp = sum(len(o.outputs[0].token_ids) for o in outs)
    same = sum(o.outputs[0].token_ids == b for o, b in zip(outs, base.outputs))
    bm = llm.engine.block_manager
    print(f"\n  minipaged      {n_mp:6d} tokens in {t_mp:6.2f} s = {n_mp / t_mp:8,.0f} tok/s")
    print(f"  HF sequential  {base.output_tokens:6d} tokens in {base.elapsed:6.2f} s = "
          f"{base.tokens_per_sec:8,.0f} tok/s")
    print(f"  ratio          {n_mp / t_mp / base.tokens_per_sec:.1f}x   "
          f"(identical greedy tokens for {same}/{len(prompts)} requests)")
    print(f"  KV blocks      peak {usage_peak} of {bm.num_blocks} used (block_size "
          f"{bm.block_size}); after the run: {bm.num_blocks - bm.num_free_blocks} used, "
          f"{bm.allocator.num_cached_free} cached for prefix reuse, "
          f"{bm.num_free_blocks - bm.allocator.num_cached_free} empty")
    return 0 if same == len(prompts) else 1


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from minipaged.cli.bench import main as bench_main
        bench_main(argv[1:])
        return 0
    if argv and argv[0] == "serve":
        from minipaged.cli.serve import main as serve_main
        return serve_main(argv[1:])
    ap = argparse.ArgumentParser(prog="minipaged", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="stories260K through minipaged and naive HF, side by side")
    d.add_argument("--num-requests", type=int, default=32)
    d.add_argument("--max-tokens", type=int, default=128)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--show", type=int, default=8, help="how many stories to print")
    g = sub.add_parser("generate", help="generate text for one or more prompts",
                       formatter_class=HelpFormatter)
    g.add_argument("--prompt", action="append", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    add_engine_args(g)
    sub.add_parser("bench", help="throughput vs HF baselines (see `minipaged bench --help`)")
    sub.add_parser("serve", help="OpenAI-compatible server (see `minipaged serve --help`)")
    a = ap.parse_args(argv)
    return {"demo": cmd_demo, "generate": cmd_generate}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
