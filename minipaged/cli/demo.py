"""`minipaged demo`: stories260K through minipaged and through naive Hugging Face, side by side.

    minipaged demo                        32 requests, greedy, up to 128 new tokens each
    minipaged demo --num-requests 8 --max-tokens 64 --show 3

Both run the same prompts greedily; the demo prints a few stories, the two speeds and their
ratio, how many requests produced identical tokens (all of them: exit status 1 otherwise), and
what the KV blocks held. A bar follows each run (`--disable-tqdm` hides them).
"""
from __future__ import annotations

import time
from typing import Optional

from minipaged.cli.args import FlexibleArgumentParser, add_common_args, int_at_least
from minipaged.cli.errors import run_command

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


def make_parser() -> FlexibleArgumentParser:
    ap = FlexibleArgumentParser(prog="minipaged demo", description=__doc__)
    ap.add_argument("--num-requests", type=int_at_least(1), default=32,
                    help=f"how many story openings to run (at most {len(DEMO_OPENINGS)})")
    ap.add_argument("--max-tokens", type=int_at_least(1), default=128,
                    help="most new tokens per request")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    ap.add_argument("--show", type=int_at_least(0), default=8, help="how many stories to print")
    ap.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    add_common_args(ap)
    return ap


def demo(argv: list[str]) -> int:
    a = make_parser().parse_args(argv)
    if a.num_requests > len(DEMO_OPENINGS):
        raise ValueError(f"--num-requests {a.num_requests}: the demo has {len(DEMO_OPENINGS)} "
                         f"story openings; use --num-requests {len(DEMO_OPENINGS)} or fewer")
    import torch
    from tqdm.auto import tqdm

    from minipaged import LLM, SamplingParams
    from minipaged.benchmark.hf_baselines import hf_sequential, load_hf_model

    prompts = DEMO_OPENINGS[:a.num_requests]
    print(f"minipaged demo: {len(prompts)} stories260K requests, greedy, up to {a.max_tokens} "
          f"new tokens each, on {torch.get_num_threads()} CPU threads\n", flush=True)
    llm = LLM("stories260K", block_size=a.block_size, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not a.disable_tqdm)
    t_mp = time.perf_counter() - t0
    usage_peak = max(r.num_blocks_used for r in llm.trace)

    tok = llm.get_tokenizer()
    hf = load_hf_model(str(llm.engine.source.path))
    ids = [tok(p).input_ids for p in prompts]
    hf_sequential(hf, ids[:2], [4, 4], ignore_eos=False)  # warm-up
    with tqdm(total=len(ids), desc="HF sequential", disable=a.disable_tqdm,
              dynamic_ncols=True) as bar:
        base = hf_sequential(hf, ids, [a.max_tokens] * len(ids), ignore_eos=False,
                             on_finished=bar.update)

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
    return run_command(demo, argv)


if __name__ == "__main__":
    raise SystemExit(main())
