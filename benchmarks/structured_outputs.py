"""What grammar masks cost: a batch of 64 requests with every row constrained against none.

    .venv/bin/python benchmarks/structured_outputs.py      # stories260K on the CPU

The CPU workload (64 requests, prompts U[4, 64], outputs U[16, 256], seed 0, greedy, EOS
ignored) runs three ways on one engine, one after the other: no constraint; every row held to
a JSON schema (an array of at least 1000 person objects, so no grammar ends before max_tokens and
each way generates the same tokens); and half the rows constrained. It prints output tokens/s of
each and their ratio to the unconstrained run, and the time `StructuredOutputManager.apply_masks`
took per step (the matchers' `fill_next_token_bitmask` for each row plus one
`apply_token_bitmask_inplace`). Writes benchmarks/results/structured_outputs_cpu_stories260k.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pets": {"type": "array", "maxItems": 3,
                            "items": {"enum": ["cat", "dog", "fish"]}}}}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stories260K")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/"
                                         "structured_outputs_cpu_stories260k.json"))
    a = ap.parse_args()
    import torch

    from minipaged import LLM, SamplingParams
    from minipaged.lessons.bench import environment, make_workload
    from minipaged.structured_output import StructuredOutputsParams

    llm = LLM(a.model, device=a.device, seed=0)
    eng = llm.engine
    wl = make_workload("cpu", eng.model_config.vocab_size, bos=1)
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
    # warm-up: the engine, and the grammar's compilation for this vocabulary
    llm.generate([p[::-1] for p in wl.prompts[:16]],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                structured_outputs=so), use_tqdm=False)
    results = {}
    for name, every in [("none", 0), ("all constrained", 1), ("half constrained", 2)]:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True,
                                 structured_outputs=so if every and i % every == 0 else None)
                  for i, m in enumerate(wl.max_tokens)]
        mask_times.clear()
        first = len(eng.trace)
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = len(eng.trace) - first
        results[name] = {
            "elapsed_sec": round(elapsed, 3), "output_tokens": tokens, "steps": steps,
            "tokens_per_sec": round(tokens / elapsed, 1),
            "mask_ms_per_constrained_step": (round(1e3 * sum(mask_times) / len(mask_times), 3)
                                             if mask_times else None),
            "mask_share_of_time": round(sum(mask_times) / elapsed, 3)}
    base = results["none"]["tokens_per_sec"]
    for r in results.values():
        r["ratio_to_none"] = round(r["tokens_per_sec"] / base, 3)
    out = {"benchmark": "structured_outputs", "model": a.model, "device": a.device,
           "workload": "cpu: 64 requests, prompts U[4,64], outputs U[16,256], seed 0, greedy, "
                       "ignore_eos", "library": "xgrammar " + version("xgrammar"),
           "vocab_size": eng.model_config.vocab_size, "schema": SCHEMA, "runs": 1,
           "results": results, "environment": environment(), "torch_threads":
               torch.get_num_threads()}
    print(f"{'run':<18} {'tok/s':>8} {'ratio':>6} {'steps':>6} {'mask ms/step':>13} "
          f"{'mask share':>10}")
    for name, r in results.items():
        ms = r["mask_ms_per_constrained_step"]
        print(f"{name:<18} {r['tokens_per_sec']:>8.0f} {r['ratio_to_none']:>6.3f} {r['steps']:>6} "
              f"{'-' if ms is None else f'{ms:.3f}':>13} {r['mask_share_of_time']:>10.1%}")
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
