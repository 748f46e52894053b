"""Where one stream's decode step goes: kernels per step, their GPU time, and the gaps between.

    python benchmarks/experiments/decode_step/one_stream.py [--model dummy:qwen3-0.6b] \
        [--steps 64] [--out benchmarks/experiments/decode_step/one_stream_h200.json]

One request (128 random prompt ids, EOS ignored) on the engine as a user gets it: defaults, CUDA
graphs and async scheduling on. After the prompt and 32 warm decode steps it times `--steps`
decode steps twice: first without the profiler (wall ms per step, the number to compare), then
under torch.profiler (CUPTI records the kernels a CUDA-graph replay launches). Per step it
reports the kernels launched, their summed GPU time, and the GPU's idle time (the step's wall
time minus its kernel time: launch gaps, host work not hidden, synchronisation), how long the
host waited per step for the previous step's tokens (`StepRecord.wait_time`; near 0: the host
sets the pace, not the GPU), and a table of kernels by name and by kind (matrix multiplies,
attention, split-KV reduction, norms, q/k/v rope+store, SiLU-and-mul, sampling, other), each
with launches per step and microseconds per launch. `--device cpu --model stories260K` runs the
same plumbing without a GPU (CPU ops only).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from minipaged import LLM, SamplingParams
from minipaged.benchmark.throughput import environment

KINDS = [  # (kind, pattern on the kernel's name), first match wins
    ("matmul", r"gemm|gemv|cutlass|sm90|nvjet|cublas|matmul|addmm|\bmm\b|linear"),
    ("attention", r"paged_attention"),
    ("split-KV reduction", r"reduce_splits"),
    ("norm", r"rms_norm"),
    ("q/k/v rope + store", r"qkv_rope_store|store_kv|rotary"),
    ("SiLU and mul", r"silu"),
    ("sampling", r"sample|argmax|gumbel|softmax|topk|exponential"),
]


def kind(name: str) -> str:
    for k, pattern in KINDS:
        if re.search(pattern, name, re.I):
            return k
    return "other"


def decode_steps(llm, n: int) -> list[float]:
    """Wall seconds of `n` engine steps (each waits for nothing extra: the engine's own pacing)."""
    eng, times = llm.engine, []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return times


def host_cpu() -> dict:
    """Where the host's work ran: the CPUs the process may use, the one it ran on last, and
    that CPU's clock (Linux /proc; empty elsewhere). Runs whose host work per step differs
    twofold on one machine can be told apart by it."""
    info = {}
    try:
        info["allowed_cpus"] = len(os.sched_getaffinity(0))
        cpu = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])
        info["last_cpu"] = cpu
        blocks = Path("/proc/cpuinfo").read_text().split("\n\n")
        mhz = [line.split(":")[1] for line in blocks[cpu].splitlines() if line.startswith("cpu MHz")]
        if mhz:
            info["last_cpu_mhz"] = float(mhz[0])
    except (OSError, IndexError, ValueError, AttributeError):
        pass
    return info


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dummy:qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    llm = LLM(a.model, device=a.device, **({"dtype": "bfloat16"} if cuda else {}))
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    prompt = [(7919 * i) % (vocab - 3) + 3 for i in range(128)]
    eng.add_request("0", prompt, SamplingParams(temperature=0.6, ignore_eos=True,
                                                max_tokens=2 * a.steps + 64))
    decode_steps(llm, 33)  # the prompt, then 32 decode steps: graphs and kernels warm
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    wall = decode_steps(llm, a.steps)
    sync()
    # async scheduling: how long each step's host work waited for the previous step's tokens
    # (StepRecord.wait_time); near 0 means the host, not the GPU, sets the pace
    waits = [r.wait_time for r in list(eng.trace)[-a.steps:]]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        profiled = decode_steps(llm, a.steps)
        sync()
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        device_us = e.device_time if cuda else e.cpu_time
        on_device = (e.device_type == torch.autograd.DeviceType.CUDA) if cuda else (
            e.cpu_parent is None and not e.name.startswith("ProfilerStep"))
        if on_device and device_us > 0:
            per_name[e.name].append(device_us)
    steps = a.steps
    kernels = sorted(({"name": n[:120], "kind": kind(n), "per_step": round(len(v) / steps, 2),
                       "us_each": round(statistics.mean(v), 2),
                       "us_per_step": round(sum(v) / steps, 2)} for n, v in per_name.items()),
                     key=lambda k: -k["us_per_step"])
    by_kind: dict[str, dict] = defaultdict(lambda: {"per_step": 0.0, "us_per_step": 0.0})
    for k in kernels:
        by_kind[k["kind"]]["per_step"] += k["per_step"]
        by_kind[k["kind"]]["us_per_step"] += k["us_per_step"]
    busy_ms = sum(k["us_per_step"] for k in kernels) / 1e3
    step_ms = statistics.median(wall) * 1e3
    result = {
        "command": "python benchmarks/experiments/decode_step/one_stream.py "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "model": a.model, "device": a.device, "environment": environment(),
        "config": {k: getattr(eng.config, k) for k in (
            "block_size", "max_num_batched_tokens", "enforce_eager", "async_scheduling",
            "fused_ops", "attention_backend")},
        "step_ms": {"median": round(step_ms, 4), "mean": round(statistics.mean(wall) * 1e3, 4),
                    "profiled_median": round(statistics.median(profiled) * 1e3, 4)},
        "launches_per_step": round(sum(k["per_step"] for k in kernels), 1),
        "busy_ms_per_step": round(busy_ms, 4),
        "idle_ms_per_step": round(step_ms - busy_ms, 4),
        "host_wait_ms_per_step": round(statistics.median(waits) * 1e3, 4),
        "host_cpu": host_cpu(),
        "by_kind": {k: {"per_step": round(v["per_step"], 2), "us_per_step": round(v["us_per_step"], 2)}
                    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]["us_per_step"])},
        "kernels": kernels[:40],
    }
    print(f"{a.model} one stream on {a.device}: {step_ms:.3f} ms per decode step (median of "
          f"{steps}); {result['launches_per_step']} launches, {busy_ms:.3f} ms busy, "
          f"{step_ms - busy_ms:.3f} ms idle; the host waited "
          f"{result['host_wait_ms_per_step']:.3f} ms per step for the GPU; host CPU "
          f"{result['host_cpu']}")
    for k, v in result["by_kind"].items():
        print(f"  {k:20s} {v['per_step']:7.1f} launches {v['us_per_step']:9.1f} us")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
