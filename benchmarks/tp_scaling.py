"""Tensor-parallel scaling on one machine: throughput, a decode step's split, parity, busbw.

    python benchmarks/tp_scaling.py --parity          # GPUs: N = 1, 2, 4 (as many as present)
    python benchmarks/tp_scaling.py --device cpu --models stories260K --sizes 1,2 \
        --num-requests 8 --parity                      # the CPU with gloo (proves it, ~20 s)

Two H200s: the first line, one call (about 4-5 min). Four: two calls of about 3-4 min, the
second merging into the first's JSON (put the first's file in benchmarks/results/ first):
    python benchmarks/tp_scaling.py --models dummy:qwen3-0.6b --parity
    python benchmarks/tp_scaling.py --models dummy:qwen3-8b --phases throughput --merge
The phases run in the order parity, busbw, throughput (correctness first).

Phases (`--phases`, default throughput,busbw; `--parity` adds parity), for each N of `--sizes`:

  throughput  for each of `--models`: `LLM(model, tensor_parallel_size=N)` on nano-vllm's
              workload (`minipaged bench --workload nanovllm`: 256 requests, input and output
              lengths U[100, 1024], seed 0, EOS ignored, temperature 0.6) with the README's H200
              settings (bf16, KV blocks of 128, 8192 batched tokens, CUDA graphs, async
              scheduling): output tok/s and per-request ITL p50 / p99, after a warm-up of the
              workload's shapes, untimed (`lessons.bench.run_minipaged`; each row's "warmup"
              says what it ran, "step_ms" its first timed step beside its median step). Then,
              in the same engine, decode steps of `--split-batches` sequences
              (`--split-prompt-len` tokens each), after their prefill and 3 untimed decode
              steps, under torch.profiler on rank 0: the step's wall time, the time in
              all-reduce (NCCL's AllReduce kernels; gloo:all_reduce on the CPU), in the other
              collectives (the step's broadcast, the logits' gather) and in the rest (compute:
              every other kernel on the GPU; the step's wall minus its collectives on the CPU).
              Rank 0's collective time includes waiting for the slower ranks.
  parity      stories260K in float32, greedy: the tokens at every N > 1 against N = 1, with
              CUDA graphs on and off (CPU: off only)
  busbw       all-reduce bus bandwidth (benchmarks/lib/tp_busbw.py, nccl-tests' busbw) at the
              sizes a decode step sends (batch x hidden x bytes, batch 1 .. 256) and a sweep up
              to `--sweep-max-mib`; each step split is then put beside the all-reduce time the
              measured bandwidth predicts for its (1 + 2 x layers) all-reduces

The NCCL environment variables (NCCL_NVLS_ENABLE and the rest) are left as they are set.
Dummy weights (random, fixed seed) for the presets: the speed is the architecture's, the text
is noise. JSON: benchmarks/results/tp_scaling_<machine>.json ($OUT/... when $OUT is set, or
--out), rewritten after every row; `--merge` keeps an earlier file's other phases.
Figure: python benchmarks/plot.py tp_scaling (figures/tp_scaling_h200.png).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))  # tp_busbw

import torch  # noqa: E402

import tp_busbw  # noqa: E402
from minipaged.lessons import bench  # noqa: E402

MODELS = "dummy:qwen3-0.6b,dummy:qwen3-8b"
PARITY_PROMPTS = ("Once upon a time", "The little dog", "Lily wanted to", "One day, a bird",
                  "Tom and his mom", "The sun was")


def machine_name(device: str) -> str:
    """'h200x2' for two H200s, 'cpu' on the CPU."""
    if device != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(0).replace("NVIDIA", "").strip().split()[0].lower()
    return f"{name}x{torch.cuda.device_count()}"


def default_sizes(device: str, gpus: int) -> list[int]:
    return [n for n in (1, 2, 4) if device != "cuda" or n <= gpus]


def split_events(events, wall_s: float, steps: int, cuda: bool) -> dict:
    """A profiled window of `steps` decode steps -> per-step seconds. `events`: (name,
    is_device, duration_us) per profiler event; on CUDA only device events count."""
    ar = other = compute = 0.0
    calls = 0
    for name, is_device, dur in events:
        low = name.lower()
        if cuda:
            if not is_device:
                continue
            if "nccl" in low and "allreduce" in low:
                ar, calls = ar + dur, calls + 1
            elif "nccl" in low:
                other += dur
            else:
                compute += dur
        elif low == "gloo:all_reduce":
            ar, calls = ar + dur, calls + 1
        elif low.startswith("gloo:"):
            other += dur
    ar, other, compute = ar / 1e6 / steps, other / 1e6 / steps, compute / 1e6 / steps
    step = wall_s / steps
    if not cuda:
        compute = max(0.0, step - ar - other)
    return {"step_ms": round(step * 1e3, 3), "compute_ms": round(compute * 1e3, 3),
            "all_reduce_ms": round(ar * 1e3, 3), "other_comm_ms": round(other * 1e3, 3),
            "all_reduces_per_step": calls / steps}


def step_split(llm, batch: int, prompt_len: int, steps: int, warm: int = 3) -> dict:
    """`steps` decode steps of `batch` sequences in the engine, profiled on rank 0."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    from minipaged import SamplingParams
    eng = llm.engine
    cuda = eng.device.type == "cuda"
    rng = random.Random(batch)
    vocab = min(eng.model_config.vocab_size, 10000)
    params = SamplingParams(temperature=0.0, max_tokens=warm + steps + 4, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"split-{batch}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)],
                        params)
    while eng.scheduler.waiting or any(s.is_prefill for s in eng.scheduler.running):
        eng.step()
    for _ in range(warm):
        eng.step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        wall = time.perf_counter() - t0
    running = len(eng.scheduler.running)
    while eng.has_unfinished_requests():
        eng.step()
    events = [(e.name, e.device_type == DeviceType.CUDA, e.time_range.elapsed_us())
              for e in prof.events()]
    out = {"batch": batch, "running": running, "steps": steps, **split_events(
        events, wall, steps, cuda)}
    if cuda:
        out["device_events"] = sum(1 for _, dev, _ in events if dev)
    return out


