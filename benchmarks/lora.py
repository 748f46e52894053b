"""Multi-LoRA throughput: the same workload with 0, 1, 4 and 16 adapters spread over the requests.

    .venv/bin/python benchmarks/lora.py                  # CPU: stories260K, 32 requests (a check)
    python benchmarks/lora.py --h200               # H200: dummy Qwen3-0.6B, nano-vllm workload

`--workload` is one of `minipaged bench`'s (`fixed`: `--input-len` / `--output-len` tokens each).

Two engines on the same model, built side by side:

  base      enable_lora=False: the model as it is served without adapters
  lora      enable_lora=True, max_loras=16 (every count fits), rank-16 slots; the workload is
            run with N random rank-16 adapters (all seven modules; made here in PEFT's format by
            minipaged/lora/random_adapter.py), request i using adapter i % N (N = 0: none, so
            it measures what the wrapped layers cost on their own)

Both get the same explicit KV cache, room for every request at its full length. Before the first
round every setting (base, lora with each count) runs its requests once untimed, with its
adapters (lessons.bench.warm_up: the same prompt lengths and max_tokens, token ids reversed):
the adapters are loaded and every kernel variant compiled, so one round times warm settings. The
runs are interleaved (base, lora 0, 1, 4, 16, then again for each --repeats), and each is
reported as tokens/s and as a ratio to the base run of the same round; the warm-ups (requests,
tokens, seconds) are printed and written to the JSON ("warmup"). The goal of the design: 4
adapters within 15% of the base model. --h200 is the nano-vllm workload (256 requests, input and
output U[100, 1024], seed 0, EOS ignored) in bf16 with the GPU bench's settings
(benchmarks/nanovllm_h200.sh): KV blocks of 128, 8192 batched tokens, temperature 0.6. Dummy
weights. JSON to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from minipaged import LLM, LoRARequest, SamplingParams  # noqa: E402
from minipaged.lessons.bench import (Warmup, environment, make_workload,  # noqa: E402
                                     step_breakdown, step_ms, warm_up)
from minipaged.lora.random_adapter import save_random_adapter  # noqa: E402


def requests(wl, loras, temperature):
    """Each request's sampling parameters and adapter (request i: adapter i % N; N = 0: none)."""
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True)
              for m in wl.max_tokens]
    return params, [loras[i % len(loras)] if loras else None for i in range(len(wl.prompts))]


def warm(llm, wl, loras, temperature) -> dict:
    """The setting's requests once, untimed (adapters loaded, kernels compiled)."""
    params, per_request = requests(wl, loras, temperature)
    return warm_up(llm, wl.prompts, params, lora_request=per_request).to_dict()


