"""`minipaged bench`: minipaged's throughput beside the naive Hugging Face baselines.

The workloads, runners and table live in `minipaged/lessons/bench.py` (lessons 03 and 08 use
them too); this is the command line around them, with every engine flag of `EngineConfig`.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Optional

from minipaged.cli.args import HelpFormatter, add_engine_args, engine_kwargs
from minipaged.lessons.bench import (BACKENDS, WORKLOADS, BenchResult, environment, format_table,
                                     hf_from_dummy, make_workload, run_hf, run_minipaged)
from minipaged.lessons import bench as _bench_doc  # its docstring is the --help text

def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(prog="minipaged bench", description=_bench_doc.__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--workload", default="cpu", choices=WORKLOADS)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-max-requests", type=int, default=None,
                    help="run the HF baselines on the first N requests only (labelled subsample)")
    ap.add_argument("--hf-sequential-max-requests", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    add_engine_args(ap)  # the same engine flags as `minipaged generate` and `serve`
    args = ap.parse_args(argv)

    from minipaged import LLM
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        ap.error(f"unknown backends {sorted(unknown)}; choose from {BACKENDS}")
    llm = LLM(**engine_kwargs(args))
    args.model = llm.config.model
    mc = llm.engine.model_config
    wl = make_workload(args.workload, mc.vocab_size, args.num_requests, args.seed, args.input_len,
                       args.output_len, bos=mc.bos_token_id if args.workload != "nanovllm" else None,
                       max_model_len=llm.engine.config.max_model_len)
    print(f"workload {wl.name}: {len(wl.prompts)} requests, {wl.num_prompt_tokens} prompt tokens, "
          f"{sum(wl.max_tokens)} output tokens; model {args.model}"
          + (" (dummy weights)" if llm.engine.source.dummy else ""), flush=True)
    results: list[BenchResult] = []

    def report() -> dict:  # written after every backend: a run stopped later keeps these rows
        table = format_table(results)
        rep = {"environment": environment(), "model": args.model,
               "command": "minipaged bench " + " ".join(argv if argv is not None else sys.argv[1:]),
               "workload": {"name": wl.name, "num_requests": len(wl.prompts), "seed": args.seed,
                            "prompt_tokens": wl.num_prompt_tokens,
                            "output_tokens": sum(wl.max_tokens),
                            "temperature": args.temperature, "ignore_eos": True},
               "results": [asdict(r) for r in results], "table": table}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rep, f, indent=1)
        return rep

    if "minipaged" in backends:
        results.append(run_minipaged(llm, wl, args.temperature))
        print(f"minipaged: {results[-1].tokens_per_sec:,.0f} tok/s", flush=True)
        report()
    hf_backends = [b for b in backends if b.startswith("hf")]
    if hf_backends:
        from minipaged.lessons.baseline import load_hf_model
        if llm.engine.source.path is None:
            hf_model = hf_from_dummy(llm)
        else:
            hf_model = load_hf_model(str(llm.engine.source.path), llm.engine.dtype,
                                     str(llm.engine.device))
        del llm
        for b in hf_backends:
            limit = args.hf_sequential_max_requests if b == "hf-sequential" else None
            limit = limit or args.hf_max_requests
            sub = wl.subset(limit) if limit and limit < len(wl.prompts) else wl
            try:
                results.append(run_hf(b, hf_model, sub, args.hf_batch_size, sub is not wl))
            except Exception as e:  # one baseline failing must not lose the others' numbers
                print(f"{b}: failed ({type(e).__name__}: {e})", flush=True)
                continue
            print(f"{b}: {results[-1].tokens_per_sec:,.0f} tok/s", flush=True)
            report()
    rep = report()
    print(rep["table"])
    return rep


if __name__ == "__main__":
    main()
