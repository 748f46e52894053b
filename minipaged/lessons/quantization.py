"""Lesson 11's measurements of fp8 weights (models/quantization/fp8.py): what they keep, what
they lose.

    text_logits(llm, token_ids)          every position's logits of one text, through the
                                         engine's own model (one prefill on a private KV cache)
    fp8_accuracy(reference, quantized)   logits cosine similarity and top-1 agreement of the two
                                         engines over a fixed text (FIXED_TEXT)
    weight_error(reference, quantized)   per layer: bytes before / after and the round-trip
                                         error of the weights, relative to each row's max
    greedy_side_by_side(...)             the two engines' greedy stories and where they part
    plot_fp8_accuracy(acc)               per-position cosine and top-1 agreement, drawn

`reference` and `quantized` are two `LLM`s of one model, the second with quantization="fp8".
Nothing here is on the engine's path; `tests/test_fp8.py` holds the tolerances.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

FIXED_TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside "
              "in the park with her friends. One day, she saw a big red ball under a tree. She "
              "wanted to play with it, but a small dog took it and ran away. Lily was sad, so "
              "her mom gave her a hug and they went home to eat some cookies.")


@torch.inference_mode()
def text_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """(len(token_ids), vocab) fp32 logits of every position, the whole text as one prefill.

    It runs the engine's own model and attention backend through a `ModelRunner` with a private
    KV cache (the engine's cache and prefix cache are left untouched)."""
    from minipaged.engine.scheduler import ScheduledSeq, SchedulerOutput
    from minipaged.worker.kv_cache import allocate_kv_cache
    from minipaged.worker.model_runner import ModelRunner
    eng = llm.engine
    bs = eng.config.block_size
    num_blocks = -(-len(token_ids) // bs)
    kv = allocate_kv_cache(eng.model.config, num_blocks, bs, eng.kv_dtype, eng.device,
                           head_major=eng.config.kv_head_major)
    runner = ModelRunner(eng.model, kv, eng.backend, bs)
    seq = SimpleNamespace(num_computed_tokens=0, token_ids=list(token_ids))  # what it reads
    sched = SchedulerOutput(scheduled=[ScheduledSeq(
        seq=seq, num_new_tokens=len(token_ids), is_prefill=True, samples=True,
        block_table=list(range(num_blocks)))])
    input_ids, positions, metadata, _ = runner.prepare_inputs(sched)
    hidden = runner.forward(input_ids, positions, metadata)  # (tokens, hidden)
    return eng.model.compute_logits(hidden).float().cpu()  # (tokens, vocab)


@dataclass
class Fp8Accuracy:
    num_positions: int
    cosine: torch.Tensor  # (positions,) cosine similarity of the two logit vectors
    top1_agree: torch.Tensor  # (positions,) bool: the same most likely next token
    max_abs_diff: float  # the largest |logit difference| anywhere
    logit_range: float  # max - min of the reference logits, to read max_abs_diff against
    reference_gap: torch.Tensor  # (positions,) reference's top-1 minus top-2 probability

    def gap_where(self, agree: bool) -> float:
        """The reference's median top-1 / top-2 probability gap where top-1 (dis)agrees."""
        sel = self.top1_agree if agree else ~self.top1_agree
        return float(self.reference_gap[sel].median()) if sel.any() else float("nan")

    @property
    def mean_cosine(self) -> float:
        return float(self.cosine.mean())

    @property
    def min_cosine(self) -> float:
        return float(self.cosine.min())

    @property
    def top1_agreement(self) -> float:
        return float(self.top1_agree.float().mean())

    def summary(self) -> dict:
        return {"positions": self.num_positions, "mean_cosine": round(self.mean_cosine, 6),
                "min_cosine": round(self.min_cosine, 6),
                "top1_agreement": round(self.top1_agreement, 4),
                "max_abs_logit_diff": round(self.max_abs_diff, 4),
                "reference_logit_range": round(self.logit_range, 3),
                "reference_gap_where_top1_agrees": round(self.gap_where(True), 4),
                "reference_gap_where_top1_differs": round(self.gap_where(False), 4)}


def fp8_accuracy(reference, quantized, text: str = FIXED_TEXT) -> Fp8Accuracy:
    """The two engines' logits at every position of `text` (tokenized by `reference`)."""
    ids = reference.get_tokenizer()(text)["input_ids"]
    ref, q = text_logits(reference, ids), text_logits(quantized, ids)
    top2 = ref.softmax(-1).topk(2, dim=-1).values  # (positions, 2)
    return Fp8Accuracy(num_positions=len(ids), cosine=F.cosine_similarity(ref, q, dim=-1),
                       top1_agree=ref.argmax(-1) == q.argmax(-1),
                       max_abs_diff=float((ref - q).abs().max()),
                       logit_range=float(ref.max() - ref.min()),
                       reference_gap=top2[:, 0] - top2[:, 1])


def weight_error(reference, quantized) -> list[dict]:
    """Per decoder-layer linear layer: its bytes in the reference's dtype and in fp8 (+ scales),
    and the weights' round-trip error |W - W_q w_scale| relative to the row's max |W|: the
    mean and the largest (at most 2^-4 = 0.0625, e4m3's half-ulp, fp8.py derives it)."""
    from minipaged.models.quantization.fp8 import LINEAR_NAMES, dequantize
    rows = []
    ref_layers, q_layers = reference.engine.model.model.layers, quantized.engine.model.model.layers
    for i, (a, b) in enumerate(zip(ref_layers, q_layers)):
        for path in LINEAR_NAMES:
            w = a.get_submodule(path).weight.detach().float()
            qb = b.get_submodule(path)
            qb = getattr(qb, "inner", qb)  # a row-parallel wrapper holds its Fp8Linear
            back = dequantize(qb.weight, qb.weight_scale[:, None])
            rel = (w - back.cpu()).abs() / w.abs().amax(-1, keepdim=True).clamp(min=1e-12)
            rows.append({"layer": i, "name": path.split(".")[1], "shape": tuple(w.shape),
                         "bytes_float": w.numel() * a.get_submodule(path).weight.element_size(),
                         "bytes_fp8": qb.weight.numel() + 4 * qb.weight_scale.numel(),
                         "mean_rel_err": float(rel.mean()), "max_rel_err": float(rel.max())})
    return rows


def greedy_side_by_side(reference, quantized, prompt: str = "Once upon a time",
                        max_tokens: int = 80) -> dict:
    """Both engines' greedy continuations of `prompt` and the first output token where they
    differ (None: identical)."""
    from minipaged import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    a, b = (llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            for llm in (reference, quantized))
    first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
    if first is None and len(a.token_ids) != len(b.token_ids):
        first = min(len(a.token_ids), len(b.token_ids))
    return {"prompt": prompt, "reference": a.text, "fp8": b.text, "first_difference": first,
            "reference_tokens": list(a.token_ids), "fp8_tokens": list(b.token_ids)}


def plot_fp8_accuracy(acc: Fp8Accuracy, title: str = "fp8 weights vs float32, stories260K"):
    """Cosine similarity of the logits at each position, the positions whose top-1 token
    changed marked in red."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 3.2))
    pos = torch.arange(acc.num_positions)
    ax.plot(pos, acc.cosine, color="tab:blue", lw=1.2, label="cosine(logits fp32, logits fp8)")
    bad = ~acc.top1_agree
    ax.scatter(pos[bad], acc.cosine[bad], color="tab:red", zorder=3,
               label=f"top-1 token differs ({int(bad.sum())} of {acc.num_positions})")
    ax.set_xlabel("position in the text")
    ax.set_ylabel("cosine similarity")
    ax.set_title(f"{title}: mean cosine {acc.mean_cosine:.5f}, top-1 agreement "
                 f"{acc.top1_agreement:.1%}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig
