"""What lesson 13 (serving under load) imports: the paper's regime, its figures, small runs.

The simulator (minipaged/simulator/) does the work; this module holds the settings the lesson,
benchmarks/experiments/serving_load/paper_curve.py and the README share, and draws their pictures.

* The vLLM paper's memory regime (its Fig. 12 served OPT-13B on one A100-40GB): about 12 GB of
  the GPU holds KV cache, at 800 KB per token (2 x 40 layers x 5120 x 2 bytes), so about 14,600
  token slots, with `max_model_len` 2048.
* `a100_opt13b_cost`: step costs from the A100's roofline, not a measurement: a step reads the
  26 GB of weights once (16.7 ms at 1.555 TB/s), each token costs 2 x 13e9 FLOPs at half of the
  312 TFLOP/s peak (0.17 ms), and a decode reads 800 KB of K/V per token of context (0.53 us).
  On it the memory a request holds decides how many share a step, as on the paper's GPU; on a
  CPU (the fitted stories260K model) per-token work dominates a step and batching buys less.
"""
from __future__ import annotations

from typing import Optional

from minipaged.simulator.cost_model import StepCostModel, synthetic
from minipaged.simulator.sweep import LABELS, PAPER_RATIOS

PAPER_KV_CAPACITY = 14_600  # token slots: ~12 GB of KV at 800 KB per token (OPT-13B, A100-40GB)
PAPER_MAX_MODEL_LEN = 2048
STYLES = {"paged": ("o-", "C0"), "orca-oracle": ("s--", "C1"), "orca-pow2": ("^--", "C2"),
          "orca-max": ("v--", "C3"), "static": ("x:", "C7")}


def a100_opt13b_cost() -> StepCostModel:
    """Stated A100 step costs for OPT-13B (see the docstring): 16.7 ms a step, 0.17 ms a token,
    0.53 us per decode context token."""
    return synthetic(step_ms=16.7, token_us=167.0, ctx_ns=530.0,
                     source="A100-40GB roofline for OPT-13B (stated, not measured)")


def plot_paper_curves(results: dict[str, dict], path: Optional[str] = None, ymax: float = None,
                      title: str = ""):
    """One panel per dataset: mean normalized latency against the request rate for every
    system (`paper_curves` results keyed by dataset), the shared threshold dashed, each
    capacity marked."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6.2 * len(results), 4.2), squeeze=False)
    for ax, (dataset, res) in zip(axes[0], results.items()):
        top = ymax or 6 * res["threshold_s"]
        for system, d in res["systems"].items():
            style, color = STYLES[system]
            pts = sorted(d["points"], key=lambda p: p["request_rate"])
            ax.plot([p["request_rate"] for p in pts],
                    [p["mean_normalized_latency_s"] for p in pts], style, color=color,
                    label=LABELS[system] + (f": {d['paged_capacity_ratio']:.1f}x less"
                                            if d.get("paged_capacity_ratio") and system != "paged"
                                            else ""))
            if d.get("capacity_rate"):
                ax.axvline(d["capacity_rate"], color=color, lw=0.6, alpha=0.5)
        ax.axhline(res["threshold_s"], color="k", ls=":", lw=0.8, label="knee threshold")
        ax.set(xlabel="request rate (req/s)", ylabel="normalized latency (s/token)",
               ylim=(0, top), xscale="log", title=f"{dataset}-like lengths")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7.5, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def ratio_table(results: dict[str, dict]) -> str:
    """Markdown: each system's capacity and paged's ratio over it, beside the paper's."""
    rows = ["| lengths | system | capacity (req/s) | paged / it | paper (Fig. 12) |",
            "|---|---|---:|---:|---|"]
    for dataset, res in results.items():
        for system, d in res["systems"].items():
            cap, r = d.get("capacity_rate"), d.get("paged_capacity_ratio")
            lo, hi = PAPER_RATIOS.get(system, (None, None))
            paper = (f"{lo}-{hi}x" if lo else f"up to {hi}x" if hi else "")
            rows.append(f"| {dataset} | {LABELS[system]} | {cap:.2f} | "
                        f"{'-' if system == 'paged' or r is None else f'{r:.2f}x'} | "
                        f"{paper if dataset == 'sharegpt' else ''} |" if cap else
                        f"| {dataset} | {LABELS[system]} | - | - | |")
    return "\n".join(rows)


# --- the lesson's small experiments ------------------------------------------------------------
def itl_ms(result, percentiles=(50, 99)) -> dict:
    """Inter-token latency percentiles of a simulated run: every decode in a step waits that
    step's duration for its token, so the gaps are the step durations, one per decode."""
    import numpy as np
    gaps = [s.duration for s in result.steps for e in s.scheduled if e[2]]
    return {f"p{p}": float(np.percentile(gaps, p) * 1e3) for p in percentiles}


def class_summary(result, priorities: dict[str, int]) -> dict[int, dict]:
    """Mean and p99 TTFT (ms) and mean normalized latency per priority class of a run."""
    import numpy as np
    out = {}
    for p in sorted(set(priorities.values())):
        rs = [r for r in result.requests if priorities[r.request_id] == p]
        ttft = np.array([r.ttft for r in rs]) * 1e3
        out[p] = {"requests": len(rs), "mean_ttft_ms": float(ttft.mean()),
                  "p99_ttft_ms": float(np.percentile(ttft, 99)),
                  "mean_normalized_latency_s": float(np.mean([r.normalized_latency
                                                              for r in rs]))}
    return out


def plot_arrivals(series: dict[str, list[float]], ax=None):
    """One row of arrival ticks per process (label -> arrival times)."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(9, 1.8))[1]
    for i, (label, times) in enumerate(series.items()):
        ax.eventplot(times, lineoffsets=i, linelengths=0.7)
    ax.set_yticks(range(len(series)), list(series))
    ax.set_xlabel("seconds")
    return ax
