"""Lesson 12's helpers: the allowed-token mask of a grammar, drawn over stories260K's vocabulary,
its state walked forward and rolled back, and what the masks cost.

    mask_walk(llm, so, token_ids)     the mask before each token of an output, replayed through
                                      a matcher compiled by the engine's StructuredOutputManager
    plot_vocab_mask(mask, pieces)     one step's mask as a 16 x 32 grid of the 512 tokens
    plot_mask_walk(walk)              every step's mask, one row each, and how many it allows
    rollback_check(llm, so, ids, k)   accept all tokens, roll k back: the earlier mask again
    measure_cost(llm, ...)            CPU time of one batch with every row constrained against
                                      none, best of `repeats`, and the time inside apply_masks
    plot_cost(live, committed)        the live ratio beside benchmarks/structured_outputs.py's
    grade_schema(llm, schema)         the lesson's graded exercise

The masks come from the engine's own compiled grammar (`StructuredOutputManager.compile`) and
xgrammar's `GrammarMatcher`, as `manager.apply_masks` fills them; nothing here is on the engine's
path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch

from minipaged import SamplingParams
from minipaged.structured_output import StructuredOutputsParams

# An array of at least 1000 people: no grammar ends before max_tokens, so a constrained batch
# generates as many tokens as an unconstrained one (benchmarks/structured_outputs.py's schema).
LONG_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pets": {"type": "array", "maxItems": 3,
                            "items": {"enum": ["cat", "dog", "fish"]}}}}}


def token_pieces(llm) -> list[str]:
    """Each vocabulary id as the text it stands for ('▁' shown as a space, bytes as <0x..>)."""
    tok = llm.engine.tokenizer
    vocab = llm.engine.model_config.vocab_size
    return [tok.convert_ids_to_tokens(i).replace("\u2581", " ") for i in range(vocab)]


def _matcher(llm, so: StructuredOutputsParams):
    import xgrammar as xgr
    mgr = llm.engine.structured_output
    compiled = mgr.compile(so)  # the engine's compile cache, against this vocabulary
    return xgr, mgr, xgr.GrammarMatcher(compiled, override_stop_tokens=mgr.eos_token_ids)


def _mask_of(xgr, matcher, vocab: int) -> np.ndarray:
    """(vocab,) bool: the tokens the matcher's state allows next (its int32 bitmask unpacked)."""
    words = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(words, 0)
    bits = (words[0].to(torch.int64)[:, None] >> torch.arange(32)) & 1  # (words, 32)
    return bits.reshape(-1)[:vocab].bool().numpy()


@dataclass
class MaskWalk:
    token_ids: list[int]
    masks: np.ndarray  # (len(token_ids) + 1, vocab) bool: before each token, and after the last
    pieces: list[str]

    @property
    def allowed(self) -> list[int]:
        return [int(m.sum()) for m in self.masks]


def mask_walk(llm, so: StructuredOutputsParams, token_ids: Sequence[int]) -> MaskWalk:
    """Replay `token_ids` (an output the engine generated under `so`) through a fresh matcher,
    recording the mask before every token. Raises if a token was not allowed."""
    xgr, mgr, m = _matcher(llm, so)
    masks = []
    for i, t in enumerate(token_ids):
        masks.append(_mask_of(xgr, m, mgr.vocab_size))
        if not masks[-1][t] or not m.accept_token(t):
            raise ValueError(f"token {t} at output position {i} is not allowed by the grammar")
    masks.append(_mask_of(xgr, m, mgr.vocab_size))
    return MaskWalk(list(token_ids), np.stack(masks), token_pieces(llm))


def rollback_check(llm, so: StructuredOutputsParams, token_ids: Sequence[int],
                   k: int) -> dict:
    """Accept every token, then `matcher.rollback(k)`: the state (its mask) is the one it had
    after len - k tokens, and accepting the same k tokens again lands where it was."""
    xgr, mgr, m = _matcher(llm, so)
    vocab = mgr.vocab_size
    before = []
    for t in token_ids:
        before.append(_mask_of(xgr, m, vocab))
        assert m.accept_token(t)
    end = _mask_of(xgr, m, vocab)
    m.rollback(k)
    back = _mask_of(xgr, m, vocab)
    for t in token_ids[len(token_ids) - k:]:
        assert m.accept_token(t)
    return {"tokens": len(token_ids), "rolled_back": k,
            "mask_equals_earlier": bool((back == before[len(token_ids) - k]).all()),
            "mask_equals_end_after_replay": bool((_mask_of(xgr, m, vocab) == end).all())}


