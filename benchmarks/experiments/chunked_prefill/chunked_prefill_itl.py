"""Chunked prefill and the decodes already running: their inter-token latency while long
prompts arrive, chunked prefill on (a small max_num_batched_tokens) against off.

    # stories260K on the CPU
    .venv/bin/python benchmarks/experiments/chunked_prefill/chunked_prefill_itl.py

`minipaged.lessons.chunked_prefill.measure_decode_itl` (lesson 03 runs it small): 8 short
requests decode 200 tokens each, greedy, EOS ignored; once they all decode, a 448-token prompt
arrives every 20 steps (8 of them). One engine with `enable_chunked_prefill=True,
max_num_batched_tokens=64`, one with chunked prefill off (its budget must hold a whole prompt:
`max_model_len` = 512), both in this run, interleaved 5 times; each way keeps its run with the
lowest ITL p99. Each engine is warmed up first, untimed, with every kind of step the timed runs
make (the 8 decodes for 8 tokens and one long prompt arriving); the JSON keeps what each warm-up
ran ("warmup" in each run) and it is printed. Times are CPU time per step
(`time.process_time`), robust to a busy machine.
Prints ITL p50/p99 of the running decodes and the long prompts' time to first token, and writes
benchmarks/experiments/chunked_prefill/chunked_prefill_itl_cpu_stories260k.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stories260K")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent
                                         / "chunked_prefill_itl_cpu_stories260k.json"))
    a = ap.parse_args()
    import torch

    from minipaged.lessons.bench import Warmup, environment
    from minipaged.lessons.chunked_prefill import measure_decode_itl

    res = measure_decode_itl(a.model, num_decodes=8, decode_tokens=200, num_long=8,
                             long_len=448, arrival_every=20,
                             max_num_batched_tokens=a.max_num_batched_tokens,
                             repeats=a.repeats, device=a.device)
    res["environment"] = environment()
    res["torch_threads"] = torch.get_num_threads()
    print(f"{'run':<22} {'budget':>6} {'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8} "
          f"{'long TTFT':>10}  (ms CPU)")
    for name, r in res["runs"].items():
        print(f"{name:<22} {r['max_num_batched_tokens']:>6} {r['itl_p50_ms']:>8.2f} "
              f"{r['itl_p99_ms']:>8.2f} {r['itl_max_ms']:>8.2f} {r['long_prompt_ttft_ms']:>10.2f}")
    for name, r in res["runs"].items():
        print(f"{name}: after a {Warmup(**r['warmup'])}")
    print(f"off / on: ITL p99 {res['p99_off_over_on']:.2f}x, p50 {res['p50_off_over_on']:.2f}x; "
          f"long-prompt TTFT on / off {res['ttft_on_over_off']:.2f}x")
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
