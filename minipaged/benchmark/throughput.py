"""Throughput benchmarks: minipaged side by side with the naive Hugging Face baselines.

    minipaged bench                                  # CPU workload on stories260K (cli/bench.py)
    minipaged bench --workload nanovllm --model dummy:qwen3-0.6b --backends minipaged,hf-static

Workloads (all seeded, all ignore EOS so every request produces exactly its max_tokens):

* `cpu`      64 requests, prompt lengths U[4, 64], output lengths U[16, 256] (stories260K).
* `nanovllm` nano-vllm's bench: `random.seed(0)`; 256 prompts of `randint(100, 1024)` token ids
             drawn from `randint(0, 10000)`, then `max_tokens = randint(100, 1024)` each.
* `sharegpt` / `alpaca`  lengths with the vLLM paper's means (ShareGPT 161.31 in / 337.99 out,
             Alpaca 19.31 / 58.45), drawn from exponential distributions.
* `fixed`    every request `--input-len` in, `--output-len` out.

Each backend yields a `BenchResult` (the course notes' fields: backend, num_requests,
concurrency, elapsed_sec, qps, output_tokens, tokens_per_sec) plus ratios to the best HF mode.
`concurrency` is what a run achieved: the most sequences one forward pass computed (minipaged:
the largest step of its trace, which `max_num_seqs` and the KV cache bound); `batch_limit` names
the knob that bounds it. The table calls them "peak batch" and "batch limit". HF modes may run
on a subsample (`--hf-max-requests`); the table says so. `progress(n)`, when given, hears that n
more requests finished (`minipaged bench` passes a tqdm bar's `update`). Lessons 03 and 08 use
them too (the notebooks import them from `minipaged.lessons.bench`).

Warm-up: every engine a benchmark times runs its timed requests' shapes once, untimed, first
(`warm_up`: the same batch, prompt lengths, sampling parameters and max_tokens, the prompts'
token ids reversed so that the timed run finds none of them in the prefix cache). On a GPU a
fresh engine's first forwards compile kernels (Triton picks a variant by query length, and by
context length in the steps that run eagerly: prefill, mixed and large verify steps, whose
split-KV choice changes as contexts grow), so a warm-up that stops after a few tokens leaves
compiles inside the timed window; on the CPU the first calls of each shape allocate. `Warmup`
says what was run (requests, tokens, steps, seconds); benchmarks print it and write it to their
JSON ("warmup"). `step_ms(trace)` puts a timed window's first step beside its median step, so a
run shows from its own trace whether it started cold. The HF baselines warm up on a few tokens of
their first requests (`run_hf`: eager PyTorch, nothing is compiled per shape).
"""
from __future__ import annotations

import numpy as np

import platform
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

WORKLOADS = ("cpu", "nanovllm", "sharegpt", "alpaca", "fixed")
BACKENDS = ("minipaged", "hf-sequential", "hf-static", "hf-cb")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def subset(self, n: int) -> "Workload":
        return Workload(self.name, self.prompts[:n], self.max_tokens[:n])


def make_workload(name: str, vocab_size: int, num_requests: Optional[int] = None, seed: int = 0,
                  input_len: int = 128, output_len: int = 128, bos: Optional[int] = None,
                  max_model_len: Optional[int] = None) -> Workload:
    rng = random.Random(seed)
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    if name == "nanovllm":  # drawn exactly as nano-vllm's bench.py draws it
        n = 256 if num_requests is None else num_requests
        random.seed(seed)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(n)]
        max_tokens = [random.randint(100, 1024) for _ in range(n)]
        return Workload(name, prompts, max_tokens)
    n = 64 if num_requests is None else num_requests
    if name == "cpu":
        lens = [(rng.randint(4, 64), rng.randint(16, 256)) for _ in range(n)]
    elif name in ("sharegpt", "alpaca"):
        mean_in, mean_out = (161.31, 337.99) if name == "sharegpt" else (19.31, 58.45)
        lens = [(max(1, round(rng.expovariate(1 / mean_in))), max(1, round(rng.expovariate(1 / mean_out))))
                for _ in range(n)]
    elif name == "fixed":
        lens = [(input_len, output_len)] * n
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    if max_model_len is not None:  # keep prompt + output inside the context
        lens = [(min(i, max_model_len - 1), min(o, max_model_len - min(i, max_model_len - 1)))
                for i, o in lens]
    low = 3 if vocab_size > 3 else 0  # skip <unk>, <s>, </s> in small sentencepiece vocabularies
    prompts = []
    for i, _ in lens:
        ids = [rng.randrange(low, vocab_size) for _ in range(i)]
        if bos is not None:
            ids[0] = bos
        prompts.append(ids)
    return Workload(name, prompts, [o for _, o in lens])


