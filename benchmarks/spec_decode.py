"""Speculative decoding, side by side with it off, in one run.

    .venv/bin/python benchmarks/spec_decode.py            # CPU: stories260K, batch 1 / 8 / 64
    python benchmarks/spec_decode.py --h200               # the H200 run (about 4 minutes)

CPU (default): stories260K, greedy story openings (lessons/spec_decode_measure.story_prompts),
EOS ignored, 256 tokens each, at batch 1, 8 and 64, with speculation off and with n-gram prompt
lookup at k = 2 and 4 (prompt_lookup_max 4, min 1). The settings of one batch size run in turns
(best of --repeats), so machine load falls on every side alike. Before its first timed run every
engine (each setting, each batch size, each side of the --h200 runs) runs the same requests'
shapes once untimed (lessons.bench.warm_up: the same batch, prompt lengths and max_tokens, token
ids reversed), so --repeats 1 times warm engines as --repeats 3 does. A round of one setting
is the median pass of at least --min-sec seconds of passes (1 s with --h200, where a pass of
stories260K takes about 0.1 s and one pass is one draw of the host's jitter; one pass on the
CPU); each setting's warm-up
(requests, tokens, steps, seconds) is printed and written to its row ("warmup"), beside its
first timed step against its median step ("step_ms"). Each row: tokens/s and its ratio
to off, the median inter-token latency, target forwards, time per forward, tokens per forward
and the share of guesses kept. Writes benchmarks/results/spec_decode_cpu_stories260k.json.

--h200 adds, on CUDA (writes spec_decode_h200.json):
  * the same stories260K table;
  * one stream of dummy Qwen3-0.6B (bf16) with the dummy:qwen3-0.6b-draft preset as the draft
    model (k = 4) against no speculation. Both sets of weights are random, so the draft's guesses
    are almost never the target's: this measures what the machinery costs, the acceptance it
    reports is the honest one of random weights;
  * the nano-vllm workload (256 requests, bf16, block_size 128, temperature 0.6, as
    nanovllm_h200.sh, with a 56 GiB KV cache on both sides) with speculation off and with
    n-gram k = 4.
The issue's goals: one stream of stories260K with n-gram at least 1.8x the tokens/s of off; the
'off' engine within 3% of the engine before speculative decoding existed (that one needs two
checkouts: benchmarks/experiments/engine_ab/ab_h200.sh).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from minipaged.lessons import spec_decode_measure as sdm  # noqa: E402

DRAFT_PRESET = "dummy:qwen3-0.6b-draft"


def run_to_dict(r: sdm.SpecRun) -> dict:
    d = dataclasses.asdict(r)
    d.update(acceptance_rate=round(r.acceptance_rate, 4), ms_per_step=round(r.ms_per_step, 3),
             tokens_per_step=round(r.tokens_per_step, 3), itl_ms=round(r.itl_ms, 3),
             tokens_per_sec=round(r.tokens_per_sec, 1), elapsed_sec=round(r.elapsed_sec, 4))
    return d


def with_ratios(runs: list[sdm.SpecRun]) -> list[dict]:
    base = {r.batch: r.tokens_per_sec for r in runs if r.setting == "off"}
    return [dict(run_to_dict(r), vs_off=round(r.tokens_per_sec / base[r.batch], 3)) for r in runs]


def warmup_lines(rows) -> str:
    """One line per setting: what its engine ran untimed before it was timed."""
    from minipaged.lessons.bench import Warmup
    return "\n".join(f"       {r.setting:12s} {Warmup(**r.warmup)}" for r in rows if r.warmup)


def warmup_summary(result: dict) -> dict:
    """The warm-ups of every engine of the run, added up (each row holds its own)."""
    rows = [r for key in ("stories260k",) for r in result[key]]
    rows += result.get("qwen3_0.6b_one_stream_draft", {}).get("runs", [])
    rows += result.get("qwen3_0.6b_nanovllm", [])
    warm = [r["warmup"] for r in rows if r.get("warmup")]
    return {"what": "before its first timed run, each engine ran its setting's requests once "
                    "untimed: the same batch, prompt lengths and max_tokens, token ids reversed",
            "engines": len(warm), "requests": sum(w["requests"] for w in warm),
            "output_tokens": sum(w["output_tokens"] for w in warm),
            "seconds": round(sum(w["seconds"] for w in warm), 2)}


def release() -> None:
    """Give the engines of the last comparison back (they are unreachable once it returns)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stories(device: str, batches, ks, max_tokens: int, repeats: int,
            min_sec: float = 0.0) -> list[sdm.SpecRun]:
    """stories260K at each batch size, every k in turns; one set of engines per batch size."""
    runs = []
    for batch in batches:
        # A fixed cache (64 sequences x 512 tokens of stories260K is 40 MiB): engines that live
        # side by side on a GPU do not each take gpu_memory_utilization of it.
        runs += sdm.compare("stories260K", batch, ks=ks, max_tokens=max_tokens, repeats=repeats,
                            device=device, num_blocks=4096, min_sec=min_sec)
        print(sdm.format_runs([r for r in runs if r.batch == batch]), flush=True)
        print(warmup_lines([r for r in runs if r.batch == batch]), flush=True)
        release()
    return runs


