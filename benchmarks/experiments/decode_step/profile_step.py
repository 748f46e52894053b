"""Where one engine step's time goes: Python (schedule, inputs, sampling) vs the GPU.

    python benchmarks/experiments/decode_step/profile_step.py --model dummy:qwen3-0.6b \
        --num-requests 256

Runs the nano-vllm workload under cProfile and prints the functions with the most own time,
plus the share of wall time spent waiting for the GPU (the sampler's host sync). The workload's
shapes run once first, untimed and unprofiled (`lessons.bench.warm_up`, printed), so Triton
compiles and first allocations stay out of the profile.
"""
import argparse
import cProfile
import pstats
import time

from minipaged import LLM, SamplingParams
from minipaged.lessons.bench import make_workload, warm_up

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="dummy:qwen3-0.6b")
ap.add_argument("--num-requests", type=int, default=256)
ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
ap.add_argument("--enforce-eager", action="store_true")
a = ap.parse_args()
llm = LLM(a.model, max_num_seqs=256, max_num_batched_tokens=a.max_num_batched_tokens,
          enforce_eager=a.enforce_eager)
wl = make_workload("nanovllm", llm.engine.model_config.vocab_size, a.num_requests)
sp = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
print(warm_up(llm, wl.prompts, sp), flush=True)
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
outs = llm.generate(wl.prompts, sp, use_tqdm=False)
prof.disable()
el = time.perf_counter() - t0
n = sum(len(o.outputs[0].token_ids) for o in outs)
print(f"{n} tokens in {el:.2f} s under cProfile = {n / el:,.0f} tok/s")
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
