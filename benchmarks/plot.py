"""Draw the benchmark figures in figures/ from the stored JSON (runs anywhere: matplotlib only).

    python benchmarks/plot.py                          # every figure whose JSON is stored
    python benchmarks/plot.py attention serve_load     # some of them
    python benchmarks/plot.py tp_scaling --json A.json B.json --out figures/x.png

| figure | reads (benchmarks/...) | written by | draws |
|---|---|---|---|
| attention | results/attention_h200.json | attention.py | figures/attention_bandwidth.png |
| throughput | results/nanovllm_h200_*.json | nanovllm_h200.sh | figures/throughput_h200.png |
| decode_breakdown | experiments/decode_step/decode_breakdown_h200.json | experiments/decode_step/decode_breakdown.py | figures/decode_breakdown_h200.png |
| serve_load | results/serve_load_h200_qwen3-0.6b*.json | serve_load.py --offline | figures/serve_vs_offline_h200.png |
| tp_scaling | results/tp_scaling_h200x*.json | tp_scaling.py | figures/tp_scaling_h200.png |

`--json` and `--out` replace one named figure's inputs and output. The pictures of lessons 07
and 08 are the same `minipaged.lessons.viz` functions the serve_load and decode_breakdown
figures use; the others are drawn here.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ROOT / "figures"


def _save(fig, out: Path, dpi: int, **kw) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, **kw)
    plt.close(fig)
    print(f"wrote {out} ({out.stat().st_size // 1024} KB)")


# --- attention: the paged kernels beside SDPA and FlexAttention (attention.py) -----------------
ATTN_COLORS = {"triton": "#1f77b4", "sdpa": "#ff7f0e", "flex": "#2ca02c"}
ATTN_LABELS = {"triton": "minipaged Triton (paged)", "sdpa": "SDPA (contiguous)",
               "flex": "FlexAttention (contiguous)"}


def plot_attention(result: dict):
    """Left: decode bandwidth (back-to-back calls) per batch x context; right: prefill TFLOP/s."""
    decode = [r for r in result["rows"] if r["kind"] == "decode"]
    prefill = [r for r in result["rows"] if r["kind"] == "prefill"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [2.3, 1]})
    width = 0.27
    for i, name in enumerate(("triton", "sdpa", "flex")):
        xs = [j + (i - 1) * width for j, r in enumerate(decode) if f"{name}_b2b_tbs" in r]
        ys = [r[f"{name}_b2b_tbs"] for r in decode if f"{name}_b2b_tbs" in r]
        ax1.bar(xs, ys, width, color=ATTN_COLORS[name], label=ATTN_LABELS[name])
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
        ax2.bar(xs, ys, width, color=ATTN_COLORS[name])
    ax2.set_xticks(range(len(prefill)))
    ax2.set_xticklabels([r["name"].replace(" on ", "\non ") for r in prefill], fontsize=7)
    ax2.set_ylabel("TFLOP/s (causal)")
    ax2.set_title("Prefill", fontsize=10)
    fig.suptitle(f"Paged attention, Qwen3-0.6B shapes (16 q / 8 KV heads x 128, bf16, block 16) "
                 f"on {result['gpu']}", fontsize=10)
    fig.tight_layout()
    return fig


def attention(paths: list[Path], out: Path) -> None:
    _save(plot_attention(json.loads(paths[0].read_text())), out, dpi=90)


# --- throughput: the nano-vllm workload, minipaged beside the HF baselines (nanovllm_h200.sh) ---
ORDER = ["minipaged", "hf-cb", "hf-static", "hf-sequential"]
BACKEND_COLORS = {"minipaged": "tab:green", "hf-cb": "tab:orange", "hf-static": "tab:blue",
                  "hf-sequential": "tab:gray"}
MODEL_ORDER = {"qwen3-0.6b": 0, "qwen3-0.6b\n(fp8 KV cache)": 1, "qwen2.5-0.5b": 2, "llama-3.2-1b": 3}


def load_throughput(paths):
    runs = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        rows = {r["backend"]: r for r in d["results"]}
        name = d["model"].replace("dummy:", "")
        if "--kv-cache-dtype fp8" in d.get("command", ""):
            name += "\n(fp8 KV cache)"
        runs.append((name, rows, d["environment"].get("gpu", "GPU")))
    return sorted(runs, key=lambda r: MODEL_ORDER.get(r[0], 9))


def legend_label(backend: str, r: dict) -> str:
    """What the bar measured: how many requests, at what batch size (the HF modes ran on the
    first requests only, `--hf-max-requests`)."""
    n, toks = r["num_requests"], r["output_tokens"]
    if backend == "minipaged":
        return f"minipaged: all {n} requests ({toks:,} tokens)"
    what = {"hf-static": f"hf-static, padded batches of {r['concurrency']} (the one size run)",
            "hf-cb": "hf-cb (transformers' continuous batching)",
            "hf-sequential": "hf-sequential, one at a time"}.get(backend, backend)
    first = "the first request" if n == 1 else f"the first {n} requests"
    return f"{what}: {first} ({toks:,} tokens)"


def plot_throughput(runs):
    """One group of bars per model shape, output tok/s on a log scale, each bar labelled."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(ORDER)
    labelled = set()
    for i, (model, rows, _) in enumerate(runs):
        for j, backend in enumerate(ORDER):
            r = rows.get(backend)
            if r is None:
                continue
            x = i + (j - (len(ORDER) - 1) / 2) * width
            label = legend_label(backend, r)
            ax.bar(x, r["tokens_per_sec"], width, color=BACKEND_COLORS[backend],
                   label=label if label not in labelled else None)
            labelled.add(label)
            ax.text(x, r["tokens_per_sec"] * 1.08, f"{r['tokens_per_sec']:,.0f}", ha="center",
                    va="bottom", fontsize=7, rotation=90 if backend != "minipaged" else 0)
    ax.set_yscale("log")
    ax.set_ylim(top=max(r["tokens_per_sec"] for _, rows, _ in runs for r in rows.values()) * 60)
    ax.set_xticks(range(len(runs)), [m for m, _, _ in runs])
    ax.set_ylabel("output tokens / s (log scale)")
    gpu = runs[0][2] if runs else "GPU"
    ax.set_title(f"nano-vllm workload on an {gpu}, dummy weights (random), bf16:\n"
                 "each backend on the requests its legend entry names", fontsize=10)
    ax.legend(fontsize=7, loc="upper right", ncol=1, framealpha=0.95)
    fig.tight_layout()
    return fig


