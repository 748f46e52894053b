"""A/B of two attention backends on one engine, in one process, interleaved.

    python benchmarks/ab_attention.py --old torch_ref --new cpu --repeats 8 \
        --json benchmarks/results/cpu_ab_cpu_backend.json

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
import json
import os
import statistics

import torch

from minipaged import LLM, SamplingParams
from minipaged.attention import BACKENDS, get_attention_backend
from minipaged.lessons import bench as lessons_bench

ap = argparse.ArgumentParser()
ap.add_argument("--old", default="torch_ref", choices=BACKENDS)
ap.add_argument("--new", default="cpu", choices=BACKENDS)
ap.add_argument("--repeats", type=int, default=6)
ap.add_argument("--json", default=None)
a = ap.parse_args()

llm = LLM("stories260K", cpu_threads=1, attention_backend=a.old)
backend = llm.engine.backend
mc = llm.engine.model_config
wl = lessons_bench.make_workload("cpu", mc.vocab_size, None, 0, bos=mc.bos_token_id,
                                 max_model_len=llm.engine.config.max_model_len)
sides = {"old": type(backend), "new": type(get_attention_backend(a.new, "cpu"))}
greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
times: dict[str, list[float]] = {"old": [], "new": []}
tokens = {}
load_start = os.getloadavg()[0]
for r in range(a.repeats + 1):
    order = ("old", "new") if r % 2 == 0 else ("new", "old")
    for side in order:
        backend.__class__ = sides[side]  # the same engine and cache, the other attention code
        res = lessons_bench.run_minipaged(llm, wl, 0.0, use_tqdm=False)
        if r:  # round 0 warms both sides up
            times[side].append(res.elapsed_sec)
        if side not in tokens:
            outs = llm.generate(wl.prompts[:16], [greedy] * 16, use_tqdm=False)
            tokens[side] = [o.outputs[0].token_ids for o in outs]
assert tokens["old"] == tokens["new"], "the two backends give different greedy tokens"
speedup = statistics.median(o / n for o, n in zip(times["old"], times["new"]))
report = {"old": a.old, "new": a.new, "workload": "cpu (minipaged bench)", "model": "stories260K",
          "threads": torch.get_num_threads(), "repeats": a.repeats, "seconds": times,
          "median_old_over_new": round(speedup, 3),
          "load_average_start": load_start, "load_average_end": os.getloadavg()[0],
          "environment": lessons_bench.environment()}
print(json.dumps({k: report[k] for k in ("seconds", "median_old_over_new", "load_average_start",
                                         "load_average_end")}, indent=1))
if a.json:
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)
