"""Where a second CPU thread pays: tok/s at 1 and N torch threads, by model width, idle and busy.

    python benchmarks/experiments/cpu_path/cpu_threads.py \
        --out benchmarks/experiments/cpu_path/cpu_threads_sweep.json

The measurement behind `auto_cpu_threads` (minipaged/worker/cpu_threads.py). For each hidden
size it builds a random Llama (fp32, 4 layers, head_dim 64 (8 for width 64, as stories260K),
MLP 2.75x wide, vocabulary 512 so that the layers, not the LM head, carry the work; written as
an HF folder in a temporary directory) and runs two workloads through `LLM.generate`:

* `batch`   16 requests, prompts U[4, 64], 32 output tokens each (decode batches of 16)
* `single`  one request, a 16-token prompt, 64 output tokens (the README's first snippet)

at 1 thread and at torch's default thread count (one per physical core), alternating within one
process (`--repeats` rounds, the median ratio is reported; round 0 runs every workload at every
thread count untimed first, as a warm-up: each row's "warmup" gives its requests, tokens and
seconds), first on the machine as it is
("idle": it waits until the cores are 95% idle), then with a burner process
(`while True: pass`) pinned to the last core ("busy"). Only ratios within one process are read;
`other_cores_busy` says how many cores other processes (the burner too) kept busy meanwhile.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def make_model(folder: str, hidden: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    head_dim = 8 if hidden <= 64 else 64
    heads = hidden // head_dim
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 8 * 8,
                      num_hidden_layers=4, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2), head_dim=head_dim, vocab_size=512,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)


def workloads():
    import random
    rng = random.Random(0)
    batch = [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(3, 63))] for _ in range(16)]
    single = [[1] + [rng.randrange(3, 512) for _ in range(15)]]
    return {"batch": (batch, 32), "single": (single, 64)}


def measure(folder: str, thread_counts: list[int], repeats: int) -> dict:
    """{"rates": {workload: {threads: [tok/s per round]}}, "warmup": round 0's requests, tokens
    and seconds}, the thread counts alternating round by round."""
    from minipaged import LLM, SamplingParams
    torch.set_num_threads(thread_counts[0])
    llm = LLM(folder, cpu_threads=thread_counts[0], max_model_len=512)
    out = {}
    warm = {"what": "round 0: every workload at every thread count, untimed", "requests": 0,
            "prompt_tokens": 0, "output_tokens": 0, "seconds": 0.0}
    for name, (prompts, max_tokens) in workloads().items():
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        rates = {n: [] for n in thread_counts}
        for r in range(repeats + 1):  # round 0 warms up
            for n in thread_counts:
                torch.set_num_threads(n)
                salted = [[p[0]] + [(t + 7 * r + n) % 509 + 3 for t in p[1:]] for p in prompts]
                t0 = time.perf_counter()
                outs = llm.generate(salted, params, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                if r:
                    rates[n].append(tokens / elapsed)
                else:
                    warm["requests"] += len(salted)
                    warm["prompt_tokens"] += sum(map(len, salted))
                    warm["output_tokens"] += tokens
                    warm["seconds"] = round(warm["seconds"] + elapsed, 3)
        out[name] = rates
    return {"rates": out, "warmup": warm}


def busy_seconds() -> float:
    """CPU seconds every process on the machine has used since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_for_idle(timeout: float = 300.0) -> None:
    """Until the machine's cores are 95% idle over two seconds (other people's jobs end)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        b0 = busy_seconds()
        time.sleep(2)
        if (busy_seconds() - b0) / (2 * os.cpu_count()) < 0.05:
            return
    print("machine not idle: measuring anyway (see other_cores_busy)", file=sys.stderr)


def summarize(rates: dict, many: int) -> dict:
    row = {}
    for name, by_threads in rates.items():
        one, more = by_threads[1], by_threads[many]
        row[name] = {"tok_s_1": round(statistics.median(one)), f"tok_s_{many}":
                     round(statistics.median(more)),
                     f"speedup_{many}_vs_1": round(statistics.median(m / o for o, m in
                                                                     zip(one, more)), 3)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden-sizes", default="64,128,256,512,1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loads", default="idle,busy")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # folder: measure one model
    a = ap.parse_args()
    many = torch.get_num_interop_threads()  # torch's default intra-op count (physical cores)
    if a.worker:
        print(json.dumps(measure(a.worker, [1, many], a.repeats)))
        return
    if many < 2:
        sys.exit("one physical core: nothing to compare")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for hidden in [int(h) for h in a.hidden_sizes.split(",")]:
            folder = os.path.join(tmp, f"llama-{hidden}")
            make_model(folder, hidden)
            for load in a.loads.split(","):
                burner = None
                wait_for_idle()
                if load == "busy":
                    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    os.sched_setaffinity(burner.pid, {max(os.sched_getaffinity(0))})
                    time.sleep(0.5)
                try:
                    busy0, ours0, t0 = busy_seconds(), _children_cpu(), time.time()
                    res = subprocess.run([sys.executable, __file__, "--worker", folder,
                                          "--repeats", str(a.repeats)], check=True,
                                         capture_output=True, text=True,
                                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
                    measured = json.loads(res.stdout.strip().splitlines()[-1])
                    rates = measured["rates"]
                    # cores other processes kept busy while it ran (the burner among them)
                    others = ((busy_seconds() - busy0) - (_children_cpu() - ours0)) / (
                        time.time() - t0)
                finally:
                    if burner is not None:
                        burner.kill()
                        burner.wait()
                rates = {w: {int(k): v for k, v in r.items()} for w, r in rates.items()}
                row = {"hidden_size": hidden, "load": load,
                       "other_cores_busy": round(others, 2),
                       **summarize(rates, many), "warmup": measured["warmup"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    from minipaged.lessons.bench import environment
    report = {"environment": environment() | {"cpu_threads": f"1 and {many}"},
              "command": ("python benchmarks/experiments/cpu_path/cpu_threads.py "
                          + " ".join(sys.argv[1:])),
              "model": "random Llama, fp32, 4 layers, vocabulary 512", "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