def throughput(paths: list[Path], out: Path) -> None:
    _save(plot_throughput(load_throughput(paths)), out, dpi=120)


# --- decode_breakdown and serve_load: lesson 08's and lesson 07's pictures ---------------------
SERVE_RUNS = [("one process\n(engine thread)", "serve_load_h200_qwen3-0.6b_one_process.json"),
              ("two processes,\nRequestOutput per step",
               "serve_load_h200_qwen3-0.6b_two_process_first.json"),
              ("two processes\n(final)", "serve_load_h200_qwen3-0.6b.json"),
              ("two processes (final),\n3 repeats", "serve_load_h200_qwen3-0.6b_repeats.json")]
SERVE_TITLE = ("minipaged serve at 256 concurrent streams vs the offline engine, same run "
               "(H200, dummy Qwen3-0.6B, nano-vllm workload)")


def decode_breakdown(paths: list[Path], out: Path) -> None:
    from minipaged.lessons import viz
    _save(viz.plot_decode_breakdown(json.loads(paths[0].read_text())), out, dpi=110)


def serve_load(paths: list[Path], out: Path) -> None:
    """Each JSON is one `serve_load.py --offline` invocation (the offline engine and the server
    in the same run, concurrency 256, block size 128); labelled as SERVE_RUNS names them."""
    from minipaged.lessons import viz
    labels = {name: label for label, name in SERVE_RUNS}
    runs = [(labels.get(p.name, p.stem), json.loads(p.read_text())) for p in paths]
    fig = viz.plot_serve_vs_offline(viz.serve_vs_offline_rows(runs), SERVE_TITLE)
    _save(fig, out, dpi=110, bbox_inches="tight")


# --- tp_scaling: throughput, ITL, a decode step's split and all-reduce busbw against N ----------
def _machine(path: Path) -> str:
    return path.stem.removeprefix("tp_scaling_")