def draft_one_stream(device: str, max_tokens: int, k: int, repeats: int,
                     min_sec: float = 0.0) -> list[sdm.SpecRun]:
    """One stream of dummy Qwen3-0.6B: no speculation vs the dummy draft preset."""
    import random
    rng = random.Random(0)
    prompt = [[rng.randrange(1000, 100000) for _ in range(64)]]
    configs = {0: ("off", None),
               k: (f"draft k={k}", {"method": "draft_model", "model": DRAFT_PRESET,
                                   "num_speculative_tokens": k})}
    runs = sdm.compare("dummy:qwen3-0.6b", 1, ks=(0, k), max_tokens=max_tokens, repeats=repeats,
                       prompts=prompt, configs=configs, device=device, dtype="bfloat16",
                       max_model_len=2048, num_blocks=512, min_sec=min_sec)
    release()
    return runs


def full_batch(device: str, k: int, num_requests: int) -> list[dict]:
    """The nano-vllm workload with speculation off and with n-gram k, one engine at a time."""
    from minipaged import LLM
    from minipaged.lessons.bench import Warmup, make_workload, run_minipaged
    out = []
    for setting, spec in (("off", None), (f"ngram k={k}", sdm.ngram_config(k))):
        # As nanovllm_h200.sh runs it, but both sides get the same KV cache (56 GiB: every
        # request at its longest, 256 x 2048 tokens), whether or not the first engine's memory
        # has gone back when the second starts. On the CPU (a check of this script): a context
        # that fits, and the CPU's default cache.
        size = ({"max_model_len": 2048} if device == "cpu" else
                {"kv_cache_memory": 56 * 2**30})
        llm = LLM("dummy:qwen3-0.6b", device=device, dtype="bfloat16", block_size=128,
                  max_num_batched_tokens=8192, speculative_config=spec, **size)
        wl = make_workload("nanovllm", llm.engine.model_config.vocab_size,
                           num_requests=num_requests)
        res = run_minipaged(llm, wl, temperature=0.6)  # warmed up first, with these shapes
        trace = llm.engine.trace[-res.extra["step_ms"]["steps"]:]  # the timed run's steps
        drafts = sum(r.num_draft_tokens_per_pos[0] for r in trace if r.num_draft_tokens_per_pos)
        proposed = sum(sum(r.num_draft_tokens_per_pos) for r in trace)
        accepted = sum(sum(r.num_accepted_tokens_per_pos) for r in trace)
        row = dict(setting=setting, warmup=res.extra.pop("warmup"), **dataclasses.asdict(res),
                   verify_rows=drafts, proposed=proposed, accepted=accepted,
                   acceptance_rate=round(accepted / proposed, 4) if proposed else 0.0)
        out.append(row)
        print(f"batch {res.concurrency:4d} {setting:12s} {res.tokens_per_sec:10,.0f} tok/s"
              + (f"  kept {accepted:,} of {proposed:,} guesses" if proposed else "")
              + f"\n       after a {Warmup(**row['warmup'])}", flush=True)
        del llm
        release()
    out[1]["vs_off"] = round(out[1]["tokens_per_sec"] / out[0]["tokens_per_sec"], 4)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--h200", action="store_true", help="the CUDA run (see the docstring)")
    ap.add_argument("--device", default=None, help="default: cpu, or cuda with --h200")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--ks", default="0,2,4", help="0 is speculation off")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-sec", type=float, default=None,
                    help="time each setting's round for at least this long, keeping its median "
                         "pass (default: 1.0 with --h200, where one pass takes a tenth of a "
                         "second; 0 on the CPU: one pass)")
    ap.add_argument("--draft-max-tokens", type=int, default=256, help="--h200: the Qwen3 stream")
    ap.add_argument("--num-requests", type=int, default=256, help="--h200: the full batch")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from minipaged.lessons.bench import environment
    from minipaged.lessons.figures import cpu_threads

    device = a.device or ("cuda" if a.h200 else "cpu")
    min_sec = a.min_sec if a.min_sec is not None else (1.0 if a.h200 else 0.0)
    if device == "cpu":
        cpu_threads(1)
    batches = [int(b) for b in a.batches.split(",")]
    ks = [int(k) for k in a.ks.split(",")]
    if 0 not in ks:
        raise SystemExit("--ks must include 0 (speculation off): every ratio is against it")
    ks = [0] + [k for k in ks if k]
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]  # other processes on the machine (the CPU is shared)
    result = {"command": " ".join(["python benchmarks/spec_decode.py", *(argv or sys.argv[1:])]),
              "device": device, "workload": f"stories260K, greedy story openings, "
              f"{a.max_tokens} tokens each, EOS ignored; best of {a.repeats}, settings in turns, "
              "each engine warmed up first (untimed, the same shapes); each round the median "
              f"pass of at least {min_sec} s of passes",
              "min_sec": min_sec,
              "stories260k": with_ratios(stories(device, batches, ks, a.max_tokens, a.repeats,
                                                 min_sec))}
    if a.h200:
        draft = draft_one_stream(device, a.draft_max_tokens, 4, a.repeats, min_sec)
        print(sdm.format_runs(draft), flush=True)
        print(warmup_lines(draft), flush=True)
        result["qwen3_0.6b_one_stream_draft"] = {
            "note": "dummy weights for target and draft: the acceptance is that of random "
                    "models, the cost of the draft machinery is real",
            "target": "dummy:qwen3-0.6b", "draft": DRAFT_PRESET, "runs": with_ratios(draft)}
        result["qwen3_0.6b_nanovllm"] = full_batch(device, 4, a.num_requests)
    result["warmup"] = warmup_summary(result)
    result["environment"] = dict(environment(), load_average_1min=[round(load_before, 2),
                                                                  round(os.getloadavg()[0], 2)])
    result["wall_sec"] = round(time.perf_counter() - t0, 1)
    name = "spec_decode_h200.json" if a.h200 else f"spec_decode_{device}_stories260k.json"
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / name
    out.write_text(json.dumps(result, indent=1) + "\n")
    one = [r for r in result["stories260k"] if r["batch"] == min(batches)]
    best = max(one, key=lambda r: r["vs_off"])
    print(f"\nbatch {min(batches)}: best {best['setting']} {best['vs_off']:.2f}x off "
          f"(goal on the H200: >= 1.8x); {result['warmup']['engines']} engines warmed up "
          f"untimed first ({result['warmup']['seconds']} s); wrote {out} in "
          f"{result['wall_sec']} s")


if __name__ == "__main__":
    main()
