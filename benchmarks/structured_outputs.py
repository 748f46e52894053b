"""What grammar masks cost: a batch of 64 requests with every row constrained against none.

    .venv/bin/python benchmarks/structured_outputs.py      # stories260K on the CPU

The CPU workload (64 requests, prompts U[4, 64], outputs U[16, 256], seed 0, greedy, EOS
ignored) runs three ways on one engine, one after the other (prefix caching off, so each way
prefills the same): no constraint; every row held to a JSON schema (an array of at least 1000
person objects, so no grammar ends before max_tokens and each way generates as many tokens); and
half the rows constrained. Before the first timed way the engine runs the workload's shapes once
untimed with half the rows constrained (lessons.bench.warm_up: the grammar compiled, every
kernel variant met; printed, and "warmup" in the JSON), so a single --runs times a warm engine.
It prints output tokens/s of each and their ratio to the unconstrained run, and the host time
`StructuredOutputManager.apply_masks` took per step (one batched fill of the constrained rows'
bitmasks plus launching `apply_token_bitmask_inplace`; on CUDA the forward runs meanwhile).
benchmarks/experiments/structured_outputs/structured_mask_step.py times the fill alone. Writes
benchmarks/results/structured_outputs_cpu_stories260k.json.

On a GPU, with Qwen3-0.6B's shapes and its 151,936-token vocabulary (dummy weights):

    python benchmarks/structured_outputs.py --model dummy:qwen3-0.6b --device cuda \
        --dtype bfloat16 --synthetic-vocab --runs 7

Dummy presets have no tokenizer, so `--synthetic-vocab` writes one of the model's vocabulary size
into a temporary folder first (benchmarks/lib/synthetic_tokenizer.py: byte-level BPE, offline,
deterministic) and passes it as `LLM(..., tokenizer=...)`. There the bitmask is copied to the GPU
and applied inside the sampling kernels (async scheduling, the CUDA default, fills the masks on
a worker thread and never calls `apply_masks`, so the mask columns stay empty there). `--runs N`
repeats the three ways N times, interleaved (every other round in reverse order), and reports
each way's median. The output file is named after the device and model
(structured_outputs_h200_qwen3-0.6b.json on an H200) unless `--out` says otherwise.
`--num-requests` and `--max-tokens` shrink the workload for a quick check.

Where the host's time goes, without a GPU: `--tiny-model` builds a 2-layer Qwen3 of the real
151,936-token vocabulary (random weights, with the synthetic tokenizer) in a temporary folder,
and `--async-scheduling` runs the constrained steps as a CUDA engine does (masks filled on the
worker thread, sampling deferred). `--breakdown` then times, per step of each way, what the main
thread spends on the grammar rows: `BackgroundFill.start` (advancing the matchers, including the
batched accept, and handing the fill over), the wait for the fill, `token_mask` and
`sample_masked` (the CPU's tokens/s are the CPU sampler's, not comparable to a GPU's; these
milliseconds are the host's part):

    .venv/bin/python benchmarks/structured_outputs.py --tiny-model --async-scheduling \
        --breakdown --runs 3

On a GPU, `--breakdown` gives the same columns for the real workload.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))  # synthetic_tokenizer

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pets": {"type": "array", "maxItems": 3,
                            "items": {"enum": ["cat", "dog", "fish"]}}}}}


def default_out(model: str, device: str) -> Path:
    """benchmarks/results/structured_outputs_<device>_<model>.json ("h200" for an H200)."""
    import torch
    where = "cpu"
    if device.startswith("cuda"):
        where = "h200" if "H200" in torch.cuda.get_device_name() else "cuda"
    name = model.split(":")[-1].rstrip("/").split("/")[-1].lower()
    return ROOT / "benchmarks" / "results" / f"structured_outputs_{where}_{name}.json"


def write_tiny_model(folder: str) -> str:
    """A 2-layer Qwen3 with dummy:qwen3-0.6b's vocabulary and special tokens, random weights
    (seed 0), and the synthetic tokenizer, written to `folder` as a Hugging Face model."""
    import torch
    from synthetic_tokenizer import write_synthetic_tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from minipaged.models.loader import resolve_model
    big = resolve_model("dummy:qwen3-0.6b").config
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=big["vocab_size"], hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, tie_word_embeddings=True, max_position_embeddings=1024,
                      bos_token_id=big["bos_token_id"], eos_token_id=big["eos_token_id"])
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    write_synthetic_tokenizer(folder, big["vocab_size"])
    return folder


class Breakdown:
    """Main-thread time of the grammar rows' work under async scheduling, by part: each part is
    a method wrapped with a timer (the class's, so every engine's), wall time and, beside it,
    the thread's CPU time (a part whose wall time is well above its CPU time waited: for a lock,
    the GIL, the GPU, or a core). `per_step` divides by the
    steps of the run. Beside it, per deferred step: the window the worker's fill has (from the
    end of `start` to the sampler asking for the fill's result), how long the fill took on the
    worker, and the share of steps whose sampling waited for it (over 0.05 ms)."""

    PARTS = {"start": ("minipaged.structured_output.background", "BackgroundFill", "start"),
             "batched accept": ("minipaged.structured_output.batch_calls", "BatchCalls",
                                "accept"),
             "fill wait": ("minipaged.structured_output.background", "FillJob", "result"),
             "token_mask": ("minipaged.structured_output.manager", "StructuredOutputManager",
                            "token_mask"),
             "sample_masked": ("minipaged.sampling.sampler", "Sampler", "sample_masked")}
    COUNTS = {"same-batch steps": ("minipaged.structured_output.background", "BackgroundFill",
                                   "_advance_same_batch")}

    def __init__(self):
        import importlib
        self.total: dict[str, float] = {}
        self.cpu: dict[str, float] = {}  # the main thread's CPU time in each part (thread_time)
        self.calls: dict[str, int] = {}
        self.windows: list[float] = []
        self.fills: list[float] = []
        self.waits: list[float] = []
        for name, (module, cls, method) in {**self.PARTS, **self.COUNTS}.items():
            try:
                owner = getattr(importlib.import_module(module), cls, None)
            except ImportError:  # (an older tree may lack it)
                owner = None
            if owner is not None and hasattr(owner, method):
                setattr(owner, method, self._timed(name, getattr(owner, method)))
        from minipaged.structured_output import background as bg
        start, result, fill = bg.BackgroundFill.start, bg.FillJob.result, bg._fill

        def timed_start(*args, **kwargs):
            job = start(*args, **kwargs)
            job.handed_over_at = time.perf_counter()
            return job

        def timed_result(job):
            t0 = time.perf_counter()
            out = result(job)
            if getattr(job, "handed_over_at", None) is not None:  # its first call: sampling
                self.windows.append(t0 - job.handed_over_at)
                self.waits.append(time.perf_counter() - t0)
                job.handed_over_at = None
            return out

        def timed_fill(mgr, job):  # on the worker thread
            t0 = time.perf_counter()
            try:
                return fill(mgr, job)
            finally:
                self.fills.append(time.perf_counter() - t0)
        bg.BackgroundFill.start, bg.FillJob.result, bg._fill = (timed_start, timed_result,
                                                                 timed_fill)

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t0
                self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c0
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed

    def clear(self) -> None:
        for kept in (self.total, self.cpu, self.calls, self.windows, self.fills, self.waits):
            kept.clear()

    def per_step(self, steps: int) -> dict:
        def median_ms(xs):
            return round(1e3 * sorted(xs)[len(xs) // 2], 3) if xs else None
        return {"host_ms_per_step": {k: round(1e3 * self.total.get(k, 0.0) / max(steps, 1), 3)
                                     for k in self.PARTS},
                # of that, the main thread on a CPU (the rest it waited: a lock, the GIL, the
                # GPU, or the OS running something else)
                "host_cpu_ms_per_step": {k: round(1e3 * self.cpu.get(k, 0.0) / max(steps, 1), 3)
                                         for k in self.PARTS},
                **{k: self.calls.get(k, 0) for k in self.COUNTS},
                "fill_window_ms_median": median_ms(self.windows),
                "worker_fill_ms_median": median_ms(self.fills),
                "share_of_steps_waiting_for_the_fill": (
                    round(sum(w > 5e-5 for w in self.waits) / len(self.waits), 3)
                    if self.waits else None)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stories260K")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    vocab = ap.add_mutually_exclusive_group()
    vocab.add_argument("--tokenizer", default=None,
                       help="a tokenizer folder (default: the model's)")
    vocab.add_argument("--synthetic-vocab", action="store_true",
                    help="build a byte-level tokenizer of the model's vocabulary size "
                         "(benchmarks/lib/synthetic_tokenizer.py) and use it")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="cap each request's output length (a quick check)")
    ap.add_argument("--max-model-len", type=int, default=512,
                    help="the context the engine is built for (the workload needs 320)")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV-cache blocks (default: sized from memory)")
    ap.add_argument("--runs", type=int, default=1, help="repeats of the three ways, interleaved")
    ap.add_argument("--tiny-model", action="store_true",
                    help="a 2-layer Qwen3 of the 151,936-token vocabulary, random weights, "
                         "with the synthetic tokenizer (host costs on the CPU)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="async scheduling (the CUDA default) on any device")
    ap.add_argument("--breakdown", action="store_true",
                    help="time the main thread's grammar work per step (instrumented runs)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import tempfile

    import torch

    from minipaged import LLM, SamplingParams
    from minipaged.lessons.bench import environment, make_workload, step_ms, warm_up
    from minipaged.models.loader import resolve_model
    from minipaged.structured_output import StructuredOutputsParams

    tokenizer = a.tokenizer
    if a.tiny_model:
        folder = tempfile.TemporaryDirectory(prefix="tiny_qwen3_vocab_")  # removed at exit
        a.model = tokenizer = write_tiny_model(folder.name)
    elif a.synthetic_vocab:
        from synthetic_tokenizer import write_synthetic_tokenizer
        vocab_size = resolve_model(a.model).config["vocab_size"]
        t0 = time.perf_counter()
        folder = tempfile.TemporaryDirectory(prefix="synthetic_vocab_")  # removed at exit
        tokenizer = str(write_synthetic_tokenizer(folder.name, vocab_size))
        print(f"synthetic {vocab_size:,}-token byte-level tokenizer in "
              f"{time.perf_counter() - t0:.1f} s: {tokenizer}")
    # no prefix caching: each way runs the same prompts and must prefill them as the first did
    if a.device == "cpu":
        torch.set_num_threads(1)  # 2 shared cores: torch's default threads slow a tiny model
    llm = LLM(a.model, device=a.device, dtype=a.dtype, tokenizer=tokenizer,
              max_model_len=a.max_model_len, num_blocks=a.num_blocks,
              enable_prefix_caching=False, seed=0,
              **({"async_scheduling": True} if a.async_scheduling else {}))
    eng = llm.engine
    tok = eng.tokenizer
    bos = tok.bos_token_id if tok is not None else None  # stories260K: 1; byte-level BPE: none
    wl = make_workload("cpu", eng.model_config.vocab_size, num_requests=a.num_requests, bos=bos)
    max_tokens = [m if a.max_tokens is None else min(m, a.max_tokens) for m in wl.max_tokens]
    so = StructuredOutputsParams(json=SCHEMA)
    mgr = eng.structured_output
    mask_times: list[float] = []
    apply = mgr.apply_masks

    def timed(logits, seqs):
        t0 = time.perf_counter()
        out = apply(logits, seqs)
        if any(s.sampling_params.structured_outputs is not None for s in seqs):
            mask_times.append(time.perf_counter() - t0)
        return out
    mgr.apply_masks = timed
    host = Breakdown() if a.breakdown else None
    ways = [("none", 0), ("all constrained", 1), ("half constrained", 2)]

    def way_params(every: int) -> list:
        return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True,
                               structured_outputs=so if every and i % every == 0 else None)
                for i, m in enumerate(max_tokens)]
    # Warm-up, untimed: the workload's shapes (every request, its prompt length and max_tokens,
    # token ids reversed) with half the rows constrained, so the grammar's compilation for this
    # vocabulary, the mask kernel on CUDA and every kernel variant of the run come before the
    # first timed way, constrained rows and free ones alike.
    warmup = warm_up(llm, wl.prompts, way_params(2),
                     what="the workload's shapes with half the rows constrained, prompt token "
                          "ids reversed")
    print(warmup, flush=True)
    runs: dict[str, list[dict]] = {name: [] for name, _ in ways}
    order_by_round = []
    for r in range(a.runs):
        # ABBA: odd rounds run the ways in reverse, so that a drift of the host's speed within
        # a round favours the constrained ways in one round and the unconstrained in the next
        order = ways if r % 2 == 0 else ways[::-1]
        order_by_round.append([name for name, _ in order])
        for name, every in order:
            params = way_params(every)
            mask_times.clear()
            if host is not None:
                host.clear()
            first = len(eng.trace)
            t0 = time.perf_counter()
            outs = llm.generate(wl.prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            runs[name].append({
                "elapsed_sec": round(elapsed, 3), "output_tokens": tokens,
                "steps": len(eng.trace) - first, "tokens_per_sec": round(tokens / elapsed, 1),
                "mask_ms_per_constrained_step": (round(1e3 * sum(mask_times) / len(mask_times), 3)
                                                 if mask_times else None),
                "mask_share_of_time": round(sum(mask_times) / elapsed, 3),
                "first_output": outs[0].outputs[0].text[:80],  # constrained: starts with "["
                "step_ms": step_ms(eng.trace[first:]),
                **({} if host is None else host.per_step(len(eng.trace) - first))})
    results = {}
    for name, rs in runs.items():  # each way's median run by tokens/s
        results[name] = dict(sorted(rs, key=lambda r: r["tokens_per_sec"])[len(rs) // 2])
        if a.runs > 1:
            results[name]["tokens_per_sec_all_runs"] = [r["tokens_per_sec"] for r in rs]
    base = results["none"]["tokens_per_sec"]
    for name, r in results.items():
        r["ratio_to_none"] = round(r["tokens_per_sec"] / base, 3)
        # Each round's ratio to that round's unconstrained run (the three ways run one after
        # the other): a host whose speed drifts between rounds moves both sides of a pair, and
        # the alternating order cancels a steady drift within rounds.
        paired = [x["tokens_per_sec"] / n["tokens_per_sec"] for x, n in zip(runs[name],
                                                                             runs["none"])]
        r["ratio_to_none_per_round"] = [round(x, 3) for x in paired]
        r["ratio_to_none_paired_median"] = round(statistics.median(paired), 3)
    workload = (f"cpu: {a.num_requests} requests, prompts U[4,64], outputs U[16,256]"
                + ("" if a.max_tokens is None else f" capped at {a.max_tokens}")
                + ", seed 0, greedy, ignore_eos")
    out = {"benchmark": "structured_outputs",
           "command": " ".join(["python benchmarks/structured_outputs.py", *sys.argv[1:]]),
           "model": "tiny Qwen3 (2 layers, hidden 64, vocab 151,936)" if a.tiny_model
           else a.model, "device": a.device,
           "async_scheduling": eng.config.async_scheduling,
           "dtype": str(llm.config.dtype),
           "tokenizer": ("synthetic byte-level BPE (benchmarks/lib/synthetic_tokenizer.py, seed 0)"
                         if a.synthetic_vocab or a.tiny_model else a.tokenizer or "the model's"),
           "workload": workload, "library": "xgrammar " + version("xgrammar"),
           "vocab_size": eng.model_config.vocab_size, "schema": SCHEMA, "runs": a.runs,
           "order": "rounds alternate: none, all, half; then half, all, none",
           "order_by_round": order_by_round, "warmup": warmup.to_dict(),
           "results": results, "environment": environment(), "torch_threads":
               torch.get_num_threads()}
    print(f"{'run':<18} {'tok/s':>8} {'ratio':>6} {'paired':>6} {'steps':>6} "
          f"{'mask ms/step':>13} {'mask share':>10}")
    for name, r in results.items():
        ms = r["mask_ms_per_constrained_step"]
        print(f"{name:<18} {r['tokens_per_sec']:>8.0f} {r['ratio_to_none']:>6.3f} "
              f"{r['ratio_to_none_paired_median']:>6.3f} {r['steps']:>6} "
              f"{'-' if ms is None else f'{ms:.3f}':>13} {r['mask_share_of_time']:>10.1%}")
    if host is not None:
        for name, r in results.items():
            print(f"{name:<18} main thread ms/step (of which on a CPU): " + ", ".join(
                f"{k} {v:.3f} ({r['host_cpu_ms_per_step'][k]:.3f})"
                for k, v in r["host_ms_per_step"].items())
                  + f"; fill window {r['fill_window_ms_median']} ms, worker's fill "
                  f"{r['worker_fill_ms_median']} ms (medians), steps waiting for it "
                  f"{r['share_of_steps_waiting_for_the_fill']}")
    path = Path(a.out) if a.out else default_out("tiny" if a.tiny_model else a.model, a.device)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
