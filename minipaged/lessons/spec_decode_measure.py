"""Lesson 10's timing runs: speculative decoding on one stream and on a full batch, side by side.

`compare` builds one `LLM` per setting (speculation off, n-gram with each k), warms each up with
the timed requests' shapes (`lessons.bench.warm_up`: the same batch, prompt lengths and
max_tokens, untimed, so that even one repeat times a warm engine), and times the same requests on
each in turns (round-robin repeats, best kept), so every setting meets the same machine load. A
row carries tokens/s, the inter-token latency (a request's decode time over its tokens after the
first), target forwards (engine steps) and the proposed / accepted counts the engine reports
(RequestOutput.metrics). benchmarks/spec_decode.py runs the
same function at batch 1, 8 and 64 on the CPU, and on an H200.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

NAMES = ("Lily", "Tom", "Ben", "Sue", "Max", "Mia", "Sam", "Anna")
OPENINGS = ("Once upon a time, {} found a {} in the garden.", "{} had a {} that could talk.",
            "One day, {} saw a big {} in the park.", "{} wanted to play with the {}.")
THINGS = ("ball", "cat", "box", "bird", "tree", "car", "dog", "kite")


def story_prompts(n: int) -> list[str]:
    """n distinct story openings (names x openings x things), in a fixed order."""
    out = [o.format(name, thing) for thing in THINGS for o in OPENINGS for name in NAMES]
    if n > len(out):
        raise ValueError(f"n must be at most {len(out)}, got {n}")
    return out[:n]


def ngram_config(k: int, prompt_lookup_max: int = 4) -> Optional[dict]:
    """vLLM's speculative_config for prompt lookup with k guesses; None for k = 0 (off)."""
    if k == 0:
        return None
    return {"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_max": prompt_lookup_max, "prompt_lookup_min": 1}


@dataclass
class SpecRun:
    setting: str  # "off" or "ngram k=4" ...
    batch: int  # requests running together
    output_tokens: int
    elapsed_sec: float
    tokens_per_sec: float
    itl_ms: float  # median over requests of (finished - first token) / (tokens - 1)
    steps: int  # target forwards (engine steps)
    proposed: int
    accepted: int
    warmup: Optional[dict] = None  # lessons.bench.Warmup.to_dict() of this setting's engine
    step_ms: Optional[dict] = None  # lessons.bench.step_ms: the first step against the median
    passes: int = 1  # passes in its timed round (the median one is this row; see `min_sec`)

    @property
    def ms_per_step(self) -> float:
        return self.elapsed_sec / self.steps * 1e3 if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.output_tokens / self.steps / self.batch if self.steps else 0.0


