"""Draw figures/throughput_h200.png from the stored H200 runs of the nano-vllm workload.

    python benchmarks/plot_throughput_gpu.py            # reads benchmarks/results/nanovllm_h200_*.json

One group of bars per model shape (and KV-cache dtype): minipaged and every HF baseline that ran in the same run,
output tokens per second on a log scale (the gap is two orders of magnitude), each bar labelled.
The weights are dummy (random, seeded), and each legend entry says how many of the workload's
requests that backend ran and at what batch size: the HF modes ran on the first requests only
(`--hf-max-requests`), so their bars are tokens/s over a different, smaller set of requests.
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ORDER = ["minipaged", "hf-cb", "hf-static", "hf-sequential"]
COLORS = {"minipaged": "tab:green", "hf-cb": "tab:orange", "hf-static": "tab:blue",
          "hf-sequential": "tab:gray"}


def load(paths):
    runs = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        rows = {r["backend"]: r for r in d["results"]}
        name = d["model"].replace("dummy:", "")
        if "--kv-cache-dtype fp8" in d.get("command", ""):
            name += "\n(fp8 KV cache)"
        runs.append((name, rows, d["environment"].get("gpu", "GPU")))
    return runs


def legend_label(backend: str, r: dict) -> str:
    """What the bar measured: how many requests, at what batch size."""
    n, toks = r["num_requests"], r["output_tokens"]
    if backend == "minipaged":
        return f"minipaged: all {n} requests ({toks:,} tokens)"
    what = {"hf-static": f"hf-static, padded batches of {r['concurrency']} (the one size run)",
            "hf-cb": "hf-cb (transformers' continuous batching)",
            "hf-sequential": "hf-sequential, one at a time"}.get(backend, backend)
    first = "the first request" if n == 1 else f"the first {n} requests"
    return f"{what}: {first} ({toks:,} tokens)"


def plot(runs, out: Path) -> None:
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
            ax.bar(x, r["tokens_per_sec"], width, color=COLORS[backend],
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
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    paths = sys.argv[1:] or sorted(RESULTS.glob("nanovllm_h200_*.json"))
    order = {"qwen3-0.6b": 0, "qwen3-0.6b\n(fp8 KV cache)": 1, "qwen2.5-0.5b": 2, "llama-3.2-1b": 3}
    runs = sorted(load(paths), key=lambda r: order.get(r[0], 9))
    plot(runs, ROOT / "figures" / "throughput_h200.png")