@dataclass
class BenchResult:
    backend: str
    num_requests: int
    concurrency: int  # the most sequences one forward pass computed ("peak batch")
    elapsed_sec: float
    qps: float
    output_tokens: int
    tokens_per_sec: float
    subsampled: bool = False
    batch_limit: str = ""  # the knob that bounds `concurrency`, e.g. "max_num_seqs=256"
    extra: dict = field(default_factory=dict)


def _result(backend, num_requests, concurrency, elapsed, output_tokens, subsampled=False,
            batch_limit="", **extra):
    return BenchResult(backend=backend, num_requests=num_requests, concurrency=concurrency,
                       elapsed_sec=round(elapsed, 4), qps=round(num_requests / elapsed, 3),
                       output_tokens=output_tokens,
                       tokens_per_sec=round(output_tokens / elapsed, 1), subsampled=subsampled,
                       batch_limit=batch_limit, extra=extra)


SAME_SHAPES = "the timed requests' shapes, prompt token ids reversed"  # what `warm_up` runs


@dataclass
class Warmup:
    """What a benchmark ran, untimed, before its first timed run on an engine (or an HF mode)."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    steps: Optional[int] = None  # engine steps (None: an HF baseline, which keeps no trace)
    what: str = SAME_SHAPES

    def to_dict(self) -> dict:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "steps": self.steps,
                "seconds": round(self.seconds, 3), "what": self.what}

    def __str__(self) -> str:
        steps = "" if self.steps is None else f", {self.steps} steps"
        return (f"warm-up (untimed): {self.requests} request{'s' * (self.requests != 1)}, "
                f"{self.prompt_tokens:,} prompt + "
                f"{self.output_tokens:,} output tokens{steps}, {self.seconds:.2f} s")


def token_ids(llm, prompt) -> list[int]:
    """A prompt (text, token ids or {"prompt_token_ids": ...}) as the engine's token ids."""
    if isinstance(prompt, str):
        return llm.engine.tokenize(prompt)
    if isinstance(prompt, dict):
        return list(prompt["prompt_token_ids"])
    return list(prompt)


def warm_up(llm, prompts, params, lora_request=None, what: str = SAME_SHAPES) -> Warmup:
    """Run `prompts` with `params` (one SamplingParams or one per prompt) once, untimed, their
    token ids reversed: the same batch, prompt lengths and output lengths as the timed run that
    follows, none of its prefixes. Every kernel variant the timed run meets is compiled (on a
    GPU) and every buffer it needs allocated, so its first step is as fast as its others."""
    ids = [token_ids(llm, p)[::-1] for p in prompts]
    first = len(llm.engine.trace)
    t0 = time.perf_counter()
    outs = llm.generate(ids, params, use_tqdm=False, lora_request=lora_request)
    _sync(llm)
    seconds = time.perf_counter() - t0
    return Warmup(len(ids), sum(map(len, ids)),
                  sum(len(c.token_ids) for o in outs for c in o.outputs), seconds,
                  len(llm.engine.trace) - first, what)


def _sync(llm) -> None:
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()


