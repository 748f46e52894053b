"""Normalized latency against request rate, the knee, and capacity ratios (lesson 13).

The vLLM paper's Fig. 12: for each system, requests arrive as a Poisson process at a rate, and
the mean normalized latency (end-to-end latency / output tokens) stays nearly flat until the
rate approaches what the system can sustain, then shoots up as the queue grows without bound.
The *knee* is where it leaves the flat part; the paper reads capacity there ("vLLM sustains
1.7x-2.7x higher request rates than Orca (Oracle) ... up to 22x than FasterTransformer").

Here every system runs on the virtual clock (clock.py) with the same cost model, the same KV
capacity in token slots, the same token budget and seats, and the same requests:

    paged         minipaged: blocks on demand (block_size 16), recompute preemption
    orca-oracle   contiguous regions of exactly prompt + output - 1 slots (admission.py)
    orca-pow2     ... rounded up to a power of two
    orca-max      ... of max_model_len slots
    static        request-level batches (FasterTransformer), max_model_len slots each

Prefix caching is off for all of them (the paper's setting; the prompts share nothing anyway).
`capacity_rate` finds where a system's curve crosses a latency threshold (linear interpolation
in log rate between the two sweep points around it); `knee_threshold` is the shared threshold:
`factor` times the paged engine's normalized latency at its lowest rate, so every system is
judged at the same latency.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence as Seq

from minipaged.benchmark.serving import arrival_offsets
from minipaged.simulator.admission import ReservationAdmission, StaticBatching
from minipaged.engine.build import compose
from minipaged.engine.scheduler import Scheduler
from minipaged.simulator.clock import requests_from_workload, simulate
from minipaged.simulator.cost_model import StepCostModel

SYSTEMS = ("paged", "orca-oracle", "orca-pow2", "orca-max", "static")
LABELS = {"paged": "minipaged (paged)", "orca-oracle": "Orca (Oracle)", "orca-pow2": "Orca (Pow2)",
          "orca-max": "Orca (Max)", "static": "static batching (FasterTransformer)"}
# The paper's Fig. 12 reading (Kwon et al., SOSP 2023), capacity ratio of vLLM over each.
PAPER_RATIOS = {"orca-oracle": (1.7, 2.7), "static": (None, 22.0)}


def system_knobs(system: str, kv_capacity: int, max_model_len: int, *, block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048) -> dict:
    """`simulate` keywords for `system` with a KV cache of `kv_capacity` token slots."""
    knobs = dict(block_size=block_size, max_num_seqs=max_num_seqs,
                 max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
                 num_blocks=kv_capacity // block_size)
    if system == "paged":
        return knobs
    # A reserved request never outgrows its region; its blocks' rounding gets headroom.
    knobs["num_blocks"] += max_num_seqs
    if system == "static":  # a batch is prefilled at once, as FasterTransformer does
        knobs["max_num_batched_tokens"] = max(max_num_batched_tokens, max_num_seqs * max_model_len)
        return knobs | dict(base=compose(Scheduler, (StaticBatching,)), scheduler_kwargs=dict(
            kv_capacity=kv_capacity, max_model_len=max_model_len))
    if system.startswith("orca-"):
        return knobs | dict(base=compose(Scheduler, (ReservationAdmission,)), scheduler_kwargs=dict(
            reservation=system[5:], kv_capacity=kv_capacity, max_model_len=max_model_len))
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")


def run(system: str, workload, rate: float, cost: StepCostModel, *, kv_capacity: int,
        max_model_len: int, seed: int = 0, **engine) -> dict:
    """One simulated run at `rate` (requests/s; inf: all at once); its summary."""
    reqs = requests_from_workload(workload, arrival_offsets(len(workload.prompts), rate,
                                                            seed=seed))
    res = simulate(reqs, cost, max_model_len=max_model_len, record_steps=False,
                   **system_knobs(system, kv_capacity, max_model_len, **engine))
    return {"request_rate": rate, "num_preemptions": res.num_preemptions, **res.summary()}


def saturation_rate(system: str, workload, cost: StepCostModel, **kw) -> float:
    """Requests/s the system completes with every request queued at once (a first guess of
    its capacity: the run's tail, a few long requests alone, pulls it down)."""
    return run(system, workload, math.inf, cost, **kw)["request_throughput"]


def sweep(system: str, workload, cost: StepCostModel, rates: Seq[float], **kw) -> list[dict]:
    return [run(system, workload, r, cost, **kw) for r in rates]


def capacity_rate(points: list[dict], threshold: float,
                  key: str = "mean_normalized_latency_s") -> Optional[float]:
    """The rate at which the curve first crosses `threshold` (None: it never does in the
    sweep, or it starts above it)."""
    pts = sorted(points, key=lambda p: p["request_rate"])
    if not pts or pts[0][key] > threshold:
        return None
    for a, b in zip(pts, pts[1:]):
        if b[key] > threshold:
            la, lb = math.log(a["request_rate"]), math.log(b["request_rate"])
            f = (threshold - a[key]) / (b[key] - a[key])
            return math.exp(la + f * (lb - la))
    return None


def knee_threshold(paged_points: list[dict], factor: float = 4.0,
                   key: str = "mean_normalized_latency_s") -> float:
    return factor * min(paged_points, key=lambda p: p["request_rate"])[key]


def paper_curves(workload, cost: StepCostModel, *, kv_capacity: int, max_model_len: int,
                 systems: Seq[str] = SYSTEMS,
                 fractions: Seq[float] = (0.1, 0.25, 0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6),
                 factor: float = 4.0, seed: int = 0, max_extra: int = 8, progress=None,
                 **engine) -> dict:
    """Every system's curve (paged first: it sets the shared threshold), each swept at
    `fractions` of its own saturation rate and then, where the curve has not crossed the
    threshold yet, further up (x1.5 at a time) or, where it starts above it, further down (/2),
    at most `max_extra` more points; each capacity and paged's ratio over it."""
    kw = dict(kv_capacity=kv_capacity, max_model_len=max_model_len, seed=seed, **engine)
    order = ["paged"] + [s for s in systems if s != "paged"]
    out: dict = {"systems": {}}
    threshold = None
    key = "mean_normalized_latency_s"
    for system in order:
        sat = saturation_rate(system, workload, cost, **kw)
        pts = sweep(system, workload, cost, [f * sat for f in fractions], **kw)
        if threshold is None:
            threshold = knee_threshold(pts, factor, key)
        for _ in range(max_extra):
            pts.sort(key=lambda p: p["request_rate"])
            if pts[0][key] > threshold:
                pts.append(run(system, workload, pts[0]["request_rate"] / 2, cost, **kw))
            elif pts[-1][key] <= threshold:
                pts.append(run(system, workload, pts[-1]["request_rate"] * 1.5, cost, **kw))
            else:
                break
        pts.sort(key=lambda p: p["request_rate"])
        out["systems"][system] = {"label": LABELS[system], "saturation_rate": sat, "points": pts}
        if progress is not None:
            progress(system, sat)
    out["threshold_s"] = threshold
    out["threshold_rule"] = (f"{factor:g} x the paged engine's mean normalized latency at its "
                             f"lowest rate ({min(fractions):g} of its saturation)")
    base = capacity_rate(out["systems"]["paged"]["points"], threshold, key)
    for system, d in out["systems"].items():
        d["capacity_rate"] = cap = capacity_rate(d["points"], threshold, key)
        d["paged_capacity_ratio"] = base / cap if base and cap else None
    return out
