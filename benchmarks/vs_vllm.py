"""minipaged and vLLM in one run on one GPU, alternating, each with its defaults.

    python benchmarks/vs_vllm.py --vllm-env ENV_SH [--models qwen3-0.6b,qwen3-8b] [--rounds 2] \
        [--workloads nanovllm,sharegpt,one_stream] [--out benchmarks/results/vs_vllm_h200.json]

`ENV_SH` is a shell file that makes `python3 -c "import vllm"` work (the vLLM 0.26 payload's
`vllm_env.sh`: docs/guides/performance.md says how to build it). Each round runs vLLM and
minipaged once each, in fresh processes, in alternating order (vLLM first in odd rounds), so the
machine's drift falls on both. Each process builds its engine once (`benchmarks/lib/peer_side.py`)
with no flags beyond the shared ones: bf16, dummy weights, `max_model_len` 4096, no tokenizer.
It runs the first workload once untimed, then times every workload:

* `nanovllm`: nano-vllm's bench (256 prompts of U[100, 1024] ids, U[100, 1024] output tokens);
* `sharegpt`: 512 requests of ShareGPT-like lengths (exponential, means 161 in / 338 out);
* `one_stream`: one request, 128 prompt ids, 1,024 output tokens, the median of three runs.

All requests sample at temperature 0.6 with EOS ignored, drawn once here and written to a file
both sides read, so both engines run the same token ids. The JSON holds each side's config (block
size, step budget, graphs, compile mode), each round's tok/s and the paired ratio
minipaged / vLLM per round with its median; the summary prints one row per model and workload.
vLLM's model folders hold a config.json with the same shapes as minipaged's presets
(`--vllm-models DIR`: `DIR/<model>-dummy/config.json`).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDE = ROOT / "benchmarks" / "lib" / "peer_side.py"


def workloads(names: list[str], max_model_len: int) -> dict:
    from minipaged.benchmark.throughput import make_workload
    out = []
    for name in names:
        if name == "one_stream":  # as the vLLM kit's bench draws it
            rng = random.Random(1)
            prompts, max_tokens, repeats = [[rng.randint(0, 10000) for _ in range(128)]], [1024], 3
        else:
            wl = make_workload(name, 10_000, num_requests=512 if name == "sharegpt" else None,
                               max_model_len=max_model_len)
            prompts, max_tokens, repeats = wl.prompts, wl.max_tokens, 1
        out.append({"name": name, "prompts": prompts, "max_tokens": max_tokens,
                    "repeats": repeats})
    return {"max_model_len": max_model_len, "workloads": out}


def run_side(engine: str, model: str, wl_file: str, vllm_env: str | None,
             python: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [python, str(SIDE), "--engine", engine, "--model", model, "--workloads", wl_file,
           "--out", out]
    if engine == "vllm":  # in vLLM's environment, from a clean working directory
        cmd = ["bash", "-c", f"source {shlex.quote(vllm_env)} && exec {shlex.join(cmd)}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=tempfile.gettempdir() if engine == "vllm" else ROOT)
    res = json.load(open(out))
    os.unlink(out)
    res["process_seconds"] = round(time.perf_counter() - t0, 1)
    return res


def summarize(rounds: list[dict], names: list[str]) -> dict:
    out = {}
    for name in names:
        v = [r["vllm"]["results"][name]["tok_per_s"] for r in rounds]
        m = [r["minipaged"]["results"][name]["tok_per_s"] for r in rounds]
        ratios = [round(b / a, 4) for a, b in zip(v, m)]
        out[name] = {"vllm_tok_per_s": v, "minipaged_tok_per_s": m, "paired_ratios": ratios,
                     "median_ratio": round(statistics.median(ratios), 4)}
        if name == "one_stream":
            out[name]["ms_per_token"] = {
                side: [r[side]["results"][name]["ms_per_token"] for r in rounds]
                for side in ("vllm", "minipaged")}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-env", required=True, help="a shell file that puts vLLM on the path")
    ap.add_argument("--vllm-models", default=str(ROOT / ".peer" / "vllm"),
                    help="folder of <model>-dummy/config.json for vLLM")
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    ap.add_argument("--workloads", default="nanovllm,sharegpt,one_stream")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--python", default=sys.executable, help="the interpreter for both sides")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vs_vllm_h200.json"))
    a = ap.parse_args(argv)
    from minipaged.benchmark.throughput import environment

    names = a.workloads.split(",")
    spec = workloads(names, a.max_model_len)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        wl_file = f.name
    result = {"command": "python benchmarks/vs_vllm.py " + " ".join(argv or sys.argv[1:]),
              "environment": environment(), "max_model_len": a.max_model_len,
              "workloads": {w["name"]: {"requests": len(w["prompts"]),
                                        "prompt_tokens": sum(map(len, w["prompts"])),
                                        "output_tokens": sum(w["max_tokens"]),
                                        "repeats": w["repeats"]} for w in spec["workloads"]},
              "sampling": "temperature 0.6, EOS ignored", "models": {}}
    for model in a.models.split(","):
        rounds = []
        for r in range(a.rounds):
            order = ("vllm", "minipaged") if r % 2 == 0 else ("minipaged", "vllm")
            sides = {}
            for engine in order:
                target = (str(Path(a.vllm_models).resolve() / f"{model}-dummy") if engine == "vllm"
                          else f"dummy:{model}")
                sides[engine] = run_side(engine, target, wl_file, a.vllm_env, a.python)
            rounds.append(dict(order=list(order), **sides))
        result["models"][model] = {"rounds": rounds, "summary": summarize(rounds, names)}
        for name, s in result["models"][model]["summary"].items():
            print(f"{model:12s} {name:10s} vLLM {statistics.median(s['vllm_tok_per_s']):9,.0f} "
                  f"minipaged {statistics.median(s['minipaged_tok_per_s']):9,.0f} tok/s  "
                  f"paired median {s['median_ratio']:.3f}x {s['paired_ratios']}", flush=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")  # after each model
    os.unlink(wl_file)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
