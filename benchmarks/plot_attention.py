"""Render figures/attention_bandwidth.png from benchmarks/results/attention_h200.json.

    python benchmarks/plot_attention.py [--json PATH] [--out PATH]

Runs anywhere (matplotlib only): the numbers come from the H200 run of benchmarks/attention.py.
Left: decode bandwidth (back-to-back calls) per batch x context for the paged Triton kernel, SDPA
and FlexAttention on contiguous K/V. Right: causal prefill TFLOP/s.
"""
from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
COLORS = {"triton": "#1f77b4", "sdpa": "#ff7f0e", "flex": "#2ca02c"}
LABELS = {"triton": "minipaged Triton (paged)", "sdpa": "SDPA (contiguous)",
          "flex": "FlexAttention (contiguous)"}


def plot(result: dict, out: str) -> None:
    decode = [r for r in result["rows"] if r["kind"] == "decode"]
    prefill = [r for r in result["rows"] if r["kind"] == "prefill"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [2.3, 1]})
    width = 0.27
    for i, name in enumerate(("triton", "sdpa", "flex")):
        xs = [j + (i - 1) * width for j, r in enumerate(decode) if f"{name}_b2b_tbs" in r]
        ys = [r[f"{name}_b2b_tbs"] for r in decode if f"{name}_b2b_tbs" in r]
        ax1.bar(xs, ys, width, color=COLORS[name], label=LABELS[name])
    ax1.axhline(result["peak_tbs"], color="gray", ls="--", lw=1)
    ax1.text(-0.6, result["peak_tbs"] + 0.04, f"{result['peak_tbs']} TB/s (H200 copy)",
             ha="left", va="bottom", fontsize=7, color="gray")
    ax1.set_xticks(range(len(decode)))
    ax1.set_xticklabels([f"{r['batch']}x{r['context'] // 1024 or r['context']}"
                         f"{'k' if r['context'] >= 1024 else ''}" for r in decode], fontsize=8)
    ax1.set_xlabel("decode: batch x context (tokens)")
    ax1.set_ylabel("TB/s of K+V+Q+O")
    ax1.set_ylim(0, result["peak_tbs"] * 1.25)
    ax1.legend(fontsize=8, loc="upper left", ncol=3, frameon=False)
    ax1.set_title("Decode bandwidth (back-to-back calls)", fontsize=10)
    for i, name in enumerate(("triton", "sdpa", "flex")):
        xs = [j + (i - 1) * width for j, r in enumerate(prefill) if f"{name}_tflops" in r]
        ys = [r[f"{name}_tflops"] for r in prefill if f"{name}_tflops" in r]
        ax2.bar(xs, ys, width, color=COLORS[name])
    ax2.set_xticks(range(len(prefill)))
    ax2.set_xticklabels([r["name"].replace(" on ", "\non ") for r in prefill], fontsize=7)
    ax2.set_ylabel("TFLOP/s (causal)")
    ax2.set_title("Prefill", fontsize=10)
    fig.suptitle(f"Paged attention, Qwen3-0.6B shapes (16 q / 8 KV heads x 128, bf16, block 16) "
                 f"on {result['gpu']}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results",
                                                   "attention_h200.json"))
    ap.add_argument("--out", default=os.path.join(ROOT, "figures", "attention_bandwidth.png"))
    args = ap.parse_args()
    with open(args.json) as f:
        plot(json.load(f), args.out)
    print(f"wrote {os.path.normpath(args.out)} ({os.path.getsize(args.out) // 1024} KB)")


if __name__ == "__main__":
    main()