def plot_vocab_mask(mask: np.ndarray, pieces: list[str], chosen: Optional[int] = None,
                    title: str = "", ax=None):
    """The vocabulary as a 16 x 32 grid (id = 32 * row + column): allowed tokens green, the
    sampled one outlined; up to 24 allowed tokens are named beside it."""
    vocab = len(mask)
    cols = 32
    rows = -(-vocab // cols)
    grid = np.zeros(rows * cols)
    grid[:vocab] = mask
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(9, 4.6))
    ax.imshow(grid.reshape(rows, cols), cmap=plt.matplotlib.colors.ListedColormap(
        ["#eeeeee", "#2ca02c"]), vmin=0, vmax=1, aspect="equal")
    if chosen is not None:
        ax.add_patch(plt.Rectangle((chosen % cols - 0.5, chosen // cols - 0.5), 1, 1, fill=False,
                                   ec="crimson", lw=2.2))
    ax.set_xticks(range(0, cols, 4))
    ax.set_yticks(range(rows))
    ax.set_yticklabels([str(r * cols) for r in range(rows)], fontsize=7)
    ax.set_xlabel("token id mod 32")
    ax.set_ylabel("token id (row start)")
    ids = np.flatnonzero(mask)
    shown = ", ".join(repr(pieces[i]) for i in ids[:24]) + (" ..." if len(ids) > 24 else "")
    ax.set_title(title or f"{len(ids)} of {vocab} tokens allowed", fontsize=10)
    ax.text(cols + 0.5, 0, "allowed: " + shown, fontsize=7, va="top", wrap=True,
            transform=ax.transData)
    if own:
        fig.tight_layout()
        return fig
    return ax.figure


def plot_mask_walk(walk: MaskWalk, max_steps: int = 40):
    """Left: one row per output token (its mask over the 512 ids, the sampled id in red).
    Right: how many tokens each step allows, on a log scale."""
    n = min(len(walk.token_ids), max_steps)
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 0.22 * n + 1.8),
                               gridspec_kw={"width_ratios": [3, 1]}, sharey=True)
    a.imshow(walk.masks[:n], cmap=plt.matplotlib.colors.ListedColormap(["#eeeeee", "#2ca02c"]),
             aspect="auto", interpolation="nearest")
    a.scatter(walk.token_ids[:n], range(n), s=10, c="crimson", marker="s")
    a.set_yticks(range(n))
    a.set_yticklabels([repr(walk.pieces[t]) for t in walk.token_ids[:n]], fontsize=7,
                      family="monospace")
    a.set_xlabel("token id (green: allowed, red: the token sampled)")
    a.set_title("the allowed-token mask, step by step")
    b.barh(range(n), walk.allowed[:n], color="#2ca02c")
    b.set_xscale("log")
    b.set_xlim(0.8, walk.masks.shape[1] * 1.2)
    b.set_xlabel("tokens allowed (log)")
    fig.tight_layout()
    return fig


