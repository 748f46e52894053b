"""The vLLM paper's Fig. 12 on the virtual clock: normalized latency against request rate for
paged minipaged, reservation-based admission (Orca Max / Pow2 / Oracle) and static batching,
on ShareGPT-like and Alpaca-like lengths, and the capacity ratio at the knee.

    python benchmarks/experiments/serving_load/paper_curve.py                  # ~15 minutes on 2 CPU cores
    python benchmarks/experiments/serving_load/paper_curve.py --num-requests 300 --cost cpu

Every system runs in minipaged's simulator (minipaged/simulator/: the real scheduler and
block manager, admission policies as scheduler mixins) with the paper's memory regime: 14,600
KV token slots and max_model_len 2048 (OPT-13B on one A100-40GB; lessons/serving_load.py says
where the numbers come from), max_num_seqs 256, a 2048-token step budget, no prefix caching, the
same Poisson arrivals (seed 0) and lengths drawn with the paper's means (ShareGPT 161 in / 338
out, Alpaca 19 / 58; exponential, clipped to max_model_len). Step costs come from `--cost`:

    a100   the A100 roofline for OPT-13B (stated, not measured): 16.7 ms a step + 0.17 ms a
           token + 0.53 us per decode context token
    cpu    the model fitted to stories260K on this machine's CPU (simulator_validation.py's JSON)
    both   both, one after the other (the default)

Each system is swept around its own saturation rate (every request queued at once); its
capacity is where its mean normalized latency crosses a threshold shared by all systems, 4x the
paged engine's at its lowest rate (a tenth of its saturation), interpolated in log rate. The
ratio "paged / X" is paged's capacity over X's; the paper reads 1.7-2.7x over Orca (Oracle) and
up to 22x over FasterTransformer on ShareGPT. Writes benchmarks/results/paper_curve_sim.json
and figures/paper_curve_sim_<cost>.png.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from minipaged.benchmark.throughput import make_workload  # noqa: E402
from minipaged.lessons.serving_load import (PAPER_KV_CAPACITY, PAPER_MAX_MODEL_LEN,  # noqa: E402
                                            a100_opt13b_cost, plot_paper_curves, ratio_table)
from minipaged.simulator import StepCostModel  # noqa: E402
from minipaged.simulator.sweep import SYSTEMS, paper_curves  # noqa: E402

VALIDATION = ROOT / "benchmarks" / "results" / "simulator_validation_cpu_stories260k.json"


def cost_model(name: str) -> StepCostModel:
    if name == "a100":
        return a100_opt13b_cost()
    if not VALIDATION.exists():
        raise SystemExit(f"--cost cpu needs {VALIDATION.relative_to(ROOT)}: run "
                         "benchmarks/experiments/serving_load/simulator_validation.py first")
    return StepCostModel.from_dict(json.loads(VALIDATION.read_text())["cost_model"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", default="sharegpt:1000,alpaca:3000",
                    help="per dataset (Alpaca's requests are short: a queue needs more of them "
                         "to build up past the knee)")
    ap.add_argument("--datasets", default="sharegpt,alpaca")
    ap.add_argument("--cost", default="both", choices=("a100", "cpu", "both"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "paper_curve_sim.json"))
    a = ap.parse_args(argv)
    t0 = time.time()
    report = {"what": __doc__.split("\n\n")[0], "num_requests": a.num_requests,
              "kv_capacity_slots": PAPER_KV_CAPACITY, "max_model_len": PAPER_MAX_MODEL_LEN,
              "max_num_seqs": 256, "max_num_batched_tokens": 2048, "block_size": 16,
              "systems": list(SYSTEMS), "by_cost_model": {}}
    for name in (("a100", "cpu") if a.cost == "both" else (a.cost,)):
        cost = cost_model(name)
        results = {}
        counts = dict((k, int(v)) for k, v in (x.split(":") for x in a.num_requests.split(",")))
        for dataset in a.datasets.split(","):
            wl = make_workload(dataset, 32000, num_requests=counts[dataset], seed=0,
                               max_model_len=PAPER_MAX_MODEL_LEN)
            print(f"[{time.time() - t0:5.0f} s] {name} cost, {dataset}: {len(wl.prompts)} "
                  f"requests, mean {wl.num_prompt_tokens / len(wl.prompts):.0f} in / "
                  f"{sum(wl.max_tokens) / len(wl.prompts):.0f} out", flush=True)
            results[dataset] = paper_curves(
                wl, cost, kv_capacity=PAPER_KV_CAPACITY, max_model_len=PAPER_MAX_MODEL_LEN,
                progress=lambda s, sat: print(f"[{time.time() - t0:5.0f} s]   {s}: saturates at "
                                              f"{sat:.2f} req/s", flush=True))
        print(ratio_table(results), flush=True)
        fig = ROOT / "figures" / f"paper_curve_sim_{name}.png"
        plot_paper_curves(results, str(fig), title=f"simulated, step costs: {cost.source}")
        report["by_cost_model"][name] = {"cost_model": cost.to_dict(), "results": results,
                                         "table": ratio_table(results)}
        Path(a.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {fig.relative_to(ROOT)} and {a.out}", flush=True)
    report["seconds"] = time.time() - t0
    Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