def _run_once(llm, prompts: Sequence[str], params, setting: str) -> SpecRun:
    from minipaged.lessons.bench import step_ms
    first_step = len(llm.engine.trace)
    t0 = time.perf_counter()
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    itls = sorted((o.metrics["finished_time"] - o.metrics["first_token_time"])
                  / (len(o.outputs[0].token_ids) - 1)
                  for o in outs if len(o.outputs[0].token_ids) > 1)
    return SpecRun(setting, len(prompts), tokens, elapsed, tokens / elapsed,
                   itls[len(itls) // 2] * 1e3 if itls else 0.0,
                   len(llm.engine.trace) - first_step,
                   sum(o.metrics.get("spec_num_draft_tokens", 0) for o in outs),
                   sum(o.metrics.get("spec_num_accepted_tokens", 0) for o in outs),
                   step_ms=step_ms(llm.engine.trace[first_step:]))


def compare(model: str, batch: int, ks: Sequence[int] = (0, 2, 4), max_tokens: int = 128,
            repeats: int = 3, prompt_lookup_max: int = 4, llms: Optional[dict] = None,
            prompts: Optional[Sequence] = None, configs: Optional[dict] = None,
            min_sec: float = 0.0, **llm_kw) -> list[SpecRun]:
    """Greedy, ignore_eos: `batch` prompts (default: story openings; or token id lists),
    `max_tokens` each, at every k (0 = off). Best of `repeats` per setting, the settings
    interleaved, each engine warmed up first with the same requests' shapes (untimed; the
    rows' `warmup` says what it ran). `configs` (k -> (name, speculative_config)) replaces the
    n-gram settings; `llms` (k -> LLM) reuses engines built before (their max_num_seqs must hold
    the batch). `min_sec`: each timed round runs the requests again and again until that long
    has passed and keeps its median pass (a pass of a tenth of a second on a GPU is otherwise
    one draw of the host's jitter); 0: one pass per round."""
    from minipaged import LLM, SamplingParams
    from minipaged.lessons.bench import warm_up
    prompts = list(prompts) if prompts is not None else story_prompts(batch)
    if len(prompts) != batch:
        raise ValueError(f"prompts must hold batch={batch} prompts, got {len(prompts)}")
    configs = configs or {k: ("off" if k == 0 else f"ngram k={k}",
                              ngram_config(k, prompt_lookup_max)) for k in ks}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llms = dict(llms or {})
    warm = {}
    for k in ks:
        if k not in llms:
            llms[k] = LLM(model, speculative_config=configs[k][1],
                          max_num_seqs=max(batch, 1), **llm_kw)
        warm[k] = warm_up(llms[k], prompts, params).to_dict()  # synchronized
    best: dict[int, SpecRun] = {}
    for _ in range(repeats):
        for k in ks:
            _sync(llms[k])
            run = median_pass(llms[k], prompts, params, configs[k][0], min_sec)
            if k not in best or run.elapsed_sec < best[k].elapsed_sec:
                best[k] = run
    for k in ks:
        best[k].warmup = warm[k]
    return [best[k] for k in ks]


def median_pass(llm, prompts: Sequence, params, setting: str, min_sec: float) -> SpecRun:
    """One timed round: passes back to back until `min_sec` have been timed (at least one);
    the median pass by time, with how many there were."""
    passes: list[SpecRun] = []
    while not passes or sum(r.elapsed_sec for r in passes) < min_sec:
        passes.append(_run_once(llm, prompts, params, setting))
    passes.sort(key=lambda r: r.elapsed_sec)
    run = passes[(len(passes) - 1) // 2]  # (the faster middle one of an even count)
    run.passes = len(passes)
    return run


def _sync(llm) -> None:
    import torch
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()


def format_runs(runs: Sequence[SpecRun]) -> str:
    """A table: one row per run, the speed-up against the 'off' run of the same batch."""
    base = {r.batch: r.tokens_per_sec for r in runs if r.setting == "off"}
    lines = [f"{'batch':>5s}  {'setting':12s} {'tok/s':>9s} {'vs off':>7s} {'ITL ms':>7s} "
             f"{'steps':>6s} {'ms/step':>7s} {'tok/step':>8s} {'accepted':>9s}"]
    for r in runs:
        ratio = r.tokens_per_sec / base[r.batch] if r.batch in base else float("nan")
        acc = f"{r.acceptance_rate:.0%}" if r.proposed else "-"
        lines.append(f"{r.batch:5d}  {r.setting:12s} {r.tokens_per_sec:9,.0f} {ratio:6.2f}x "
                     f"{r.itl_ms:7.2f} {r.steps:6d} {r.ms_per_step:7.2f} {r.tokens_per_step:8.2f} "
                     f"{acc:>9s}")
    return "\n".join(lines)


def plot_runs(runs: Sequence[SpecRun], title: str = ""):
    """Tokens/s of each setting relative to 'off', one group of bars per batch size."""
    import matplotlib.pyplot as plt
    batches = sorted({r.batch for r in runs})
    settings = list(dict.fromkeys(r.setting for r in runs))
    base = {r.batch: r.tokens_per_sec for r in runs if r.setting == "off"}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / len(settings)
    for i, s in enumerate(settings):
        xs, ys = [], []
        for j, b in enumerate(batches):
            r = next((r for r in runs if r.batch == b and r.setting == s), None)
            if r is not None and b in base:
                xs.append(j + (i - (len(settings) - 1) / 2) * width)
                ys.append(r.tokens_per_sec / base[b])
        bars = ax.bar(xs, ys, width, label=s)
        ax.bar_label(bars, [f"{y:.2f}x" for y in ys], fontsize=7)
    ax.axhline(1.0, color="0.4", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("tokens/s vs speculation off")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