def step_ms(trace) -> dict:
    """A timed window's first step against its median step (engine trace, wall ms), and the
    sequences the first step ran. Warm, the first step is the batch's prefill, which costs what
    its prompts cost (on the CPU about two or three decode steps a prompt); cold, it also
    carries the engine's first-use costs (kernel compiles on a GPU, allocations)."""
    times = sorted(r.duration for r in trace)
    if not times:
        return {"steps": 0, "first": None, "median": None, "first_over_median": None,
                "first_step_sequences": 0}
    first, median = trace[0].duration, times[len(times) // 2]
    return {"steps": len(times), "first": round(first * 1e3, 3),
            "median": round(median * 1e3, 3),
            "first_over_median": round(first / median, 2) if median else None,
            "first_step_sequences": len(trace[0].scheduled)}


def percentiles_ms(xs: list[float]) -> dict:
    """p50 / p90 / p99 of durations in seconds, in milliseconds (numpy's linear interpolation);
    None for each when there are no samples."""
    if not len(xs):
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(np.asarray(xs, dtype=float) * 1e3, [50, 90, 99])
    return {"p50": round(float(p50), 2), "p90": round(float(p90), 2), "p99": round(float(p99), 2)}


def run_minipaged(llm, wl: Workload, temperature: float = 0.0,
                  use_tqdm: bool = False, warmup: bool = True) -> BenchResult:
    """The workload on `llm`, timed; first (`warmup`) its shapes once untimed (`warm_up`), so
    the run meets no kernel variant, graph or buffer for the first time. `warmup=False`: the
    caller has warmed this engine with the same shapes already."""
    from minipaged import SamplingParams
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, seed=None)
              for m in wl.max_tokens]
    warm = warm_up(llm, wl.prompts, params).to_dict() if warmup else None
    _sync(llm)
    first_step = len(llm.engine.trace)
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    itl = [(o.metrics["finished_time"] - o.metrics["first_token_time"]) / (len(o.outputs[0].token_ids) - 1)
           for o in outs if len(o.outputs[0].token_ids) > 1]
    trace = llm.engine.trace[first_step:]
    peak = max((len(r.scheduled) for r in trace), default=0)  # sequences in the largest step
    return _result("minipaged", len(outs), peak, elapsed, tokens,
                   batch_limit=f"max_num_seqs={llm.engine.config.max_num_seqs}", ttft_ms=percentiles_ms(ttft), itl_ms=percentiles_ms(itl),
                   preemptions=sum(o.metrics["num_preemptions"] for o in outs),
                   **step_breakdown(trace), **bandwidth(llm, wl, elapsed, trace),
                   warmup=warm, step_ms=step_ms(trace))


def step_breakdown(trace) -> dict:
    """Where the wall time went, from the engine's trace: steps with prefill tokens vs decode-only
    steps, and how long the host waited for the GPU (async scheduling; 0 when synchronous)."""
    prefill = [r for r in trace if r.num_prefill_tokens]
    decode = [r for r in trace if r.num_batched_tokens and not r.num_prefill_tokens]
    return {"prefill_steps": len(prefill), "prefill_sec": round(sum(r.duration for r in prefill), 3),
            "decode_steps": len(decode), "decode_sec": round(sum(r.duration for r in decode), 3),
            "host_wait_sec": round(sum(r.wait_time for r in trace), 3)}


# Memory bandwidth on the spec sheet (GB/s), to report a run's share of the device limit.
PEAK_GB_PER_S = {"H200": 4800, "H100 NVL": 3900, "H100 80GB HBM3": 3350, "H100 PCIe": 2000,
                 "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100-SXM4-40GB": 1555}