def measure_cost(llm, schema: dict = LONG_SCHEMA, num_requests: int = 32, max_tokens: int = 64,
                 repeats: int = 5, seed: int = 0) -> dict:
    """One batch of `num_requests` greedy requests (EOS ignored), every row constrained against
    none, interleaved `repeats` times; the best CPU time (`time.process_time`: robust when other
    programs share the cores) of each, and the CPU time inside `apply_masks` and `accept`."""
    eng = llm.engine
    mgr = eng.structured_output
    so = StructuredOutputsParams(json=schema)
    rng = np.random.default_rng(seed)
    prompts = [[1] + rng.integers(3, eng.model_config.vocab_size, int(n)).tolist()
               for n in rng.integers(4, 32, num_requests)]
    inside: list[float] = []  # CPU seconds in apply_masks
    accepting: list[float] = []  # ... and in accept (matchers advanced by the new tokens)
    real, real_accept = mgr.apply_masks, mgr.accept

    def timed(logits, seqs):
        t0 = time.process_time()
        out = real(logits, seqs)
        inside.append(time.process_time() - t0)
        return out

    def timed_accept(seq):
        t0 = time.process_time()
        out = real_accept(seq)
        accepting.append(time.process_time() - t0)
        return out

    def run(constrained: bool) -> tuple[float, float, float, int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                structured_outputs=so if constrained else None)
        inside.clear()
        accepting.clear()
        t0 = time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return (time.process_time() - t0, sum(inside), sum(accepting),
                sum(len(o.outputs[0].token_ids) for o in outs))

    mgr.apply_masks, mgr.accept = timed, timed_accept
    try:
        run(True)  # warm-up: the grammar compiles for this vocabulary once
        best = {"none": None, "all constrained": None}
        for _ in range(repeats):
            for name in best:
                r = run(name != "none")
                if best[name] is None or r[0] < best[name][0]:
                    best[name] = r
    finally:
        mgr.apply_masks, mgr.accept = real, real_accept
    out = {"num_requests": num_requests, "max_tokens": max_tokens, "repeats": repeats}
    for name, (cpu, masks, accepts, tokens) in best.items():
        out[name] = {"cpu_sec": cpu, "output_tokens": tokens, "tokens_per_cpu_sec": tokens / cpu,
                     "mask_cpu_sec": masks, "mask_share": masks / cpu,
                     "accept_cpu_sec": accepts, "accept_share": accepts / cpu}
    out["ratio"] = out["all constrained"]["tokens_per_cpu_sec"] / out["none"]["tokens_per_cpu_sec"]
    return out


def plot_cost(live: dict, committed: dict):
    """Tokens/s of the constrained batch as a share of the unconstrained one: this run (CPU
    time, small batch) beside the committed benchmark (64 requests); the masks' own share
    hatched."""
    res = committed["results"]
    labels = [f"live: {live['num_requests']} requests\nx {live['max_tokens']} tokens (CPU time)",
              "committed: 64 requests,\nall constrained",
              "committed: 64 requests,\nhalf constrained"]
    ratios = [live["ratio"], res["all constrained"]["ratio_to_none"],
              res["half constrained"]["ratio_to_none"]]
    shares = [live["all constrained"]["mask_share"], res["all constrained"]["mask_share_of_time"],
              res["half constrained"]["mask_share_of_time"]]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    y = np.arange(len(labels))
    ax.barh(y, ratios, color="#4c72b0", label="tokens/s vs the unconstrained batch")
    ax.barh(y, shares, left=np.array(ratios) - np.array(shares), color="none", hatch="///",
            ec="white", label="share of the time inside apply_masks")
    for yi, r in zip(y, ratios):
        ax.text(r + 0.01, yi, f"{r:.2f}x", va="center", fontsize=9)
    ax.axvline(1, c="gray", ls=":")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlim(0, 1.15)
    ax.invert_yaxis()
    ax.set_xlabel("throughput with grammar masks / without (stories260K, CPU)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


def grade_schema(llm, schema: dict, prompts: Sequence[str] = ("Once upon a time", "Tom had a"),
                 max_tokens: int = 200) -> list:
    """The exercise: `schema` must make stories260K write an object with "name" (a string of 1 to
    10 characters), "age" (an integer from 3 to 9) and "pets" (a list of "cat" / "dog", at most
    2), nothing else. Each prompt is sampled (seed 0..); every output must parse and be such an
    object, and the schema itself must say so (so that any model's output would). Returns the
    parsed objects; raises AssertionError naming what is wrong."""
    import json

    import jsonschema
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    bad = [{"name": "Tom", "age": 12, "pets": []}, {"name": "", "age": 5, "pets": []},
           {"name": "Tom", "age": 5, "pets": ["fish"]}, {"name": "Tom", "age": 5},
           {"name": "Tom", "age": 5, "pets": ["cat"], "color": "red"},
           {"name": "Tom", "age": 5.5, "pets": []},
           {"name": "Tommy Tommy T", "age": 5, "pets": []},
           {"name": "Tom", "age": 5, "pets": ["cat", "dog", "cat"]}]
    for b in bad:
        try:
            jsonschema.validate(b, schema)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"your schema accepts {json.dumps(b)}, which breaks the rules")
    jsonschema.validate({"name": "Lily", "age": 4, "pets": ["dog"]}, schema)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens,
                             structured_outputs=so) for i in range(len(prompts))]
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    values = []
    for o in outs:
        text = o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop", \
            f"did not finish in {max_tokens} tokens: {text!r}"
        v = json.loads(text)
        jsonschema.validate(v, schema)
        values.append(v)
    return values
