"""A/B of two attention backends on one engine, in one process, interleaved.

    python benchmarks/experiments/cpu_path/ab_attention.py --old torch_ref --new cpu --repeats 8 \
        --json benchmarks/experiments/cpu_path/cpu_ab_cpu_backend.json

Builds one engine (stories260K, the `minipaged bench --workload cpu` workload, one thread) and
runs the workload alternately with the engine's attention backend of either class (the order
flips every round), after one warm-up round. The same KV cache, model and scheduler serve both
sides; only the attention code differs. Both sides must give the same greedy tokens. On shared
cores only the ratio is worth reading: it prints and writes (`--json`) each run's seconds and the
median over rounds of old / new time (above 1: `--new` is faster).

Runs after the first find the workload's prompts in the prefix cache (both sides alike), so
they time decoding more than prefill; `minipaged bench` times one cold run.
"""
import argparse

import interleaved_ab

from minipaged import LLM
from minipaged.attention import BACKENDS, get_attention_backend

ap = argparse.ArgumentParser()
ap.add_argument("--old", default="torch_ref", choices=BACKENDS)
ap.add_argument("--new", default="cpu", choices=BACKENDS)
ap.add_argument("--repeats", type=int, default=6)
ap.add_argument("--json", default=None)
a = ap.parse_args()

llm = LLM("stories260K", cpu_threads=1, attention_backend=a.old)
backend = llm.engine.backend
sides = {"old": type(backend), "new": type(get_attention_backend(a.new, "cpu"))}


def use(side: str) -> None:
    backend.__class__ = sides[side]  # the same engine and cache, the other attention code


doc = {"old": a.old, "new": a.new, **interleaved_ab.run(llm, use, a.repeats)}
interleaved_ab.report(doc, a.json)
