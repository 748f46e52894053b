"""A/B of the readable `ModelRunner` and `CPUModelRunner` on one engine, interleaved.

    python benchmarks/experiments/cpu_path/ab_cpu_runner.py --repeats 8 \
        --json benchmarks/experiments/cpu_path/cpu_ab_cpu_runner.json

Builds one engine (stories260K, the `minipaged bench --workload cpu` workload, one thread) and
runs the workload alternately with either runner (the order flips every round), after one
warm-up round. `--parts` picks what the new side has: `order` (decode-only steps in context-length
order, built by `CPUModelRunner._decode_inputs`), `calls` (the model's modules calling forward
directly, worker/direct_calls.py) or `all` (both: what the CPU engine runs). The old side is
`ModelRunner` with the modules as nn.Module calls them. The same KV cache, model, backend and
scheduler serve both sides; both must give the same greedy tokens. Prints and writes (`--json`)
each run's seconds and the median over rounds of old / new time (above 1: the new side is
faster). Runs after the first find the prompts in the prefix cache (both sides alike).
"""
import argparse

import interleaved_ab

from minipaged import LLM
from minipaged.worker import direct_calls
from minipaged.worker.cpu_model_runner import CPUModelRunner
from minipaged.worker.model_runner import ModelRunner
from minipaged.worker.wrapper import innermost

ap = argparse.ArgumentParser()
ap.add_argument("--parts", default="all", choices=["all", "order", "calls"])
ap.add_argument("--repeats", type=int, default=6)
ap.add_argument("--json", default=None)
a = ap.parse_args()

llm = LLM("stories260K", cpu_threads=1)  # the CPU backend: CPUModelRunner, modules converted
runner, model = innermost(llm.engine.model_runner), llm.engine.model
modules = [m for m in model.modules() if m is not model]
plain = {m: type(m).__mro__[1] if "__call__" in vars(type(m)) else type(m) for m in modules}


def use(side: str) -> None:
    new = side == "new"
    runner.__class__ = CPUModelRunner if new and a.parts != "calls" else ModelRunner
    if new and a.parts != "order":
        direct_calls.call_forward_directly(model)
    else:  # every module back to its own class, its member copies dropped
        for m in modules:
            if type(m) is not plain[m]:
                direct_calls._drop_members(m)
                m.__class__ = plain[m]


doc = {"old": "ModelRunner", "new": f"CPUModelRunner ({a.parts})",
       **interleaved_ab.run(llm, use, a.repeats)}
interleaved_ab.report(doc, a.json, shown=("new", "warmup", "seconds", "median_old_over_new",
                                          "load_average_start", "load_average_end"))
