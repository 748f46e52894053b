"""How long xgrammar takes to compile a constraint for a vocabulary: why a request's grammar is
compiled off the engine's thread (minipaged/structured_output/compiling.py).

For the synthetic 151,936-token vocabulary of Qwen3's size (benchmarks/lib/synthetic_tokenizer.py)
and for stories260K's 512 tokens, one compile each (the compiler's cache off) of: the
structured-outputs benchmark's JSON schema; an object of N string fields, each with its own
pattern; and a regex of M alternatives. Also how far the calling thread got meanwhile when the
compile ran on another thread (xgrammar releases the GIL: the longest pause of a busy loop).

    # ~2 min on 2 cores
    .venv/bin/python benchmarks/experiments/structured_outputs/structured_compile_times.py

writes benchmarks/experiments/structured_outputs/structured_compile_times_cpu.json.
"""
from __future__ import annotations

import argparse
import json
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


def specs(fields: int, alternatives: int) -> dict:
    from structured_outputs import SCHEMA
    props = {f"field_{i}": {"type": "string", "pattern": "[a-z]{1,%d}" % (i % 20 + 1)}
             for i in range(fields)}
    schema = {"type": "object", "properties": props, "required": list(props)[:fields // 2]}
    regex = "(" + "|".join(f"[a-z]{{{i},{i + 3}}}q{i}" for i in range(1, alternatives + 1)) + ")+"
    return {"benchmark schema": ("json", json.dumps(SCHEMA)),
            f"object of {fields} patterned string fields": ("json", json.dumps(schema)),
            f"regex of {alternatives} alternatives": ("regex", regex)}


def timed_compile(compiler, kind: str, spec: str) -> float:
    t0 = time.perf_counter()
    if kind == "json":
        compiler.compile_json_schema(spec)
    else:
        compiler.compile_regex(spec)
    return time.perf_counter() - t0


def longest_pause_beside(compiler, kind: str, spec: str) -> float:
    """The compile on another thread; the longest gap between this thread's loop turns."""
    done = threading.Event()
    worker = threading.Thread(target=lambda: (timed_compile(compiler, kind, spec), done.set()))
    worker.start()
    last, longest = time.perf_counter(), 0.0
    while not done.is_set():
        sum(range(1000))
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    return longest


def main() -> None:
    import torch
    import xgrammar as xgr
    from synthetic_tokenizer import write_synthetic_tokenizer
    from transformers import AutoTokenizer

    from minipaged.lessons.bench import environment
    from minipaged.models.loader import resolve_model
    ap = argparse.ArgumentParser()
    ap.add_argument("--fields", type=int, default=200)
    ap.add_argument("--alternatives", type=int, default=120)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        big = AutoTokenizer.from_pretrained(write_synthetic_tokenizer(folder, 151936))
    small = AutoTokenizer.from_pretrained(resolve_model("stories260K").path)
    results = {}
    for name, tok, size in (("synthetic 151,936", big, 151936), ("stories260K 512", small, 512)):
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=size)
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        results[name] = {}
        for what, (kind, spec) in specs(a.fields, a.alternatives).items():
            row = {"spec_chars": len(spec), "compile_s": round(timed_compile(compiler, kind,
                                                                             spec), 3)}
            if row["compile_s"] > 0.5:
                row["longest_pause_of_the_calling_thread_s"] = round(
                    longest_pause_beside(compiler, kind, spec), 4)
            results[name][what] = row
            print(f"{name:18s} {what:40s} {row}", flush=True)
    path = Path(__file__).resolve().parent / "structured_compile_times_cpu.json"
    path.write_text(json.dumps({
        "benchmark": "structured_compile_times",
        "command": "python benchmarks/experiments/structured_outputs/structured_compile_times.py"
                   f" --fields {a.fields} --alternatives {a.alternatives}",
        "library": "xgrammar " + version("xgrammar"), "by_vocabulary": results,
        "environment": environment()}, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