def plot_tp_scaling(reports: dict):
    """`reports`: machine name -> tp_scaling JSON. Four panels: tok/s and ITL p50 / p99 against
    N per model; a decode step of the largest measured batch split into compute, all-reduce and
    the other collectives; all-reduce bus bandwidth against message size, the sizes a decode
    step sends marked."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (tput, itl), (split, bw) = axes
    bars, ns_seen = [], set()
    workload = next(iter(reports.values()), {}).get("settings", {}).get("workload", "nanovllm")
    for machine, rep in reports.items():
        rows = [r for r in rep.get("throughput", []) if "error" not in r]
        for model in dict.fromkeys(r["model"] for r in rows):
            mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["tp"])
            ns = [r["tp"] for r in mine]
            ns_seen.update(ns)
            label = f"{model.removeprefix('dummy:')} ({machine})"
            line, = tput.plot(ns, [r["tokens_per_sec"] for r in mine], "o-", label=label)
            itl.plot(ns, [r["itl_ms"]["p50"] for r in mine], "o-", color=line.get_color(),
                     label=f"{label} p50")
            itl.plot(ns, [r["itl_ms"]["p99"] for r in mine], "s--", color=line.get_color(),
                     label=f"{label} p99")
            for r in mine:
                if r.get("splits"):
                    s = max(r["splits"], key=lambda s: s["batch"])
                    bars.append((f"{model.removeprefix('dummy:')}\nN={r['tp']} b={s['batch']}",
                                 s))
        by_n: dict = {}
        for b in rep.get("busbw", []):
            by_n.setdefault(b["tp"], []).append(b)
        for n, pts in sorted(by_n.items()):
            pts.sort(key=lambda b: b["bytes"])
            line, = bw.plot([b["bytes"] for b in pts], [b["busbw_gbps"] for b in pts], "-",
                            label=f"N={n} ({machine})")
            dec = [b for b in pts if b["decode_size"]]
            bw.plot([b["bytes"] for b in dec], [b["busbw_gbps"] for b in dec], "o",
                    color=line.get_color(), ms=4)
    for ax, title, ylabel in ((tput, f"output tokens/s ({workload} workload)", "tok/s"),
                              (itl, "inter-token latency per request", "ms")):
        ax.set(title=title, xlabel="tensor_parallel_size N", ylabel=ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ns_seen), [str(n) for n in sorted(ns_seen)])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    x = range(len(bars))
    bottom = [0.0] * len(bars)
    for key, color, name in (("compute_ms", "tab:blue", "compute"),
                             ("all_reduce_ms", "tab:red", "all-reduce"),
                             ("other_comm_ms", "tab:gray", "broadcast + gather")):
        vals = [s[key] for _, s in bars]
        split.bar(x, vals, bottom=bottom, color=color, label=name)
        bottom = [a + b for a, b in zip(bottom, vals)]
    split.plot(list(x), [s["step_ms"] for _, s in bars], "k_", ms=18, label="step (wall)")
    split.set_xticks(list(x), [lbl for lbl, _ in bars], fontsize=7)
    split.set(title="one decode step on rank 0 (kernel time; CPU: wall minus collectives)",
              ylabel="ms")
    split.legend(fontsize=7)
    bw.set(title="all-reduce busbw (nccl-tests'; dots: a decode step's sizes)",
           xlabel="message bytes", ylabel="GB/s")
    bw.set_xscale("log", base=2)
    bw.grid(alpha=0.3)
    bw.legend(fontsize=7)
    fig.tight_layout()
    return fig


def tp_scaling(paths: list[Path], out: Path) -> None:
    _save(plot_tp_scaling({_machine(p): json.loads(p.read_text()) for p in paths}), out, dpi=110)


# name -> (draw, default inputs, default output)
FIGURES_BY_NAME = {
    "attention": (attention, lambda: [RESULTS / "attention_h200.json"],
                  FIGURES / "attention_bandwidth.png"),
    "throughput": (throughput, lambda: sorted(RESULTS.glob("nanovllm_h200_*.json")),
                   FIGURES / "throughput_h200.png"),
    "decode_breakdown": (decode_breakdown, lambda: [ROOT / "benchmarks" / "experiments" /
                                                    "decode_step" / "decode_breakdown_h200.json"],
                         FIGURES / "decode_breakdown_h200.png"),
    "serve_load": (serve_load, lambda: [RESULTS / name for _, name in SERVE_RUNS],
                   FIGURES / "serve_vs_offline_h200.png"),
    "tp_scaling": (tp_scaling, lambda: sorted(RESULTS.glob("tp_scaling_h200x*.json")),
                   FIGURES / "tp_scaling_h200.png"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figures", nargs="*", metavar="FIGURE",
                    help=f"any of {', '.join(FIGURES_BY_NAME)} (default: every one stored)")
    ap.add_argument("--json", nargs="+", type=Path, help="the inputs of the one figure named")
    ap.add_argument("--out", type=Path, help="the output of the one figure named")
    args = ap.parse_args(argv)
    names = args.figures or list(FIGURES_BY_NAME)
    unknown = [n for n in names if n not in FIGURES_BY_NAME]
    if unknown:
        ap.error(f"no figure {', '.join(unknown)}: the figures are {', '.join(FIGURES_BY_NAME)}")
    if (args.json or args.out) and len(names) != 1:
        ap.error("--json and --out need exactly one figure named")
    for name in names:
        draw, inputs, out = FIGURES_BY_NAME[name]
        paths = args.json or inputs()
        missing = [p for p in paths if not p.exists()]
        if not paths or missing:
            what = ", ".join(map(str, missing)) or "no JSON matched"
            if args.figures:
                raise SystemExit(f"{name}: {what}; run the benchmark that writes it first "
                                 "(the table in this script's docstring)")
            print(f"skipped {name}: {what}")
            continue
        draw(paths, args.out or out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
