"""`minipaged bench [MODEL]`: minipaged's throughput beside the naive Hugging Face baselines.

(`minipaged bench serve ...` is the other benchmark: requests at a rate against a running
server, cli/bench_serve.py; `minipaged bench serve --help`.)

The workloads, runners and table live in `minipaged/benchmark/throughput.py` (lessons 03 and 08
use them too, and its docstring is below); this is the command line around them, with every engine
flag of `EngineConfig`. A bar counts the backends and one the requests of each (`--disable-tqdm`
hides them); the table goes to stdout and, with `--json FILE`, with the environment into FILE
(rewritten after every backend, so a run stopped later keeps its rows). Each backend is warmed
up untimed before its timed run (`lessons.bench.warm_up`, `run_hf`); each result line says what
the warm-up was, and the JSON keeps it ("warmup", by backend).
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Optional

from minipaged.cli.args import (FlexibleArgumentParser, add_common_args, add_engine_args,
                                engine_config_from_args, int_at_least)
from minipaged.cli.errors import run_command
import minipaged.benchmark.throughput as throughput
from minipaged.benchmark.throughput import BACKENDS, WORKLOADS, BenchResult


def make_parser() -> FlexibleArgumentParser:
    ap = FlexibleArgumentParser(prog="minipaged bench",
                                description=__doc__ + "\n" + throughput.__doc__)
    w = ap.add_argument_group("workload and backends")
    w.add_argument("--workload", default="cpu", choices=WORKLOADS, help="the request mix")
    w.add_argument("--num-requests", type=int_at_least(1), default=None,
                   help="requests in the workload (default: 64; nanovllm: 256)")
    w.add_argument("--input-len", type=int_at_least(1), default=128,
                   help="prompt tokens per request of the `fixed` workload")
    w.add_argument("--output-len", type=int_at_least(1), default=128,
                   help="output tokens per request of the `fixed` workload")
    w.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    w.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"comma-separated, from {', '.join(BACKENDS)}")
    w.add_argument("--hf-batch-size", type=int_at_least(1), default=64,
                   help="requests per padded batch of hf-static")
    w.add_argument("--hf-max-requests", type=int_at_least(1), default=None,
                   help="run the HF baselines on the first N requests only (labelled subsample)")
    w.add_argument("--hf-sequential-max-requests", type=int_at_least(1), default=None,
                   help="the same for hf-sequential alone (the slowest)")
    w.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    w.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    add_engine_args(ap)  # the same engine flags as `minipaged generate` and `serve`
    add_common_args(ap)
    return ap


def parse_backends(text: str) -> list[str]:
    backends = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise ValueError(f"--backends {text!r}: unknown {unknown}; choose from "
                         f"{', '.join(BACKENDS)}" if unknown else "--backends: none given")
    return backends


def bench(argv: list[str]) -> int:
    args = make_parser().parse_args(argv)
    backends = parse_backends(args.backends)
    config = engine_config_from_args(args)  # checked before the model loads
    from tqdm.auto import tqdm

    from minipaged import LLM
    llm = LLM(**asdict(config))
    model, mc = llm.config.model, llm.engine.model_config
    wl = throughput.make_workload(
        args.workload, mc.vocab_size, args.num_requests, args.seed, args.input_len,
        args.output_len, bos=mc.bos_token_id if args.workload != "nanovllm" else None,
        max_model_len=llm.engine.config.max_model_len)
    print(f"workload {wl.name}: {len(wl.prompts)} requests, {wl.num_prompt_tokens} prompt tokens, "
          f"{sum(wl.max_tokens)} output tokens; model {model}"
          + (" (dummy weights)" if llm.engine.source.dummy else ""), flush=True)
    results: list[BenchResult] = []

    def report() -> dict:  # written after every backend: a run stopped later keeps these rows
        rep = {"environment": throughput.environment(), "model": model,
               "command": "minipaged bench " + " ".join(argv),
               "workload": {"name": wl.name, "num_requests": len(wl.prompts), "seed": args.seed,
                            "prompt_tokens": wl.num_prompt_tokens,
                            "output_tokens": sum(wl.max_tokens),
                            "temperature": args.temperature, "ignore_eos": True},
               "warmup": {r.backend: r.extra.get("warmup") for r in results},
               "results": [asdict(r) for r in results],
               "table": throughput.format_table(results)}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rep, f, indent=1)
        return rep

    def done(result: BenchResult) -> None:
        results.append(result)
        warm = result.extra.get("warmup")
        tqdm.write(f"{result.backend}: {result.tokens_per_sec:,.0f} tok/s"
                   + (f" (after a {throughput.Warmup(**warm)})" if warm else ""),
                   file=sys.stdout)
        report()

    quiet = args.disable_tqdm
    with tqdm(total=len(backends), desc="backends", unit="backend", disable=quiet,
              dynamic_ncols=True) as outer:
        if "minipaged" in backends:
            outer.set_postfix_str("minipaged")
            done(throughput.run_minipaged(llm, wl, args.temperature, use_tqdm=not quiet))
            outer.update(1)
        hf_backends = [b for b in backends if b.startswith("hf")]
        if hf_backends:
            hf_model = load_hf_twin(llm)
            del llm
        for b in hf_backends:
            outer.set_postfix_str(b)
            limit = args.hf_sequential_max_requests if b == "hf-sequential" else None
            limit = limit or args.hf_max_requests
            sub = wl.subset(limit) if limit and limit < len(wl.prompts) else wl
            with tqdm(total=len(sub.prompts), desc=b, unit="req", leave=False, disable=quiet,
                      dynamic_ncols=True) as bar:
                try:
                    done(throughput.run_hf(b, hf_model, sub, args.hf_batch_size,
                                              sub is not wl, progress=bar.update))
                except Exception as e:  # one baseline failing must not lose the others' numbers
                    tqdm.write(f"{b}: failed ({type(e).__name__}: {e})", file=sys.stdout)
            outer.update(1)
    print(report()["table"])
    return 0


def load_hf_twin(llm):
    """The same model in transformers: from its folder, or the dummy preset's weights copied."""
    from minipaged.benchmark.hf_baselines import load_hf_model
    if llm.engine.source.path is None:
        return throughput.hf_from_dummy(llm)
    return load_hf_model(str(llm.engine.source.path), llm.engine.dtype, str(llm.engine.device))


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # vLLM's `vllm bench serve`: the load client
        from minipaged.cli import bench_serve
        return bench_serve.main(argv[1:])
    return run_command(bench, argv)


if __name__ == "__main__":
    raise SystemExit(main())