def run(llm, wl, loras, temperature):
    """Time the workload (on an engine warmed up for this setting: `warm`); returns a dict."""
    params, per_request = requests(wl, loras, temperature)
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    first = len(llm.engine.trace)
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=False, lora_request=per_request)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    trace = list(llm.engine.trace)[first:]
    return {"elapsed_sec": round(elapsed, 4), "output_tokens": tokens,
            "tokens_per_sec": round(tokens / elapsed, 1),
            "peak_batch": max((len(r.scheduled) for r in trace), default=0),
            **step_breakdown(trace), "step_ms": step_ms(trace)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--h200", action="store_true",
                    help="the GPU settings: dummy:qwen3-0.6b, nanovllm workload, bf16, cuda")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--workload", default=None)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=128, help="--workload fixed: prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="--workload fixed: output tokens")
    ap.add_argument("--counts", default="0,1,4,16", help="adapters per run")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=None, help="default: the largest count")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    h = a.h200
    model = a.model or ("dummy:qwen3-0.6b" if h else "stories260K")
    device = a.device or ("cuda" if h else "cpu")
    dtype = a.dtype or ("bfloat16" if h else "auto")
    workload = a.workload or ("nanovllm" if h else "cpu")
    num_requests = a.num_requests or (256 if h else 32)
    repeats = a.repeats or (1 if h else 2)
    temperature = a.temperature if a.temperature is not None else (0.6 if h else 0.0)
    counts = [int(c) for c in a.counts.split(",")]
    max_loras = a.max_loras or max(max(counts), 1)
    from minipaged.models.config import ModelConfig
    from minipaged.models.loader import resolve_model
    cfg = ModelConfig.from_dict(resolve_model(model).config)
    wl = make_workload(workload, cfg.vocab_size, num_requests, seed=0, input_len=a.input_len,
                       output_len=a.output_len,
                       max_model_len=None if workload == "nanovllm" else
                       cfg.max_position_embeddings)
    block_size = 128 if h else 16
    # Both engines live at once, so each gets an explicit cache: room for every request of the
    # workload at its full length (no preemption), the same for both.
    num_blocks = sum(-(-(len(p) + m) // block_size) for p, m in zip(wl.prompts, wl.max_tokens))
    engine = dict(device=device, dtype=dtype, max_num_seqs=256 if h else 64,
                  block_size=block_size, num_blocks=num_blocks + 64)
    if h:
        engine |= dict(max_num_batched_tokens=8192)
    out = a.out or str(ROOT / "benchmarks" / "results" /
                       f"lora_{'h200' if h else device}_{model.split(':')[-1].lower()}.json")

    base = LLM(model, **engine)
    lora = LLM(model, enable_lora=True, max_loras=max_loras, max_lora_rank=a.rank, **engine)
    tmp = tempfile.mkdtemp(prefix="minipaged-lora-")
    adapters = [LoRARequest(f"a{i}", i + 1, save_random_adapter(
        f"{tmp}/a{i}", cfg, rank=a.rank, lora_alpha=2 * a.rank, seed=i, std=0.01,
        dtype=torch.bfloat16 if "bf" in dtype else torch.float32)) for i in range(max(counts))]
    warmups = {"base": warm(base, wl, [], temperature)}
    for n in counts:
        warmups[n] = warm(lora, wl, adapters[:n], temperature)
        print(f"lora x{n}: {Warmup(**warmups[n])}", flush=True)
    print(f"base: {Warmup(**warmups['base'])}", flush=True)
    rounds = []
    for _ in range(repeats):
        row = {"base": run(base, wl, [], temperature)}
        for n in counts:
            row[n] = run(lora, wl, adapters[:n], temperature)
        rounds.append(row)
    results = [{"config": "base", "adapters": 0, "enable_lora": False,
                "tokens_per_sec": [r["base"]["tokens_per_sec"] for r in rounds],
                "ratio_to_base": 1.0, "warmup": warmups["base"],
                "runs": [r["base"] for r in rounds]}]
    for n in counts:
        ratios = [r[n]["tokens_per_sec"] / r["base"]["tokens_per_sec"] for r in rounds]
        results.append({"config": f"lora x{n}", "adapters": n, "enable_lora": True,
                        "max_loras": max_loras, "rank": a.rank,
                        "tokens_per_sec": [r[n]["tokens_per_sec"] for r in rounds],
                        "ratio_to_base": round(statistics.median(ratios), 3),
                        "ratios": [round(x, 3) for x in ratios], "warmup": warmups[n],
                        "runs": [r[n] for r in rounds]})
    manager = lora.engine.lora_manager
    lines = ["| run | adapters | tok/s (median) | vs base |", "|---|---:|---:|---:|"]
    for r in results:
        tps = statistics.median(r["tokens_per_sec"])
        lines.append(f"| {r['config']} | {r['adapters']} | {tps:,.0f} | "
                     f"{r['ratio_to_base']:.3f}x |")
    table = "\n".join(lines)
    doc = {"environment": environment(), "command": " ".join(["python", *sys.argv]),
           "model": model, "weights": "dummy" if model.startswith("dummy:") else "checkpoint",
           "device": device, "dtype": dtype,
           "workload": {"name": workload, "num_requests": len(wl.prompts), "seed": 0,
                        "prompt_tokens": wl.num_prompt_tokens,
                        "output_tokens": sum(wl.max_tokens), "temperature": temperature,
                        "ignore_eos": True},
           "adapter_slots": {"loads": manager.num_loads, "evictions": manager.num_evictions},
           "warmup": {"what": "before the first round, each setting's requests once untimed, "
                              "with its adapters (the same prompt lengths and max_tokens, token "
                              "ids reversed)",
                      "seconds": round(sum(w["seconds"] for w in warmups.values()), 2),
                      "by_setting": {str(k): w for k, w in warmups.items()}},
           "results": results, "table": table}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    print(table)
    print(f"wrote {out}")
    del base, lora
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