def bandwidth(llm, wl: Workload, elapsed: float, trace) -> dict:
    """Bytes the run must read (weights once per step of `trace`, as stored: fp8 weights one byte
    each, + every sequence's KV at every decode step), per second, and its share of the GPU's spec-sheet bandwidth when known."""
    eng = llm.engine
    mc = eng.model_config
    elem = torch.tensor([], dtype=eng.dtype).element_size()
    weight_bytes = mc.num_parameters() * elem
    params = list(eng.model.parameters())  # quantized weights (fp8) take fewer bytes than elem
    weight_bytes = int(weight_bytes * sum(p.numel() * p.element_size() for p in params)
                       / (sum(p.numel() for p in params) * elem))
    steps = [r for r in trace if r.num_batched_tokens]
    kv_per_token = mc.kv_bytes_per_token(eng.kv_dtype)
    kv_read = 0
    for p, m in zip(wl.prompts, wl.max_tokens):  # decode step t reads len(p) + t tokens of KV
        kv_read += kv_per_token * (m * len(p) + m * (m - 1) // 2)
    n_steps = len(steps)
    total = weight_bytes * n_steps + kv_read
    out = {"approx_bytes_read_gb": round(total / 1e9, 2),
           "achieved_gb_per_s": round(total / elapsed / 1e9, 2)}
    if eng.device.type == "cuda":
        name = out["device"] = torch.cuda.get_device_name(eng.device)
        peak = next((v for k, v in PEAK_GB_PER_S.items() if k in name), None)
        if peak is not None:
            out["peak_gb_per_s"] = peak
            out["share_of_peak"] = round(total / elapsed / 1e9 / peak, 3)
    return out


HF_WARMUP_TOKENS = 8  # new tokens per request of an HF baseline's warm-up


def run_hf(backend: str, model, wl: Workload, batch_size: int, subsampled: bool,
           progress: Optional[Callable[[int], None]] = None, warmup: bool = True) -> BenchResult:
    """One HF mode on the workload, timed; first (`warmup`) the same mode untimed on its first
    batch (hf-sequential: one request; hf-static: `batch_size` requests; hf-cb: all of them, as
    it admits them all at once), `HF_WARMUP_TOKENS` new tokens each."""
    import minipaged.benchmark.hf_baselines as baseline

    def call(w: Workload, on_finished=None):
        args = (model, w.prompts, w.max_tokens)
        return {"hf-sequential": lambda: baseline.hf_sequential(*args, on_finished=on_finished),
                "hf-static": lambda: baseline.hf_static(*args, batch_size,
                                                        on_finished=on_finished),
                "hf-cb": lambda: baseline.hf_continuous(*args, on_finished=on_finished)
                }[backend]()
    n = len(wl.prompts)
    warm = None
    if warmup:
        first = wl.subset({"hf-sequential": 1, "hf-static": batch_size}.get(backend, n))
        w = call(Workload(wl.name, first.prompts,
                          [min(m, HF_WARMUP_TOKENS) for m in first.max_tokens]))
        warm = Warmup(len(first.prompts), first.num_prompt_tokens, w.output_tokens, w.elapsed,
                      what=f"this mode on its first batch, {HF_WARMUP_TOKENS} new tokens "
                           "each").to_dict()
    r = call(wl, progress)
    # hf-cb admits every request at once (max_requests_per_batch=n, a cache that holds them all):
    # its peak batch is n, as configured (transformers does not report it).
    peak, limit = {"hf-sequential": (1, "one at a time"),
                   "hf-static": (min(batch_size, n), f"batch_size={batch_size}"),
                   "hf-cb": (n, f"max_requests_per_batch={n}")}[backend]
    return _result(backend, n, peak, r.elapsed, r.output_tokens, subsampled=subsampled,
                   batch_limit=limit, padded_tokens=r.padded_tokens, warmup=warm)


def format_table(results: list[BenchResult]) -> str:
    hf = [r for r in results if r.backend.startswith("hf")]
    best = max(hf, key=lambda r: r.tokens_per_sec) if hf else None
    rows = ["| backend | requests | peak batch | batch limit | elapsed s | qps | output tokens "
            "| tok/s | vs best HF |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        ratio = f"{r.tokens_per_sec / best.tokens_per_sec:.2f}x" if best else "-"
        name = r.backend + (" (subsample)" if r.subsampled else "")
        rows.append(f"| {name} | {r.num_requests} | {r.concurrency} | {r.batch_limit or '-'} | "
                    f"{r.elapsed_sec:.2f} | {r.qps:.2f} | {r.output_tokens} | "
                    f"{r.tokens_per_sec:,.0f} | {ratio} |")
    return "\n".join(rows)


def environment() -> dict:
    import transformers
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
           "machine": platform.machine(), "cpu_threads": torch.get_num_threads()}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def hf_from_dummy(llm):
    """An HF model with the same dummy weights, for baselines on presets."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from minipaged.models.weights import stacked_sizes
    if llm.engine.config.quantization is not None:
        raise ValueError(f"the HF baselines copy the engine's dummy weights, and with "
                         f"quantization={llm.engine.config.quantization!r} those are quantized: "
                         "run the HF backends without --quantization")
    src = llm.engine.source
    cfg = AutoConfig.for_model(**src.config)
    with torch.device(llm.engine.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=llm.engine.dtype)
    sd = {}
    for name, p in llm.engine.model.named_parameters():  # unstack our fused weights
        if ".qkv_proj." in name:
            q, k, v = p.split(stacked_sizes(llm.engine.model.config, "qkv_proj", p.shape[0]))
            for part, t in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
                sd[name.replace("qkv_proj", part)] = t
        elif ".gate_up_proj." in name:
            g, u = p.chunk(2)
            sd[name.replace("gate_up_proj", "gate_proj")] = g
            sd[name.replace("gate_up_proj", "up_proj")] = u
        else:
            sd[name] = p
    model.load_state_dict(sd, strict=False)
    return model.eval()

