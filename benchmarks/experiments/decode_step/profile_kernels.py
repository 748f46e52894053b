"""GPU kernel time per decode step, by kernel (torch.profiler), on the nano-vllm workload.

    python benchmarks/experiments/decode_step/profile_kernels.py --steps 30
    # the prompt-processing steps instead
    python benchmarks/experiments/decode_step/profile_kernels.py --phase prefill

Admits the whole workload, runs until every prompt is prefilled, then profiles `--steps`
decode steps eagerly (CUDA graphs hide the kernels from the profiler; the kernels are the same).
With `--phase prefill` it profiles the first `--steps` steps, which process the prompts.
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from minipaged import LLM, SamplingParams
from minipaged.lessons.bench import make_workload

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="dummy:qwen3-0.6b")
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--num-blocks", type=int, default=None)
ap.add_argument("--phase", choices=["decode", "prefill"], default="decode")
ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
ap.add_argument("--block-size", type=int, default=16)
a = ap.parse_args()
llm = LLM(a.model, max_num_seqs=256, max_num_batched_tokens=a.max_num_batched_tokens,
          enforce_eager=True, num_blocks=a.num_blocks, block_size=a.block_size)
eng = llm.engine
wl = make_workload("nanovllm", eng.model_config.vocab_size, 256)
if a.phase == "prefill":  # warm up (compile) on two short requests first, then profile from the start
    llm.generate([[1] * 900, [2] * 50], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens)):
    eng.add_request(str(i), p, SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True))
if a.phase == "decode":
    while eng.scheduler.waiting or any(s.is_prefill for s in eng.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(a.steps):
        eng.step()
    torch.cuda.synchronize()
print(f"running sequences: {len(eng.scheduler.running)}, waiting: {len(eng.scheduler.waiting)}")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
