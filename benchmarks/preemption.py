"""Recompute vs swap preemption under the same memory pressure, block sizes 8-64.

    .venv/bin/python benchmarks/preemption.py                       # stories260K on CPU
    .venv/bin/python benchmarks/preemption.py --device cuda --model dummy:qwen3-0.6b \\
        --cache-tokens 4096 --out benchmarks/results/preemption_h200_qwen3-0.6b.json

One workload (the CPU benchmark's lengths: 64 requests, prompts U[4, 64], outputs U[16, 256],
greedy, EOS ignored) runs four ways on a cache of `--cache-tokens` slots (num_blocks =
cache_tokens / block_size, the same memory at every block size):

  none              a cache large enough for everything (the reference: no preemption)
  recompute         vLLM's default: a victim's blocks are freed, it prefills again later
  recompute+prefix  the same with prefix caching on: freed blocks stay cached until evicted,
                    so a readmitted victim finds part of its own KV still there
  swap              the victim's blocks are copied to a CPU pool and back (pinned on CUDA)

Every run is a fresh engine, warmed up first with the workload's shapes under the same pressure
(untimed: the same prompt lengths and max_tokens, token ids reversed; `lessons.bench.warm_up`),
so that --repeats 1 times a warm engine; each row keeps its warm-up ("warmup") and its first
timed step against its median step ("step_ms").
It prints end-to-end time (best of --repeats; wall and process CPU time, the machine is shared),
steps, preemptions, tokens recomputed and bytes swapped, checks that every mode produced the
same greedy tokens, and with --micro times the copy itself: `worker/swap.py`'s `swap_out_blocks` (one
gather, a few large copies) against vLLM v0's one copy per block and layer, for the same bytes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minipaged.lessons.bench import Warmup  # noqa: E402
from minipaged.lessons.preemption import (PREEMPTION_MODES, format_preemption,  # noqa: E402
                                          format_swap_copies, plot_preemption,
                                          preemption_experiment, preemption_workload,
                                          swap_copy_microbenchmark)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260K")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--cache-tokens", type=int, default=2048)
    ap.add_argument("--block-sizes", default="8,16,32,64")
    ap.add_argument("--modes", default=",".join(PREEMPTION_MODES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--micro", action="store_true", help="also time the swap copy alone")
    ap.add_argument("--micro-tokens", type=int, default=2048)
    ap.add_argument("--out", default=None)
    ap.add_argument("--figure", default=None)
    args = ap.parse_args(argv)
    import torch
    if args.device == "cpu":
        torch.set_num_threads(1)
    from minipaged.models.config import ModelConfig
    from minipaged.models.loader import resolve_model
    cfg = ModelConfig.from_dict(resolve_model(args.model).config)
    wl = preemption_workload(args.num_requests, vocab_size=cfg.vocab_size)
    runs = []
    for bs in [int(b) for b in args.block_sizes.split(",")]:
        ref = None
        for mode in args.modes.split(","):
            r = preemption_experiment(mode, bs, args.cache_tokens, wl, model=args.model,
                                      device=args.device, repeats=args.repeats, dtype=args.dtype)
            ref = ref if ref is not None else r.outputs
            same = sum(a == b for a, b in zip(r.outputs, ref))
            print(f"block {bs:3d} {mode:17s} {r.wall_s:7.2f} s  preemptions {r.preemptions:4d}  "
                  f"recomputed {r.recomputed_tokens:6d}  swapped {r.swapped_bytes / 1e6:8.1f} MB"
                  f"  same greedy tokens as '{args.modes.split(',')[0]}': {same}/{len(ref)}"
                  f"\n          after a {Warmup(**r.warmup)}", flush=True)
            # fp32 on CPU: always all of them. bf16 on a GPU: a prefill and a decode may round
            # differently, and random (dummy) weights have near-ties, so a few may diverge.
            r.same_as_first = same
            runs.append(r)
    print()
    print(format_preemption(runs))
    micro = None
    if args.micro:
        micro = swap_copy_microbenchmark([int(b) for b in args.block_sizes.split(",")],
                                         total_tokens=args.micro_tokens,
                                         num_layers=cfg.num_hidden_layers,
                                         kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                         device=args.device)
        print(f"\nswap-out copy of {args.micro_tokens} tokens of {args.model}'s K/V:")
        print(format_swap_copies(micro))
    from minipaged.lessons.bench import environment
    tag = f"{args.device}_{args.model.replace(':', '_').replace('/', '_').lower()}"
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"preemption_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    warmup = {"what": "every engine (each run of each mode and block size) ran the workload "
                      "once untimed first: the same prompt lengths and max_tokens, token ids "
                      "reversed; each row holds its fastest run's warm-up",
              "seconds": round(sum(r.warmup["seconds"] for r in runs), 2)}
    out.write_text(json.dumps({"args": vars(args), "environment": environment(),
                               "warmup": warmup, "runs": [r.row() for r in runs],
                               "micro": micro}, indent=1))
    print(f"\nwrote {out}")
    fig = Path(args.figure) if args.figure else (ROOT / "figures" / "preemption_cpu.png"
                                                if args.device == "cpu"
                                                and args.model == "stories260K" else None)
    if fig is not None:
        import matplotlib
        matplotlib.use("Agg")
        plot_preemption(runs, micro, f"{args.model} on {args.device}, cache of "
                                     f"{args.cache_tokens} tokens, {args.num_requests} "
                                     f"requests").savefig(fig, dpi=110)
        print(f"wrote {fig}")
    return runs, micro


if __name__ == "__main__":
    main()
