"""The loop the CPU A/B scripts share: one engine, two sides swapped in place, interleaved.

`run(llm, use, repeats)` runs the `minipaged bench --workload cpu` workload on `llm` once per
side and round, calling `use("old")` or `use("new")` before each run to put that side in place
(the order flips every round; round 0 warms both sides up: the whole workload once per side, not
timed, so no timed run carries a warm-up of its own; the report's "warmup" says what it ran and
how long it took, and it is printed). Both sides must give
the same greedy tokens. It returns the report: each run's seconds and the median over rounds of
old / new time (above 1: the new side is faster). `report(doc, path)` prints it and writes it.
On shared cores only the ratio is worth reading. Used by ab_attention.py, ab_cpu_runner.py and
ab_torch_ref.py.
"""
from __future__ import annotations

import json
import os
import statistics
from typing import Callable, Optional

import torch

from minipaged import SamplingParams
from minipaged.lessons import bench as lessons_bench


def run(llm, use: Callable[[str], None], repeats: int, check_prompts: int = 16) -> dict:
    mc = llm.engine.model_config
    wl = lessons_bench.make_workload("cpu", mc.vocab_size, None, 0, bos=mc.bos_token_id,
                                     max_model_len=llm.engine.config.max_model_len)
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    times: dict[str, list[float]] = {"old": [], "new": []}
    warm_s: dict[str, float] = {}
    tokens = {}
    load_start = os.getloadavg()[0]
    for r in range(repeats + 1):
        for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
            use(side)
            res = lessons_bench.run_minipaged(llm, wl, 0.0, use_tqdm=False, warmup=False)
            if r:  # round 0 warms both sides up
                times[side].append(res.elapsed_sec)
            else:
                warm_s[side] = res.elapsed_sec
            if side not in tokens:
                outs = llm.generate(wl.prompts[:check_prompts], [greedy] * check_prompts,
                                    use_tqdm=False)
                tokens[side] = [o.outputs[0].token_ids for o in outs]
    assert tokens["old"] == tokens["new"], "the two sides give different greedy tokens"
    speedup = statistics.median(o / n for o, n in zip(times["old"], times["new"]))
    return {"workload": "cpu (minipaged bench)", "model": "stories260K",
            "threads": torch.get_num_threads(), "repeats": repeats, "seconds": times,
            "median_old_over_new": round(speedup, 3),
            "warmup": {"what": "round 0: the workload once per side, untimed",
                       "requests": len(wl.prompts), "prompt_tokens": wl.num_prompt_tokens,
                       "output_tokens": sum(wl.max_tokens), "seconds": warm_s},
            "load_average_start": load_start,
            "load_average_end": os.getloadavg()[0], "environment": lessons_bench.environment()}


def report(doc: dict, path: Optional[str], shown=("warmup", "seconds", "median_old_over_new",
                                                  "load_average_start", "load_average_end")):
    print(json.dumps({k: doc[k] for k in shown}, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
