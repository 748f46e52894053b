"""Single charts of numbers: throughput, a decode step's time, KV cache size, sampling stages.

`plot_throughput` (tokens/s against a baseline, lessons 00, 03 and 08), `plot_decode_breakdown`
(where a GPU decode step's milliseconds go, lesson 08 and `benchmarks/plot.py decode_breakdown`),
`plot_kv_cache_size` (GiB of KV cache against tokens, lesson 00), and `sampling_stages` /
`plot_token_distributions` (probabilities after temperature, top-k, top-p and min-p, lesson 04).
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import matplotlib.pyplot as plt

from minipaged.lessons.viz.common import CATEGORY_COLORS, _figure


# --- throughput -------------------------------------------------------------------------------
def plot_throughput(results, baseline: Optional[str] = None, ax=None, title: Optional[str] = None,
                    note: str = ""):
    """Horizontal bars of output tokens/s, each labelled with its ratio to `baseline`.

    `results`: {name: tokens_per_sec}, or objects with `.tokens_per_sec` and `.name` /
    `.backend` (`BaselineResult`, `BenchResult`).
    """
    if not isinstance(results, Mapping):
        results = {getattr(r, "backend", None) or r.name: r.tokens_per_sec for r in results}
    names = list(results)
    vals = [results[n] for n in names]
    base = results.get(baseline) if baseline else None
    fig, ax, own = _figure(ax, (7, 0.5 * len(names) + 1.3))
    colors = ["#2b8cbe" if n.startswith("minipaged") else "0.6" for n in names]
    ax.barh(range(len(names)), vals, color=colors)
    for i, v in enumerate(vals):
        txt = f"{v:,.0f} tok/s" + (f"  ({v / base:.2f}x)" if base else "")
        ax.text(v, i, " " + txt, va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(vals) * 1.45 if vals else 1)
    ax.set_xlabel("output tokens / s")
    ax.set_title(title or "Throughput" + (f" (ratios vs {baseline})" if base else ""), fontsize=10)
    if note:
        ax.text(0, -0.25, note, transform=ax.transAxes, fontsize=7, color="0.3", va="top")
    if own:
        fig.tight_layout()
    return fig


# --- lesson 08: where a GPU decode step goes ---------------------------------------------------
DECODE_PARTS = [("attention", "tab:blue"), ("matmul", "tab:orange"),
                ("norm/rope/silu", "tab:green"), ("sampler", "tab:purple"), ("other", "tab:gray")]


def plot_decode_breakdown(data: Mapping):
    """Two panels from `benchmarks/experiments/decode_step/decode_breakdown.py`'s JSON: ms per
    decode step stacked by kernel family plus GPU idle time, at each measured point of the run;
    and attention's achieved read rate against a plain streaming read on the same GPU."""
    rows = data["rows"]
    labels = [f"step {r['decode_step']}\n{r['running']} seqs" for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    bottom = [0.0] * len(rows)
    for name, color in DECODE_PARTS:
        vals = [r["ms"][name] for r in rows]
        ax.bar(labels, vals, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar(labels, [r["idle_ms"] for r in rows], bottom=bottom, color="white", edgecolor="black",
           hatch="//", label="GPU idle (launch gaps, host)")
    for i, r in enumerate(rows):
        ax.text(i, r["wall_ms"] * 1.01, f"{r['wall_ms']:.1f} ms", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per decode step (CUDA graphs on)")
    ax.set_title(f"Where a decode step goes: {data['model'].replace('dummy:', '')}, "
                 f"nano-vllm workload, {data['gpu']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    ax.tick_params(axis="x", labelsize=7)
    ceiling = data["read_ceiling"]["triton_read_tbs"]
    ax2.plot([r["running"] for r in rows], [r["attention_tbs"] for r in rows], "o-",
             label="attention (K+V of every context)")
    ax2.axhline(ceiling, color="k", ls="--", label=f"plain streaming read {ceiling:.2f}")
    ax2.axhline(4.8, color="gray", ls=":", label="datasheet 4.8")
    ax2.set_xlabel("running sequences")
    ax2.set_ylabel("TB/s")
    ax2.set_ylim(0, 5.2)
    ax2.invert_xaxis()
    ax2.set_title("attention's read rate as the batch shrinks", fontsize=9)
    ax2.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


# --- lesson 00: how big the KV cache is -------------------------------------------------------
def plot_kv_cache_size(models: Mapping[str, int], max_tokens: int = 131072,
                       budget_gib: Optional[float] = None, ax=None, title: Optional[str] = None):
    """KV cache GiB vs tokens, for {name: bytes per token}; optionally a memory budget line.

    Both axes are logarithmic, so with a budget each model's crossing is marked and labelled
    with the number of tokens that fit (`budget / bytes per token`); a crossing beyond the
    chart is named in the legend instead."""
    fig, ax, own = _figure(ax, (7, 3.4))
    xs = [2 ** k for k in range(4, int(math.log2(max_tokens)) + 1)]
    for name, bpt in models.items():
        ys = [x * bpt / 2 ** 30 for x in xs]
        label = f"{name}: {bpt / 1024:.2f} KiB/token"
        fits = budget_gib * 2 ** 30 / bpt if budget_gib is not None else None
        if fits is not None and fits > xs[-1]:
            label += f" (fits {fits:,.0f} tokens: off the chart)"
        (line,) = ax.plot(xs, ys, "o-", markersize=3, label=label)
        ax.annotate(f"{ys[-1]:.2f} GiB at {xs[-1]:,}", (xs[-1], ys[-1]), textcoords="offset points",
                    xytext=(-10, 0), ha="right", va="center", fontsize=7,
                    bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1))
        if fits is not None and xs[0] <= fits <= xs[-1]:
            color = line.get_color()
            ax.axvline(fits, color=color, linestyle=":", linewidth=1)
            ax.plot([fits], [budget_gib], "D", color=color, markersize=6, zorder=5)
            ax.annotate(f"{fits:,.0f} tokens fit\n({budget_gib:.2f} GiB / {bpt / 1024:.0f} KiB)",
                        (fits, budget_gib), textcoords="offset points", xytext=(-12, -14),
                        ha="right", va="top", fontsize=8, color=color,
                        bbox=dict(facecolor="white", edgecolor=color, alpha=0.9, pad=2))
    if budget_gib is not None:
        ax.axhline(budget_gib, color=CATEGORY_COLORS["internal_fragmentation"], linestyle="--",
                   label=f"KV memory available: {budget_gib:.2f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the cache (summed over all sequences; log scale)")
    ax.set_ylabel("KV cache (GiB, log scale)")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    ax.set_title(title or "KV cache = 2 × layers × kv_heads × head_dim × bytes × tokens",
                 fontsize=10)
    if own:
        fig.tight_layout()
    return fig


# --- lesson 04: sampling ----------------------------------------------------------------------
def sampling_stages(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0):
    """Probabilities after each stage of `minipaged.sampling` for one row of logits.

    Returns {stage name: probabilities (vocab,)}; the masking is
    `minipaged.sampling.apply_top_k_top_p_min_p`, the function the `Sampler` calls.
    """
    import torch

    from minipaged.sampling import apply_top_k_top_p_min_p
    x = logits.float().reshape(1, -1)
    out = {"raw (T=1)": x.softmax(-1)[0]}
    scaled = x / max(temperature, 1e-5)
    out[f"temperature {temperature:g}"] = scaled.softmax(-1)[0]
    one = lambda v, dt: torch.tensor([v], dtype=dt)  # noqa: E731
    if top_k:
        out[f"top_k {top_k}"] = apply_top_k_top_p_min_p(scaled, one(top_k, torch.long),
                                                        one(1.0, torch.float), one(0.0, torch.float)
                                                        ).softmax(-1)[0]
    if top_p < 1.0:
        out[f"top_p {top_p:g}"] = apply_top_k_top_p_min_p(scaled, one(0, torch.long),
                                                          one(top_p, torch.float),
                                                          one(0.0, torch.float)).softmax(-1)[0]
    if min_p > 0.0:
        out[f"min_p {min_p:g}"] = apply_top_k_top_p_min_p(scaled, one(0, torch.long),
                                                          one(1.0, torch.float),
                                                          one(min_p, torch.float)).softmax(-1)[0]
    return out


def plot_token_distributions(stages: Mapping[str, "object"], token_labels: Sequence[str],
                             top: int = 20, title: str = "", raw=None):
    """One bar chart per stage over the `top` most likely raw tokens.

    Dotted outlines: `raw`, the model's own probabilities (T = 1); by default the stage whose
    name starts with "raw" (`sampling_stages` puts it first). Without either, no outline is drawn
    and the tokens are ordered by the first stage: a stage is never passed off as the raw
    distribution. A red × marks a token the stage masked out.
    """
    import torch
    names = list(stages)
    if raw is None:
        raw = next((stages[n] for n in names if n.startswith("raw")), None)
    ref = raw if raw is not None else stages[names[0]]
    order = torch.argsort(ref, descending=True)[:top].tolist()
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.35 * len(names) + 0.9), sharex=True)
    axes = [axes] if len(names) == 1 else list(axes)
    outlined = False
    for ax, name in zip(axes, names):
        p = stages[name]
        vals = [float(p[i]) for i in order]
        kept = int((p > 0).sum())
        ax.bar(range(len(order)), vals, color=["#2b8cbe" if v > 0 else "none" for v in vals],
               zorder=2)
        top_y = max(vals)
        if raw is not None and not name.startswith("raw"):
            raw_vals = [float(raw[i]) for i in order]
            ax.bar(range(len(order)), raw_vals, color="none", edgecolor="0.2", linestyle=":",
                   linewidth=1.0, zorder=3, label=None if outlined else "raw p (T = 1)")
            if not outlined:
                ax.legend(fontsize=7, loc="upper right", frameon=False)
            outlined = True
            top_y = max(top_y, max(raw_vals))
        for i, v in enumerate(vals):
            if v == 0:
                ax.text(i, 0, "×", ha="center", va="bottom", fontsize=8, color="#d7191c")
        ax.set_ylabel("p", fontsize=8)
        ent = float(-(p[p > 0] * p[p > 0].log()).sum())
        ax.set_title(f"{name}: {kept} tokens can be drawn, entropy {ent:.2f} nats", fontsize=9,
                     loc="left")
        ax.set_ylim(0, max(top_y, 1e-3) * 1.15)
    axes[-1].set_xticks(range(len(order)), [repr(token_labels[i])[1:-1] for i in order],
                        rotation=60, fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# --- lesson 07: the served path beside the offline engine ------------------------------------
def serve_vs_offline_rows(runs: Sequence[tuple[str, Mapping]], concurrency: int = 256) -> list:
    """(label, offline tok/s, [served tok/s of each run at `concurrency`]) per serve_load JSON
    (`benchmarks/serve_load.py --offline`: both sides measured in the same invocation)."""
    rows = []
    for label, data in runs:
        offline = data["offline"]["batch"]["output_tokens_per_sec"]  # (the median of repeats)
        served = [lv["output_tokens_per_sec"] for lv in data["levels"]
                  if lv["concurrency"] == concurrency]
        rows.append((label, offline, served))
    return rows


def plot_serve_vs_offline(rows: Sequence[tuple[str, float, Sequence[float]]], title: str,
                          ax=None):
    """Bars: the offline engine's output tok/s and the server's (every run), per server design,
    with the served / offline ratio written on top."""
    fig, ax, own = _figure(ax, (8.5, 3.8))
    x = list(range(len(rows)))
    ax.bar([i - 0.2 for i in x], [r[1] for r in rows], width=0.38, color="#bdbdbd",
           label="offline engine (same run)")
    for i, (_, offline, served) in enumerate(rows):
        for j, s in enumerate(served):
            ax.bar(i + 0.2 - 0.19 + (j + 0.5) * 0.38 / len(served), s, width=0.38 / len(served),
                   color="#3182bd", label="minipaged serve" if i == j == 0 else None)
        mid = sorted(served)[len(served) // 2]
        ax.text(i + 0.2, max(served) * 1.02, f"{mid / offline:.2f}x", ha="center", fontsize=9)
    ax.set_xticks(x, [r[0] for r in rows], fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(0, 1.3 * max(max(r[1], *r[2]) for r in rows))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    if own:
        fig.tight_layout()
    return fig
