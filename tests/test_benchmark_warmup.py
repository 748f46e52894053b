"""Every benchmark times warm engines: each one's CPU path, one repeat, tiny sizes.

Each benchmark runs as its documentation runs it, as a fresh process (a cold engine's first-use
costs show most in a process that has run nothing yet: the issue's 26x came from the first
setting of `spec_decode.py --repeats 1`), writing its JSON. Every timed setting there carries
`step_ms` (`lessons.bench.step_ms`, read from the engine's trace: its first timed step and its
median step) and a warm-up record ("warmup": its own, or its engine's one level up). Two checks:

* the warm-up ran the timed run's shapes: as many output tokens as the timed run (the same
  requests, prompt lengths and max_tokens; greedy, EOS ignored). Deterministic.
* no setting's first timed step takes more than `MAX_FIRST_OVER_MEDIAN` (5) times its median
  step. The first timed step is the batch's prefill, so the runs here keep it one prompt (one
  request); measured on 2 shared cores with stories260K, such a prefill on a warm engine takes
  1.4-4.2x a decode step (a LoRA prefill of the 58-token prompt 6.5x: lora runs a 16-token one);
  the same step of a cold engine (no warm-up, the first forward of the process: allocations,
  first calls) took 4.5-17x. A longer first step (many prompts at once) is legitimately slower,
  hence the tiny sizes.

Timing on shared cores is noisy: another process can stall any one step for 5-10 ms, as long as a
cold engine's first-use costs on the CPU. A cold engine is slow on every run and a stall is not,
so a benchmark with a slow first step runs again (`ATTEMPTS` runs at most, fresh processes) and
the test fails only if a setting's best ratio over the runs stays above 5. That keeps the timing
check from failing on noise, and leaves it to catch large first-step costs (a GPU's compiles,
seconds each). With the warm-up disabled (`warm_up` returning without running anything) the
first check fails for every benchmark here; the timing check alone failed for bench, preemption
and structured_outputs in both of two runs and for fp8 in one (the first setting each time,
best ratios 5.0-6.1x), not for spec_decode and lora, whose cold first step on the CPU is 2-5 ms
and fell under 5x in at least one of the four runs.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_FIRST_OVER_MEDIAN = 5.0
ATTEMPTS = 4  # runs of a benchmark at most, while some setting's first step stays slow

BENCHMARKS = {  # the CPU path of each benchmark, one repeat, one prompt in the first step
    "spec_decode": ["benchmarks/spec_decode.py", "--batches", "1", "--ks", "0,2",
                    "--max-tokens", "32", "--repeats", "1", "--out", "{out}"],
    "bench": ["-m", "minipaged.cli", "bench", "--workload", "cpu", "--num-requests", "1",
              "--backends", "minipaged", "--cpu-threads", "1", "--disable-tqdm",
              "--json", "{out}"],
    "lora": ["benchmarks/lora.py", "--workload", "fixed", "--input-len", "16", "--output-len",
             "96", "--num-requests", "1", "--counts", "0,1", "--repeats", "1", "--out", "{out}"],
    "fp8": ["benchmarks/fp8.py", "--tiny", "--num-requests", "1", "--out", "{out}"],
    "preemption": ["benchmarks/preemption.py", "--num-requests", "1", "--cache-tokens", "384",
                   "--block-sizes", "16", "--modes", "none,recompute,swap", "--repeats", "1",
                   "--out", "{out}", "--figure", "{tmp}/preemption.png"],
    "structured_outputs": ["benchmarks/structured_outputs.py", "--num-requests", "1",
                           "--max-tokens", "32", "--out", "{out}"],
}


def timed_settings(doc, path: str = "", above: tuple = ()):
    """(path, setting, the dicts above it) for every dict of a JSON document with a `step_ms`."""
    if isinstance(doc, dict):
        if isinstance(doc.get("step_ms"), dict):
            yield path, doc, above
        for k, v in doc.items():
            yield from timed_settings(v, f"{path}/{k}", above + (doc,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from timed_settings(v, f"{path}/{i}", above)


def nearest(setting: dict, above: tuple, key: str, want=lambda v: True):
    """`key` of the setting, or of the closest dict above it that has one."""
    for d in (setting, *reversed(above)):
        if key in d and want(d[key]):
            return d[key]
    return None


def run_benchmark(name: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{name}.json"
    args = [a.format(out=out, tmp=tmp_path) for a in BENCHMARKS[name]]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "warm-up (untimed)" in proc.stdout, proc.stdout[-2000:]  # printed, as recorded
    return json.loads(out.read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_first_timed_step_is_warm(name, tmp_path):
    best: dict[str, float] = {}
    for _ in range(ATTEMPTS):
        settings = list(timed_settings(run_benchmark(name, tmp_path)))
        assert settings, f"{name}: no step_ms in its JSON"
        for path, setting, above in settings:
            warm = nearest(setting, above, "warmup", lambda w: isinstance(w, dict)
                           and "output_tokens" in w)
            assert warm is not None, f"{name} {path}: no warm-up recorded"
            assert warm["seconds"] > 0 and warm["output_tokens"] == nearest(
                setting, above, "output_tokens"), (f"{name} {path}: the warm-up did not run the "
                                                   f"timed run's shapes: {warm}")
            s = setting["step_ms"]
            assert s["steps"] > 1 and s["first_step_sequences"] == 1, (path, s)
            best[path] = min(best.get(path, float("inf")), s["first_over_median"])
        if max(best.values()) <= MAX_FIRST_OVER_MEDIAN:
            break
    slow = {p: r for p, r in best.items() if r > MAX_FIRST_OVER_MEDIAN}
    assert not slow, (f"{name}: first timed step over {MAX_FIRST_OVER_MEDIAN}x the median step "
                      f"in every one of {ATTEMPTS} runs (a cold engine?): {slow}")