def _release() -> None:
    """After the caller dropped its LLM: its workers stop, the GPU's cached blocks go."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_throughput(model: str, n: int, args) -> dict:
    from minipaged import LLM
    t0 = time.perf_counter()
    llm = LLM(model, dtype=args.dtype, device=args.device, tensor_parallel_size=n,
              block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=args.enforce_eager, seed=0)
    build_s = time.perf_counter() - t0
    mc = llm.engine.model_config
    wl = bench.make_workload(args.workload, mc.vocab_size, args.num_requests, seed=0,
                             bos=None if args.workload == "nanovllm" else mc.bos_token_id,
                             max_model_len=llm.engine.config.max_model_len)
    r = bench.run_minipaged(llm, wl, temperature=args.temperature)
    row = {"model": model, "tp": n, "build_s": round(build_s, 1), "hidden_size": mc.hidden_size,
           "num_layers": mc.num_hidden_layers, "num_requests": r.num_requests,
           "output_tokens": r.output_tokens, "elapsed_s": r.elapsed_sec,
           "tokens_per_sec": r.tokens_per_sec, "itl_ms": r.extra["itl_ms"],
           "ttft_ms": r.extra["ttft_ms"], "preemptions": r.extra["preemptions"],
           "warmup": r.extra["warmup"], "step_ms": r.extra["step_ms"],
           "cuda_graphs": llm.engine.config.use_cuda_graphs,
           "splits": [step_split(llm, b, args.split_prompt_len, args.split_steps)
                      for b in args.split_batches]}
    for s in row["splits"]:  # fewer seen than sent: the profiler missed kernels (CUDA graphs?)
        s["all_reduces_expected"] = 1 + 2 * mc.num_hidden_layers if n > 1 else 0
    llm = None
    _release()
    return row


def run_parity(sizes, args) -> list[dict]:
    from minipaged import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=args.parity_tokens, ignore_eos=True)
    rows = []
    cuda = args.device == "cuda"
    small = {"gpu_memory_utilization": 0.05} if cuda else {}  # a KV cache of ~7 GiB, not 90%
    for eager in ((False, True) if cuda else (True,)):
        ref = None
        for n in sizes:
            try:
                llm = LLM("stories260K", dtype="float32", device=args.device,
                          tensor_parallel_size=n, enforce_eager=eager, seed=0, **small)
                graphs = llm.engine.config.use_cuda_graphs
                toks = [list(o.outputs[0].token_ids)
                        for o in llm.generate(list(PARITY_PROMPTS), params, use_tqdm=False)]
            except Exception as exc:  # noqa: BLE001 (recorded; the other rows go on)
                from minipaged.distributed.parallel_state import destroy_groups
                destroy_groups()
                rows.append({"tp": n, "cuda_graphs": not eager, "equal_to_tp1": None,
                             "error": f"{type(exc).__name__}: {exc}"})
                print(f"parity N={n} eager={eager}: {rows[-1]['error']}", flush=True)
                continue
            finally:
                llm = None
                _release()
            if n == 1:
                ref = toks
            mism = None if ref is None else [i for i, (a, b) in enumerate(zip(toks, ref))
                                             if a != b]
            rows.append({"tp": n, "cuda_graphs": graphs,
                         "equal_to_tp1": None if mism is None else not mism,
                         "mismatched_prompts": mism, "tokens": sum(map(len, toks))})
            print(f"parity N={n} graphs={graphs}: {mism or 'equal'}", flush=True)
    return rows


def run_busbw(sizes, hidden_sizes, args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    decode = tp_busbw.decode_message_sizes(hidden_sizes, elem)
    sweep = tp_busbw.sweep_sizes(args.sweep_max_mib << 20)
    allsizes = sorted(set(decode) | set(sweep))
    rows = []
    for n in (n for n in sizes if n > 1):
        for r in tp_busbw.measure(n, allsizes, args.device, dtype, iters=args.busbw_iters):
            rows.append({"tp": n, "decode_size": r["bytes"] in decode, **r})
    return rows


def beside_busbw(report: dict) -> None:
    """Each step split gets `all_reduce_at_busbw_ms`: its all-reduce count (measured, or
    1 + 2 x layers) times one all-reduce of (batch, hidden) at the measured bandwidth."""
    elem = torch.tensor([], dtype=getattr(torch, report["settings"]["dtype"])).element_size()
    times = {(r["tp"], r["bytes"]): r["time_us"] for r in report.get("busbw", [])}
    for row in report.get("throughput", []):
        for s in row.get("splits", []):
            t = times.get((row["tp"], s["batch"] * row["hidden_size"] * elem))
            count = s["all_reduces_per_step"] or 1 + 2 * row["num_layers"]
            s["all_reduce_at_busbw_ms"] = round(t * count / 1e3, 3) if t else None


def format_tables(report: dict) -> str:
    out = ["| model | N | output tok/s | vs N=1 | ITL p50 ms | ITL p99 ms | build s |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    base = {}
    for r in report.get("throughput", []):
        if "error" in r:
            out.append(f"| {r['model']} | {r['tp']} | error: {r['error'][:60]} | | | | |")
            continue
        ref = base.setdefault(r["model"], r["tokens_per_sec"])
        out.append(f"| {r['model']} | {r['tp']} | {r['tokens_per_sec']:,.0f} | "
                   f"{r['tokens_per_sec'] / ref:.2f}x | {r['itl_ms']['p50']} | "
                   f"{r['itl_ms']['p99']} | {r['build_s']} |")
    out += ["", "| model | N | batch | step ms | compute ms | all-reduce ms (per step) | "
            "other comm ms | all-reduce at measured busbw ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report.get("throughput", []):
        for s in r.get("splits", []):
            out.append(f"| {r['model']} | {r['tp']} | {s['batch']} | {s['step_ms']} | "
                       f"{s['compute_ms']} | {s['all_reduce_ms']} "
                       f"({s['all_reduces_per_step']:g}) | {s['other_comm_ms']} | "
                       f"{s.get('all_reduce_at_busbw_ms')} |")
    if any(s.get("device_events") == 0 or s["all_reduces_per_step"] < s.get(
            "all_reduces_expected", 0) for r in report.get("throughput", [])
           for s in r.get("splits", [])):
        out.append("\nsome steps show fewer all-reduces than they send (1 + 2 x layers): the "
                   "profiler missed kernels (CUDA graphs?); rerun those with --enforce-eager")
    if report.get("parity"):
        out += ["", "| parity N | CUDA graphs | equal to N=1 |", "|---:|---|---|"]
        out += [f"| {p['tp']} | {p['cuda_graphs']} | {p['equal_to_tp1']} |"
                for p in report["parity"]]
    if report.get("busbw"):
        out += ["", "| N | bytes | decode size | time us | algbw GB/s | busbw GB/s |",
                "|---:|---:|---|---:|---:|---:|"]
        out += [f"| {b['tp']} | {b['bytes']:,} | {'yes' if b['decode_size'] else ''} | "
                f"{b['time_us']} | {b['algbw_gbps']} | {b['busbw_gbps']} |"
                for b in report["busbw"]]
    return "\n".join(out)


def parse_args(argv):
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default=MODELS, help="comma-separated")
    ap.add_argument("--sizes", type=ints, default=None, help="N values (default 1,2,4, capped "
                                                             "at the GPUs present)")
    ap.add_argument("--phases", default="throughput,busbw")
    ap.add_argument("--parity", action="store_true", help="add the parity phase")
    ap.add_argument("--num-requests", type=int, default=None, help="default: the workload's")
    ap.add_argument("--workload", default=None, choices=bench.WORKLOADS,
                    help="default: nanovllm on CUDA, cpu on the CPU")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--block-size", type=int, default=None, help="default 128 (CPU 16)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="default 8192 (CPU 2048)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--split-batches", type=ints, default=None, help="default 1,64,256 (CPU 1,8)")
    ap.add_argument("--split-prompt-len", type=int, default=None, help="default 512 (CPU 32)")
    ap.add_argument("--split-steps", type=int, default=10)
    ap.add_argument("--parity-tokens", type=int, default=64)
    ap.add_argument("--sweep-max-mib", type=int, default=None, help="default 256 (CPU 1)")
    ap.add_argument("--busbw-iters", type=int, default=None, help="default 20 (CPU 5)")
    ap.add_argument("--machine", default=None, help="the JSON's name (default: h200x2, cpu, ..)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", action="store_true",
                    help="keep the other phases (and models) of --out, or of the same name in "
                         "benchmarks/results/ when --out does not exist yet")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    for name, gpu, cpu in (("workload", "nanovllm", "cpu"), ("dtype", "bfloat16", "float32"),
                           ("block_size", 128, 16), ("max_num_batched_tokens", 8192, 2048),
                           ("split_batches", [1, 64, 256], [1, 8]),
                           ("split_prompt_len", 512, 32), ("sweep_max_mib", 256, 1),
                           ("busbw_iters", 20, 5)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    if args.sizes is None:
        args.sizes = default_sizes(args.device, torch.cuda.device_count() if cuda else 0)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    phases = set(args.phases.split(",")) | ({"parity"} if args.parity else set())
    results = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out = Path(args.out or results / f"tp_scaling_{args.machine or machine_name(args.device)}"
                                     ".json")
    # --merge: the earlier run's file, from --out or (a fresh $OUT) from benchmarks/results/
    earlier = [p for p in (out, ROOT / "benchmarks" / "results" / out.name) if p.exists()]
    report = json.loads(earlier[0].read_text()) if args.merge and earlier else {}
    command = "python benchmarks/tp_scaling.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    report.setdefault("commands", []).append(command)  # every run merged into this file
    report.update({"environment": dict(bench.environment(), gpus=torch.cuda.device_count()),
                   "command": command,
                   "settings": {k: v for k, v in vars(args).items()},
                   "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}})

    def save():
        beside_busbw(report)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))  # a run stopped later keeps its rows

    models = [m for m in args.models.split(",") if m]
    if "parity" in phases:
        report["parity"] = run_parity(args.sizes, args)
        save()
    if "busbw" in phases:
        from minipaged.models.loader import resolve_model
        extra = MODELS.split(",") if args.device == "cuda" else []  # both presets' sizes
        hidden = sorted({resolve_model(m).config["hidden_size"] for m in models + extra})
        report["busbw"] = run_busbw(args.sizes, hidden, args)
        save()
    if "throughput" in phases:
        # --merge keeps the earlier rows of the models not run now
        report["throughput"] = [r for r in report.get("throughput", [])
                                if r["model"] not in models]
        for model in models:
            for n in args.sizes:
                try:
                    row = run_throughput(model, n, args)
                except Exception as exc:  # noqa: BLE001 (recorded; the other rows go on)
                    from minipaged.distributed.parallel_state import destroy_groups
                    destroy_groups()
                    row = {"model": model, "tp": n, "error": f"{type(exc).__name__}: {exc}"}
                report["throughput"].append(row)
                print(f"{model} N={n}: " + (row.get("error") or
                      f"{row['tokens_per_sec']:,.0f} tok/s, ITL p50 {row['itl_ms']['p50']} ms, "
                      f"after a {bench.Warmup(**row['warmup'])}"), flush=True)
                save()
    print(format_tables(report))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
