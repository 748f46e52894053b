"""Lesson 08, section 4: when plain Hugging Face is the better tool, measured on this machine.

    startup_seconds(model, hf_path)           LLM(...) construction vs HF `from_pretrained`
    one_request_seconds(llm, hf, prompt, n)   one short greedy request through each, same tokens
    hook_captures(llm, hf, prompts)           what a forward hook on one layer sees in each

Every timing is the best of `repeats` runs, the two sides interleaved so that a busy moment of a
shared machine hits both; the lesson prints the ratios and draws its conclusion from them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@dataclass
class Startup:
    minipaged_s: float  # LLM(model, **llm_kw): config, weights, KV cache, tokenizer
    hf_s: float  # AutoModelForCausalLM.from_pretrained(path).eval()


def startup_seconds(model: str, hf_path: str, repeats: int = 3, **llm_kw) -> Startup:
    """Best-of-`repeats` construction time of `LLM(model, **llm_kw)` and of the HF model, in a
    process that has imported both already (a first import costs seconds either way)."""
    from minipaged import LLM
    from minipaged.benchmark.hf_baselines import load_hf_model
    from minipaged.benchmark.hf_baselines import quiet_transformers
    mp, hf = [], []
    for _ in range(repeats):
        mp.append(_best(lambda: LLM(model, **llm_kw), 1))
        with quiet_transformers():
            hf.append(_best(lambda: load_hf_model(hf_path), 1))
    return Startup(minipaged_s=min(mp), hf_s=min(hf))


@dataclass
class OneRequest:
    max_tokens: int
    minipaged_s: float
    hf_s: float
    same_tokens: bool


@torch.inference_mode()
def one_request_seconds(llm, hf, prompt: Sequence[int], max_tokens: int = 32,
                        repeats: int = 3) -> OneRequest:
    """One greedy request of `max_tokens` tokens (EOS ignored): `llm.generate` against HF
    `generate`, best of `repeats` each after one warm-up call, and whether they agree."""
    from minipaged import SamplingParams
    from minipaged.benchmark.hf_baselines import quiet_transformers
    x = torch.tensor([list(prompt)])
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run_hf():
        with quiet_transformers():
            return hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)

    def run_mp():
        return llm.generate([list(prompt)], sp, use_tqdm=False)

    y, out = run_hf(), run_mp()  # warm-up, and the tokens to compare
    same = y[0, len(prompt):].tolist() == list(out[0].outputs[0].token_ids)
    mp, hf_t = [], []
    for _ in range(repeats):
        mp.append(_best(run_mp, 1))
        hf_t.append(_best(run_hf, 1))
    return OneRequest(max_tokens=max_tokens, minipaged_s=min(mp), hf_s=min(hf_t), same_tokens=same)


@dataclass
class HookCapture:
    engine: str
    shapes: list  # the output shape the hook saw, call by call
    calls: int


@torch.inference_mode()
def hook_captures(llm, hf, prompts: Sequence[Sequence[int]], max_tokens: int = 3,
                  layer: int = 2, hf_prompt: Optional[Sequence[int]] = None) -> list[HookCapture]:
    """Register the same forward hook on layer `layer`'s MLP of both models and generate.

    HF runs one request (`hf_prompt`, default the first prompt): the hook sees
    (batch, positions, hidden), one request's hidden states in order. minipaged runs all
    `prompts` together: the hook sees one flat (tokens of the step, hidden) tensor per engine
    step, every request's tokens side by side, to be split with the step's metadata."""
    from minipaged import SamplingParams
    from minipaged.benchmark.hf_baselines import quiet_transformers
    out = []
    for name, module in (("hf", hf.model.layers[layer].mlp),
                         ("minipaged", llm.engine.model.model.layers[layer].mlp)):
        seen: list = []
        handle = module.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
        try:
            if name == "hf":
                x = torch.tensor([list(hf_prompt or prompts[0])])
                with quiet_transformers():
                    hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            else:
                llm.generate([list(p) for p in prompts],
                             SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                            ignore_eos=True), use_tqdm=False)
        finally:
            handle.remove()
        out.append(HookCapture(engine=name, shapes=seen, calls=len(seen)))
    return out
