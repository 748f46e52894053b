"""Draw figures/tp_scaling_h200.png from benchmarks/tp_scaling.py's JSON (runs anywhere).

    python benchmarks/plot_tp_scaling.py                   # every tp_scaling_h200x*.json
    python benchmarks/plot_tp_scaling.py A.json B.json --out figures/x.png

Four panels: output tok/s against N per model; ITL p50 (solid) and p99 (dashed) against N; a
decode step of the largest measured batch split into compute, all-reduce and the other
collectives, per model and N; and all-reduce bus bandwidth against message size per N, the
sizes a decode step sends marked. Several files (one per machine) share the panels, each line
labelled with its machine.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _machine(path: Path) -> str:
    return path.stem.removeprefix("tp_scaling_")


def plot(reports: dict):
    """`reports`: machine name -> tp_scaling JSON. Returns the matplotlib Figure."""
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "figures" / "tp_scaling_h200.png")
    args = ap.parse_args(argv)
    paths = args.json or sorted((ROOT / "benchmarks" / "results").glob("tp_scaling_h200x*.json"))
    if not paths:
        raise SystemExit("no tp_scaling_h200x*.json in benchmarks/results/: run "
                         "benchmarks/tp_scaling.py on the GPUs first, or name the JSON files")
    fig = plot({_machine(p): json.loads(p.read_text()) for p in paths})
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
