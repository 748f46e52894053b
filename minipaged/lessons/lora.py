"""Lesson 11's LoRA part: what an adapter adds to a layer, and what mixing adapters costs.

    draw_lora_layer(d_in, d_out, rank)     the base weight W beside the low-rank path x -> A -> B,
                                           with both parameter counts
    lora_parameter_table(model_config, r)  per module: base parameters, LoRA parameters, share
    draw_mixed_batch(token_lora)           one step's tokens coloured by adapter, and the same
                                           tokens sorted into the per-adapter tiles the Triton
                                           kernels walk (minipaged/lora/triton_punica.py)
    measure_adapter_batch_cost(...)        CPU time per token of one mixed batch: the base matmul,
                                           punica's gathered shrink/expand (lora/punica.py), and
                                           one small matmul pair per adapter over its own tokens

The figures import the package's own code (adapter.py's module shapes, punica.py's mapping);
nothing here re-implements the engine.
"""
from __future__ import annotations

import time

import matplotlib.pyplot as plt
import torch

from minipaged.lessons.viz.common import _figure, owner_color
from minipaged.lora import punica
from minipaged.lora.adapter import SUPPORTED_MODULES, module_shapes


def draw_lora_layer(d_in: int = 64, d_out: int = 64, rank: int = 8, ax=None):
    """y = x W^T + (x A^T) B^T * alpha / r: the frozen W (d_out x d_in) beside A (r x d_in) and
    B (d_out x r), drawn to scale, with the parameter counts."""
    fig, ax, own = _figure(ax, (8, 4))
    scale = 3.0 / max(d_in, d_out)
    w, h = d_in * scale, d_out * scale
    ax.add_patch(plt.Rectangle((0, 0), w, h, color="#bdbdbd"))
    ax.text(w / 2, h / 2, f"W\n{d_out} x {d_in}\n{d_in * d_out:,} params (frozen)",
            ha="center", va="center")
    x0 = w + 1.0
    ax.add_patch(plt.Rectangle((x0, h - rank * scale), w, rank * scale, color=owner_color(0)))
    ax.text(x0 + w / 2, h + 0.15, f"A  {rank} x {d_in}  (shrink)", ha="center")
    x1 = x0 + w + 0.8
    ax.add_patch(plt.Rectangle((x1, 0), rank * scale, h, color=owner_color(1)))
    ax.text(x1 + rank * scale + 0.1, h / 2, f"B  {d_out} x {rank}\n(expand)", va="center")
    lora = rank * (d_in + d_out)
    ax.set_title(f"base(x) + B(A(x)) * scaling: the adapter adds {lora:,} parameters "
                 f"({100 * lora / (d_in * d_out):.1f}% of W) at rank {rank}")
    ax.set_xlim(-0.2, x1 + 2.5)
    ax.set_ylim(-0.3, h + 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    if own:
        fig.tight_layout()
    return fig


def lora_parameter_table(model_config, rank: int = 16) -> list[dict]:
    """Per adaptable module of one decoder layer: base and LoRA parameter counts."""
    rows = []
    for module in SUPPORTED_MODULES:
        d_in, d_out = module_shapes(model_config)[module]
        base, lora = d_in * d_out, rank * (d_in + d_out)
        rows.append({"module": module, "in": d_in, "out": d_out, "base_params": base,
                     "lora_params": lora, "share": round(lora / base, 4)})
    return rows


def draw_mixed_batch(token_lora: list[int], max_loras: int | None = None, ax=None):
    """Top: a step's tokens in the runner's order, coloured by adapter slot (grey: none).
    Bottom: the order the Triton kernels take them in (PunicaWrapper.update): sorted by slot,
    cut into tiles of at most TILE_TOKENS tokens of one adapter each."""
    fig, ax, own = _figure(ax, (10, 2.6))
    slots = max_loras or max(max(token_lora) + 1, 1)
    wrapper = punica.PunicaWrapper(slots, len(token_lora), torch.device("cpu"))
    wrapper.update(token_lora)
    order = wrapper.sorted_token_ids[:len(token_lora)].tolist()

    def color(s):
        return "#d9d9d9" if s < 0 else owner_color(s)

    for i, s in enumerate(token_lora):
        ax.add_patch(plt.Rectangle((i, 1.6), 0.9, 0.9, color=color(s)))
    for pos, i in enumerate(order):
        ax.add_patch(plt.Rectangle((pos, 0), 0.9, 0.9, color=color(token_lora[i])))
    for slot, start, length in zip(*(t.tolist() for t in (wrapper.tile_slot, wrapper.tile_start,
                                                          wrapper.tile_len))):
        if slot >= 0:
            ax.add_patch(plt.Rectangle((start - 0.05, -0.1), length, 1.1, fill=False, lw=1.5))
    ax.text(-0.5, 2.05, "step order", ha="right", va="center")
    ax.text(-0.5, 0.45, "kernel tiles", ha="right", va="center")
    ax.set_xlim(-6, len(token_lora) + 0.5)
    ax.set_ylim(-0.4, 2.8)
    ax.axis("off")
    ax.set_title("one batch, several adapters: each tile reads one adapter's A and B once")
    if own:
        fig.tight_layout()
    return fig


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def measure_adapter_batch_cost(num_tokens: int = 256, d_in: int = 512, d_out: int = 512,
                               rank: int = 16, adapter_counts=(1, 2, 4, 8, 16),
                               repeats: int = 5, seed: int = 0) -> list[dict]:
    """CPU microseconds per token for one mixed batch of `num_tokens` tokens spread round-robin
    over N adapters, one thread, best of `repeats`:

    base_us_per_token         the base layer's matmul alone
    gathered_us_per_token     punica.py's reference: every token gathers its own A and B (it
                              copies num_tokens x r x (d_in + d_out) numbers), then batched
                              matmuls; the same work whatever N is
    per_adapter_us_per_token  one small matmul pair per adapter over the tokens it owns: N
                              launches on slices, the cost growing with N

    On a CPU the loop wins at these sizes (a launch is cheap, the gather's copies are not); on a
    GPU each launch of the loop costs microseconds and a CUDA graph cannot hold a loop whose
    length changes per step, which is why the Triton kernels walk sorted per-adapter tiles in
    two launches (triton_punica.py)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g)
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n in adapter_counts:
            a = torch.randn(n, rank, d_in, generator=g) * 0.1
            b = torch.randn(n, d_out, rank, generator=g) * 0.1
            scaling = torch.ones(n)
            token_lora = torch.arange(num_tokens) % n
            groups = [(token_lora == s).nonzero().squeeze(1) for s in range(n)]

            def per_adapter():
                y = x @ w.T
                for s, idx in enumerate(groups):
                    y[idx] += (x[idx] @ a[s].T) @ b[s].T
                return y

            t_base = _best_time(lambda: x @ w.T, repeats)
            t_gather = _best_time(lambda: punica.add_lora(x @ w.T, x, a, b, scaling, token_lora),
                                  repeats)
            t_loop = _best_time(per_adapter, repeats)
            us = 1e6 / num_tokens
            rows.append({"adapters": n, "base_us_per_token": round(t_base * us, 3),
                         "gathered_us_per_token": round(t_gather * us, 3),
                         "per_adapter_us_per_token": round(t_loop * us, 3)})
    finally:
        torch.set_num_threads(threads)
    return rows
