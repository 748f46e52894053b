"""The batched grammar fill against xgrammar's thread count, and what waiting does to the main
thread's next calls, on a GPU host.

64 matchers of benchmarks/structured_outputs.py's JSON schema over the synthetic 151,936-token
vocabulary (benchmarks/lib/synthetic_tokenizer.py), each advanced by 0-80 random allowed tokens
(seed 0), are filled in one `BatchGrammarMatcher.batch_fill_next_token_bitmask` call, as
structured_output/background.py's worker does each step. For each thread count it reports the
median fill, and the process's CPU time in the 2 ms after a fill while the main thread sleeps
(do xgrammar's threads spin?).

Beside it, the host time of the main thread's part of a constrained step (the bitmask's copy to the
GPU and the masked argmax's launch: `token_mask` and `sample_masked`) timed four ways: back to back;
right after waking from a 0.2 ms wait for another thread (the engine's hand-overs); after a 3 ms
sleep; right after a fill (the last three each after a CUDA synchronize, the GPU idle;
benchmarks/experiments/structured_outputs/structured_wait_ways.py varies the way of waiting). And
the cost of one small host-to-GPU copy while a fill runs on another thread. Needs a CUDA GPU (~1
min, most of it building the tokenizer).

    python benchmarks/experiments/structured_outputs/structured_fill_threads.py

writes structured_fill_threads_<gpu>.json beside this script.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import threading
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "lib"))

ROWS, VOCAB, THREADS = 64, 151936, (8, 4, 2, 1)


def median_us(xs) -> float:
    return round(1e6 * statistics.median(xs), 1)


def advanced_matchers(xgr, compiled, bitmask, seed: int = 0) -> list:
    """ROWS matchers, each advanced by 0-80 random allowed non-stop tokens."""
    import torch
    rng = random.Random(seed)
    shifts = torch.arange(32, dtype=torch.int32)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(ROWS)]
    for i, m in enumerate(matchers):
        for _ in range(rng.randint(0, 80)):
            m.fill_next_token_bitmask(bitmask, i)
            # (words, 32) bits -> (vocab,) allowed
            bits = ((bitmask[i][:, None] >> shifts) & 1).flatten()[:VOCAB]
            allowed = [t for t in bits.nonzero().flatten().tolist() if t < 151643]
            if not allowed:
                break
            assert m.accept_token(rng.choice(allowed))
    return matchers


def step_part_timer(bitmask):
    """The main thread's part of a constrained step on the GPU for `bitmask` ((ROWS, words) int32,
    pinned): `token_mask`'s copy of it, then `sample_masked`'s launch over random bf16 logits.
    Returns a function that runs it once and returns its host time in seconds."""
    import torch

    from minipaged.sampling import kernels as K
    from minipaged.sampling.params import TokenMask
    dev = torch.device("cuda")
    logits = torch.randn(ROWS, VOCAB, device=dev).to(torch.bfloat16)
    masked = torch.ones(ROWS, dtype=torch.int32, device=dev)
    keep = torch.full(((VOCAB + 31) // 32,), -1, dtype=torch.int32, device=dev)
    copied = torch.cuda.Event()

    def step_part() -> float:
        t0 = time.perf_counter()
        on_gpu = bitmask.to(dev, non_blocking=True)
        copied.record()
        K.masked_argmax(logits, TokenMask(on_gpu, masked, keep))
        return time.perf_counter() - t0
    return step_part


def main() -> None:
    import torch
    import xgrammar as xgr
    from structured_outputs import SCHEMA
    from synthetic_tokenizer import write_synthetic_tokenizer
    from transformers import AutoTokenizer

    from minipaged.lessons.bench import environment
    dev = torch.device("cuda")
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = AutoTokenizer.from_pretrained(write_synthetic_tokenizer(folder, VOCAB))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA))
    bitmask = xgr.allocate_token_bitmask(ROWS, VOCAB).pin_memory()
    matchers = advanced_matchers(xgr, compiled, bitmask)
    step_part = step_part_timer(bitmask)

    def small_copy(n: int = 10) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            torch.tensor([1, 2, 3]).to(dev, non_blocking=True)
        return (time.perf_counter() - t0) / n

    for _ in range(50):
        step_part()
    torch.cuda.synchronize()
    ways = {"back to back": [], "after a 0.2 ms wait for another thread": [],
            "after a 3 ms sleep": []}
    for _ in range(300):
        ways["back to back"].append(step_part())
    for _ in range(300):
        torch.cuda.synchronize()
        handed = threading.Lock()
        handed.acquire()
        threading.Timer(0.0002, handed.release).start()
        handed.acquire()  # the GIL released, woken by the other thread
        ways["after a 0.2 ms wait for another thread"].append(step_part())
    for _ in range(300):
        torch.cuda.synchronize()
        time.sleep(0.003)
        ways["after a 3 ms sleep"].append(step_part())
    quiet_copy = [small_copy() for _ in range(100)]
    main_thread = {k: median_us(v) for k, v in ways.items()}
    by_threads = {}
    for threads in THREADS:
        batch = xgr.BatchGrammarMatcher(threads)
        fills, after, idle_cpu, beside = [], [], [], []
        for _ in range(200):
            torch.cuda.synchronize()
            time.sleep(0.003)
            t0 = time.perf_counter()
            batch.batch_fill_next_token_bitmask(matchers, bitmask)
            fills.append(time.perf_counter() - t0)
            after.append(step_part())
            torch.cuda.synchronize()
            c0 = time.process_time()
            time.sleep(0.002)
            idle_cpu.append(time.process_time() - c0)
        for _ in range(100):
            worker = threading.Thread(target=batch.batch_fill_next_token_bitmask,
                                      args=(matchers, bitmask))
            worker.start()
            beside.append(small_copy())
            worker.join()
        by_threads[threads] = {
            "fill_us": median_us(fills), "step_part_right_after_a_fill_us": median_us(after),
            "process_cpu_us_in_2_ms_after_a_fill": median_us(idle_cpu),
            "small_copy_us_beside_a_fill": median_us(beside)}
        print(f"{threads} threads: {by_threads[threads]}")
    print(f"main thread's step part: {main_thread}; small copy alone {median_us(quiet_copy)} us")
    gpu = "h200" if "H200" in torch.cuda.get_device_name() else "cuda"
    path = Path(__file__).resolve().parent / f"structured_fill_threads_{gpu}.json"
    path.write_text(json.dumps({
        "benchmark": "structured_fill_threads",
        "command": "python benchmarks/experiments/structured_outputs/structured_fill_threads.py",
        "rows": ROWS,
        "vocab": VOCAB, "library": "xgrammar " + version("xgrammar"),
        "main_thread_step_part_us": main_thread,
        "small_copy_us_alone": median_us(quiet_copy),
        "by_fill_threads": by_threads, "environment": environment()}, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
