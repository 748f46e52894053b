"""Memory saved by sharing KV blocks: parallel sampling and beam search on Alpaca-like lengths.

    .venv/bin/python benchmarks/sharing.py                        # stories260K, CPU, ~2 min
    .venv/bin/python benchmarks/sharing.py --device cuda --model dummy:qwen3-0.6b

The vLLM paper (Sec. 6.3, Fig. 15) reports, on Alpaca with OPT-13B, 6.1-9.8% of KV blocks saved
by parallel sampling and 37.6-55.2% by beam search (n / beam width 2, 4, 6), where the saving is
"blocks saved by sharing / blocks without sharing". Here both come from the real BlockManager:
every StepRecord holds the blocks in use and the block-table entries beyond them
(`num_blocks_saved_by_sharing`); the saving is summed over steps (block-steps). For parallel
sampling the same samples are also run as independent requests (seed + i), the workload without
sharing for real; the last column compares the two runs' block-steps.

Lengths: `bench.make_workload("alpaca")` (exponential, means 19.31 in / 58.45 out), EOS ignored,
prefix caching off (only forks share), a cache that never preempts.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minipaged.lessons.sharing import (Savings, format_savings, plot_savings,  # noqa: E402
                               sharing_experiment)

def main(argv=None) -> list[Savings]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260K")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--widths", default="2,4,6")
    ap.add_argument("--block-sizes", default="16", help="comma separated; the first is plotted")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-independent", action="store_true",
                    help="skip the parallel-sampling run without sharing")
    ap.add_argument("--out", default=None, help="JSON results (default benchmarks/results/...)")
    ap.add_argument("--figure", default=None, help="PNG (default figures/sharing_savings.png "
                                                   "for the CPU run)")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)  # stories260K is too small for a second thread on 2 shared cores
    rows = []
    for bs in [int(b) for b in args.block_sizes.split(",")]:
        for kind in ("parallel", "beam"):
            for w in [int(x) for x in args.widths.split(",")]:
                t0 = time.perf_counter()
                r = sharing_experiment(kind, w, num_requests=args.num_requests, block_size=bs,
                                       seed=args.seed, model=args.model, device=args.device,
                                       independent=not args.no_independent)
                print(f"{kind:8s} width {w} block {bs:3d}: saving {r.saving:.1%} "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
                rows.append(r)
    print()
    print(format_savings(rows))
    tag = f"{args.model.replace(':', '_').replace('/', '_').lower()}_{args.device}"
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"sharing_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": [asdict(r) | {
        "measured_saving": r.measured_saving} for r in rows]}, indent=1))
    print(f"\nwrote {out}")
    fig = Path(args.figure) if args.figure else (ROOT / "figures" / "sharing_savings.png"
                                                if args.model == "stories260K" else None)
    if fig is not None:
        import matplotlib
        matplotlib.use("Agg")
        plot_savings(rows).savefig(fig, dpi=110)
        print(f"wrote {fig}")
    return rows


if __name__ == "__main__":
    main()
