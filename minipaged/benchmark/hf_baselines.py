"""The naive Hugging Face baselines minipaged is measured against (lessons 00, 03 and 08).

* `hf_sequential`  one `generate()` call per request: the simplest thing that works.
* `hf_static`      padded static batches of B requests: every batch runs until its longest
                   request is done, so finished rows keep burning compute as padding.
* `hf_continuous`  transformers' own continuous batching (`ContinuousBatchingManager`), given an
                   explicit `ContinuousBatchingConfig` (its default sizes the cache from system RAM).

Each returns a `BaselineResult` with the generated tokens and the wall time, so benchmarks and
lessons can put them side by side with minipaged. `on_finished(n)`, when given, hears that n more
requests are done (a progress bar's `update`: `minipaged bench` and `demo` pass one). The
commands use them, so they live outside lessons/ (`lessons/baseline.py` re-exports them).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' per-call warning about eos_token_id=-1 (our way to ignore EOS)."""
    import logging

    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    cb_logger = logging.getLogger("ContinuousBatchingLogger")  # HF continuous batching's own
    cb_level = cb_logger.level
    hf_logging.set_verbosity_error()
    cb_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        cb_logger.setLevel(cb_level)


@dataclass
class BaselineResult:
    name: str
    outputs: list[list[int]]  # generated token ids per request (only the useful, requested ones)
    elapsed: float
    batch_size: int = 1
    padded_tokens: int = 0  # token slots computed for padding / finished rows (static batching)
    extra: dict = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_sec(self) -> float:
        return self.output_tokens / self.elapsed if self.elapsed > 0 else float("inf")


def load_hf_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model.eval()


def _gen_kwargs(max_new_tokens: int, ignore_eos: bool, pad_token_id: int) -> dict:
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
    if ignore_eos:
        kw["eos_token_id"] = -1  # an id that never occurs: generate exactly max_new_tokens
    return kw


@quiet_transformers()
@torch.inference_mode()
def hf_sequential(model, prompts: list[list[int]], max_new_tokens: list[int],
                  ignore_eos: bool = True,
                  on_finished: Optional[Callable[[int], None]] = None) -> BaselineResult:
    """One request at a time, greedy."""
    device = model.device
    pad = model.config.pad_token_id or 0
    outs = []
    t0 = time.perf_counter()
    for ids, n in zip(prompts, max_new_tokens):
        x = torch.tensor([ids], device=device)
        y = model.generate(x, attention_mask=torch.ones_like(x), **_gen_kwargs(n, ignore_eos, pad))
        outs.append(y[0, len(ids):].tolist())
        if on_finished is not None:
            on_finished(1)
    return BaselineResult("hf-sequential", outs, time.perf_counter() - t0)


@quiet_transformers()
@torch.inference_mode()
def hf_static(model, prompts: list[list[int]], max_new_tokens: list[int], batch_size: int = 64,
              ignore_eos: bool = True,
              on_finished: Optional[Callable[[int], None]] = None) -> BaselineResult:
    """Left-padded static batches in arrival order; each batch runs to its longest request."""
    device = model.device
    pad = model.config.pad_token_id or 0
    outs: list[list[int]] = []
    padded = 0
    t0 = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch, lens = prompts[b:b + batch_size], max_new_tokens[b:b + batch_size]
        width, steps = max(len(p) for p in batch), max(lens)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding keeps every row's last token aligned
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        y = model.generate(ids.to(device), attention_mask=mask.to(device),
                           **_gen_kwargs(steps, ignore_eos, pad))
        for i, n in enumerate(lens):
            outs.append(y[i, width:width + n].tolist())
        padded += sum(width - len(p) for p in batch) + sum(steps - n for n in lens)
        if on_finished is not None:
            on_finished(len(batch))
    return BaselineResult("hf-static", outs, time.perf_counter() - t0, batch_size=batch_size,
                          padded_tokens=padded)


@quiet_transformers()
@torch.inference_mode()
def hf_continuous(model, prompts: list[list[int]], max_new_tokens: list[int],
                  ignore_eos: bool = True, max_batch_tokens: int = 2048,
                  num_blocks: Optional[int] = None, block_size: int = 32,
                  on_finished: Optional[Callable[[int], None]] = None) -> BaselineResult:
    """transformers' continuous batching with an explicit cache size, greedy."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    longest = max(len(p) + n for p, n in zip(prompts, max_new_tokens))
    if num_blocks is None:  # room for every request at once: the baseline is never memory-starved
        num_blocks = len(prompts) * -(-longest // block_size) + 16
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(max_new_tokens),
                               eos_token_id=None if ignore_eos else model.config.eos_token_id,
                               pad_token_id=model.config.pad_token_id or 0)
    import inspect
    page_kw = ("page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters
               else "block_size")  # renamed in newer transformers
    cb_cfg = ContinuousBatchingConfig(**{page_kw: block_size}, num_blocks=num_blocks,
                                      max_batch_tokens=max_batch_tokens,
                                      max_requests_per_batch=len(prompts))
    manager = model.init_continuous_batching(generation_config=gen_cfg,
                                             continuous_batching_config=cb_cfg)
    t0 = time.perf_counter()
    manager.start()
    try:
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n,
                                   eos_token_id=-1 if ignore_eos else None)
               for i, (p, n) in enumerate(zip(prompts, max_new_tokens))]
        results = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=60)
            if r is None:
                raise RuntimeError("HF continuous batching stopped without finishing every request")
            if r.is_finished():
                if r.error:
                    raise RuntimeError(f"HF continuous batching failed: {r.error}")
                results[r.request_id] = r.generated_tokens
                if on_finished is not None:
                    on_finished(1)
    finally:
        manager.stop(block=True, timeout=30)
    elapsed = time.perf_counter() - t0
    return BaselineResult("hf-cb", [results[i] for i in ids], elapsed,
                          batch_size=len(prompts), extra={"num_blocks": num_blocks})
