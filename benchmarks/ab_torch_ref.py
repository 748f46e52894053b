"""A/B of `attention/torch_ref.py` against an older revision of it, in one process, interleaved.

    python benchmarks/ab_torch_ref.py --old HEAD~1 --repeats 8

Loads the old file (`git show REV:minipaged/attention/torch_ref.py`) as a second module, builds
one engine (stories260K, the `minipaged bench --workload cpu` workload, one thread) and runs the
workload alternately with the engine's attention backend of either class (the order flips every
round), after one warm-up round. The two sides must give the same greedy tokens. On shared cores
only the ratio is worth reading: it prints and writes (`--json`) each run's seconds and the median
over rounds of old / new time (above 1: the working tree is faster).
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from minipaged import LLM, SamplingParams
from minipaged.attention import torch_ref
from minipaged.lessons import bench as lessons_bench

ap = argparse.ArgumentParser()
ap.add_argument("--old", default="HEAD", help="git revision of torch_ref.py to compare against")
ap.add_argument("--repeats", type=int, default=6)
ap.add_argument("--json", default=None)
a = ap.parse_args()
torch.set_num_threads(1)

src = subprocess.run(["git", "show", f"{a.old}:minipaged/attention/torch_ref.py"], check=True,
                     capture_output=True, text=True).stdout
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(src)
spec = importlib.util.spec_from_file_location("old_torch_ref", f.name)
old = importlib.util.module_from_spec(spec)
sys.modules["old_torch_ref"] = old  # dataclasses look their module up
spec.loader.exec_module(old)
os.unlink(f.name)

llm = LLM("stories260K", cpu_threads=1, attention_backend="torch_ref")
backend = llm.engine.backend
mc = llm.engine.model_config
wl = lessons_bench.make_workload("cpu", mc.vocab_size, None, 0, bos=mc.bos_token_id,
                                 max_model_len=llm.engine.config.max_model_len)
sides = {"old": old.TorchRefBackend, "new": torch_ref.TorchRefBackend}
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
            outs = llm.generate(wl.prompts[:8], [greedy] * 8, use_tqdm=False)
            tokens[side] = [o.outputs[0].token_ids for o in outs]
assert tokens["old"] == tokens["new"], "the two revisions give different greedy tokens"
speedup = statistics.median(o / n for o, n in zip(times["old"], times["new"]))
report = {"old": a.old, "workload": "cpu (minipaged bench)", "model": "stories260K",
          "threads": 1, "repeats": a.repeats, "seconds": times,
          "median_old_over_new": round(speedup, 3),
          "load_average_start": load_start, "load_average_end": os.getloadavg()[0],
          "environment": lessons_bench.environment()}
print(json.dumps({k: report[k] for k in ("seconds", "median_old_over_new", "load_average_start",
                                         "load_average_end")}, indent=1))
if a.json:
    with open(a.json, "w") as f:
        json.dump(report, f, indent=1)
