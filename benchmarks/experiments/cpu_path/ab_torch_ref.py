"""A/B of `attention/torch_ref.py` against an older revision of it, in one process, interleaved.

    python benchmarks/experiments/cpu_path/ab_torch_ref.py --old HEAD~1 --repeats 8

Loads the old file (`git show REV:minipaged/attention/torch_ref.py`) as a second module, builds
one engine (stories260K, the `minipaged bench --workload cpu` workload, one thread) and runs the
workload alternately with the engine's attention backend of either class (the order flips every
round), after one warm-up round. The two sides must give the same greedy tokens. On shared cores
only the ratio is worth reading: it prints and writes (`--json`) each run's seconds and the median
over rounds of old / new time (above 1: the working tree is faster).
"""
import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

import interleaved_ab
import torch

from minipaged import LLM
from minipaged.attention import torch_ref

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
sides = {"old": old.TorchRefBackend, "new": torch_ref.TorchRefBackend}


def use(side: str) -> None:
    backend.__class__ = sides[side]  # the same engine and cache, the other attention code


doc = {"old": a.old, **interleaved_ab.run(llm, use, a.repeats, check_prompts=8)}
interleaved_ab.report(doc, a.json)
