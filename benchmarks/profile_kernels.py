"""GPU kernel time per decode step, by kernel (torch.profiler), on the nano-vllm workload.

    python benchmarks/profile_kernels.py --steps 30

Admits the whole workload, runs until every prompt is prefilled, then profiles `--steps`
decode steps eagerly (CUDA graphs hide the kernels from the profiler; the kernels are the same).
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from minipaged import LLM, SamplingParams
from minipaged.bench import make_workload

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="dummy:qwen3-0.6b")
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--num-blocks", type=int, default=None)
a = ap.parse_args()
llm = LLM(a.model, max_num_seqs=256, max_num_batched_tokens=8192, enforce_eager=True,
          num_blocks=a.num_blocks)
eng = llm.engine
wl = make_workload("nanovllm", eng.model_config.vocab_size, 256)
for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens)):
    eng.add_request(str(i), p, SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True))
while eng.scheduler.waiting or any(s.is_prefill for s in eng.scheduler.running):
    eng.step()
for _ in range(5):
    eng.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(a.steps):
        eng.step()
    torch.cuda.synchronize()
print(f"running sequences: {len(eng.scheduler.running)}")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
