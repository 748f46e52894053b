"""A/B of the host's work per one-stream decode step, both sides in one process.

    python benchmarks/experiments/decode_step/host_ab.py --side main=DIR_A --side new=DIR_B \
        [--side ...] [--model dummy:qwen3-0.6b] [--rounds 6] [--steps 100] [--out result.json]

Each `DIR` holds a `minipaged` package (a revision); the first side is the baseline. On the H200's host the
host's speed differs up to twofold between processes (the CPU a process lands on), which hides a
change of 10% between two runs. Here the engines live in one process and take turns, blocks
of `--steps` decode steps each, the order rotating per round: each side's modules are put
in `sys.modules` before its turn (the package imports some modules inside functions).

Per side it reports the median wall time of a step and the median host work of a step: wall
time minus the time the step waited for the previous step's tokens (`StepRecord.wait_time`).
When the host work is below the GPU's time per step the wall time is the GPU's, so the host
work is the number a host-side change moves.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path


def _ours() -> list[str]:
    return [n for n in sys.modules if n == "minipaged" or n.startswith("minipaged.")]


class Sides:
    """Each side's `minipaged` modules; `activate(name)` puts that side's in sys.modules and
    keeps what the other side imported meanwhile (modules imported inside functions)."""

    def __init__(self):
        self.modules: dict[str, dict] = {}
        self.active = None

    def load(self, name: str, path: str):
        self.activate(None)
        sys.path.insert(0, path)
        package = importlib.import_module("minipaged")
        importlib.import_module("minipaged.llm")
        sys.path.remove(path)
        self.modules[name] = {}
        self.active = name
        return package

    def activate(self, name) -> None:
        if self.active is not None:
            self.modules[self.active] = {n: sys.modules[n] for n in _ours()}
        for n in _ours():
            del sys.modules[n]
        if name is not None:
            sys.modules.update(self.modules[name])
        self.active = name


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", action="append", required=True, help="NAME=DIR, two or more")
    ap.add_argument("--model", default="dummy:qwen3-0.6b")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch
    sides, loaded = {}, Sides()
    named = [side.split("=", 1) for side in a.side]
    for name, path in named:
        package = loaded.load(name, str(Path(path).resolve()))
        llm = sys.modules["minipaged.llm"].LLM(
            a.model, device=a.device, kv_cache_memory=2 << 30,
            max_model_len=4096 if a.device == "cuda" else 512,
            **({"dtype": "bfloat16"} if a.device == "cuda" else {}))
        eng = llm.engine
        vocab = eng.model_config.vocab_size
        prompt = [(7919 * i) % (vocab - 3) + 3 for i in range(128)]
        params = package.SamplingParams(
            temperature=0.6, ignore_eos=True, max_tokens=40 + a.rounds * a.steps + 8)
        eng.add_request("0", prompt, params)
        for _ in range(40):  # the prompt, then warm decode steps
            eng.step()
        sides[name] = (eng, {"wall_ms": [], "host_ms": []})
    if a.device == "cuda":
        torch.cuda.synchronize()
    for r in range(a.rounds):
        for i in range(len(named)):
            name = named[(i + r) % len(named)][0]
            eng, acc = sides[name]
            loaded.activate(name)
            walls = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                eng.step()
                walls.append(time.perf_counter() - t0)
            waits = [rec.wait_time for rec in list(eng.trace)[-a.steps:]]
            wall = statistics.median(walls) * 1e3
            host = statistics.median(w - t for w, t in zip(walls, waits)) * 1e3
            acc["wall_ms"].append(round(wall, 4))
            acc["host_ms"].append(round(host, 4))
            print(f"round {r} {name}: wall {wall:.3f} ms/step, host work {host:.3f} ms/step")
    base = named[0][0]
    result = {"benchmark": "host_ab", "model": a.model, "sides": dict(named),
              "steps": a.steps, "rounds": {k: v[1] for k, v in sides.items()}, "vs_" + base: {}}
    for name, _ in named[1:]:
        for k in ("wall_ms", "host_ms"):
            ratios = [x / y for y, x in zip(sides[base][1][k], sides[name][1][k])]
            result["vs_" + base][f"{name}_{k}"] = round(statistics.median(ratios), 4)
            print(f"{k}: {name} / {base}, median of {len(ratios)} paired rounds: "
                  f"{statistics.median(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)})")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
