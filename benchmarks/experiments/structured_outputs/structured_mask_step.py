"""The host's grammar work per step, on the CPU: one batched, threaded fill against a loop.

    .venv/bin/python benchmarks/experiments/structured_outputs/structured_mask_step.py \
        [--rows 64] [--steps 120]

A micro-benchmark of `StructuredOutputManager`'s per-step mask work, no model: `--rows` sequences,
each held to benchmarks/structured_outputs.py's JSON schema, over the synthetic Qwen3-sized
vocabulary (151,936 tokens, benchmarks/lib/synthetic_tokenizer.py). Each step it fills every row's
bitmask

  * row by row (`GrammarMatcher.fill_next_token_bitmask` in a Python loop, as the manager did), and
  * in one call (`manager.fill_bitmask`: `BatchGrammarMatcher.batch_fill_next_token_bitmask`) on
    1 thread, 2 threads and the manager's default `max_threads` (half the cores, at most 8),

in an order that rotates each step (so both sides see the same load on a shared machine), checks
the bitmasks agree, then draws one allowed token per row (seeded), appends it and times the
per-row `manager.accept` that follows each sampled token. Reports each side's median ms per step
and the ratio; writes benchmarks/experiments/structured_outputs/structured_mask_step_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent
                                         / "structured_mask_step_cpu.json"))
    a = ap.parse_args()
    import numpy as np
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from minipaged import SamplingParams
    from minipaged.engine.sequence import Sequence
    from minipaged.structured_output import StructuredOutputsParams
    from minipaged.structured_output.manager import StructuredOutputManager
    from structured_outputs import SCHEMA
    from synthetic_tokenizer import write_synthetic_tokenizer

    folder = tempfile.TemporaryDirectory(prefix="synthetic_vocab_")
    tok = AutoTokenizer.from_pretrained(str(write_synthetic_tokenizer(folder.name,
                                                                      a.vocab_size)))
    eos = [tok.eos_token_id]
    mgr = StructuredOutputManager(tok, a.vocab_size, eos, max_num_seqs=a.rows)
    params = SamplingParams(temperature=0, max_tokens=10_000,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    mgr.compile(params.structured_outputs)
    seqs = [Sequence(request_id=str(i), prompt_token_ids=[0], sampling_params=params)
            for i in range(a.rows)]
    counts = sorted({1, 2, mgr.max_threads})  # mgr.max_threads: the engine's default
    threads = {f"batched, {n} thread{'s' * (n > 1)}": n for n in counts}
    batches = {name: xgr.BatchGrammarMatcher(n) for name, n in threads.items()}
    loop_mask = xgr.allocate_token_bitmask(a.rows, a.vocab_size)

    def per_row():
        for i, seq in enumerate(seqs):
            mgr._state(seq).matcher.fill_next_token_bitmask(loop_mask, i)

    def batched(batch):
        def run():
            mgr._batch = batch
            mgr.fill_bitmask(seqs)
        return run
    sides = {"per-row loop": per_row, **{name: batched(b) for name, b in batches.items()}}
    times: dict[str, list[float]] = {name: [] for name in sides}
    accept_times: list[float] = []
    rng = random.Random(0)
    order = list(sides)
    for step in range(a.steps):
        order = order[1:] + order[:1]
        for name in order:
            t0 = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
        assert torch.equal(loop_mask, mgr._bitmask[:a.rows]), f"bitmasks differ at step {step}"
        words = mgr._bitmask[:a.rows].numpy().view(np.uint32)
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :a.vocab_size]
        bits[:, eos] = 0  # keep every grammar going (its array needs 1000 items)
        for seq, row in zip(seqs, bits):
            seq.append_token(rng.choice(np.flatnonzero(row).tolist()))
        t0 = time.perf_counter()
        for seq in seqs:
            assert mgr.accept(seq) is None
        accept_times.append(time.perf_counter() - t0)
    warm = min(10, a.steps // 4)
    ms = {name: round(1e3 * statistics.median(t[warm:]), 3) for name, t in times.items()}
    base = ms["per-row loop"]
    results = {name: {"fill_ms_per_step": m, "speedup_vs_loop": round(base / m, 2)}
               for name, m in ms.items()}
    out = {"benchmark": "structured_mask_step",
           "command": " ".join(["python benchmarks/experiments/structured_outputs/"
                                 "structured_mask_step.py", *sys.argv[1:]]),
           "rows": a.rows, "steps": a.steps, "warmup_steps_dropped": warm,
           "vocab_size": a.vocab_size, "library": "xgrammar " + version("xgrammar"),
           "cpu_count": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2),
           "results": results,
           "accept_ms_per_step": round(1e3 * statistics.median(accept_times[warm:]), 3),
           "output_tokens_per_row": a.steps}
    print(f"{a.rows} rows, {a.vocab_size:,}-token vocabulary, {a.steps} steps (median)")
    print(f"{'fill':<22} {'ms/step':>8} {'speedup':>8}")
    for name, r in results.items():
        print(f"{name:<22} {r['fill_ms_per_step']:>8.3f} {r['speedup_vs_loop']:>7.2f}x")
    print(f"{'accept (per row)':<22} {out['accept_ms_per_step']:>8.3f}")
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
