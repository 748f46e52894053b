"""Lesson 11's LoRA pictures and measurements, in plain torch (the engine's multi-LoRA serving
lives in `minipaged/lora/`).

    plot_lora_layer(d_in, d_out, rank)     what a LoRA adds to one linear layer, drawn to scale
    lora_forward(x, w, a, b, scaling)      y = x W^T + scaling (x A^T) B^T, the definition
    loop_per_adapter(x, w, a, b, idx, s)   a batch whose tokens use different adapters, one
                                           adapter at a time: select its rows, shrink, expand
    gathered(x, w, a, b, idx, s)           the same batch in two fixed-shape batched products:
                                           each token gathers its own A and B (punica's BGMV)
    time_adapter_batching(...)             both, timed on the same batch, 1 .. N adapters

Adapters sit in fixed slots (`a`: (slots, rank, d_in), `b`: (slots, d_out, rank)); slot 0 holds
zeros, so a token of the base model (index 0) adds nothing and needs no branch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def lora_forward(x, w, a, b, scaling: float) -> torch.Tensor:
    """x (tokens, d_in), w (d_out, d_in), a (rank, d_in), b (d_out, rank) -> (tokens, d_out)."""
    return x @ w.t() + scaling * ((x @ a.t()) @ b.t())


def loop_per_adapter(x, w, a, b, idx, scaling: float) -> torch.Tensor:
    """One adapter at a time: the rows of its tokens, shrink (rank), expand, add back. The
    number of products and their shapes depend on the batch's mix (and `nonzero` asks the
    device which rows: a GPU would have to stop and tell the host)."""
    y = x @ w.t()  # (tokens, d_out): the base model, all tokens at once
    for slot in idx.unique().tolist():
        if slot == 0:
            continue  # the base model's tokens
        rows = (idx == slot).nonzero().squeeze(1)  # (tokens of this adapter,)
        y[rows] += scaling * ((x[rows] @ a[slot].t()) @ b[slot].t())
    return y


def gathered(x, w, a, b, idx, scaling: float) -> torch.Tensor:
    """Every token's own adapter, gathered by index: shrink v_t = A[idx_t] x_t and expand
    y_t += B[idx_t] v_t as two batched products whose shapes never change (punica's BGMV; a
    kernel reads A[idx_t] in place instead of copying it, as `minipaged/lora/` does)."""
    y = x @ w.t()  # (tokens, d_out)
    v = torch.bmm(a[idx], x[:, :, None])  # (tokens, rank, 1): shrink
    return y + scaling * torch.bmm(b[idx], v).squeeze(-1)  # (tokens, d_out): expand


def plot_lora_layer(d_in: int = 1024, d_out: int = 1024, rank: int = 16, scaling: float = 2.0):
    """The frozen weight W (d_out x d_in) and the adapter's A (rank x d_in) and B (d_out x rank)
    drawn to scale, with the parameter counts."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle
    fig, ax = plt.subplots(figsize=(9, 4.2))
    u = 3.0 / max(d_in, d_out)  # drawing units per feature
    W, H = d_in * u, d_out * u
    r = max(rank * u, 0.06)  # visible even at rank 1
    ax.add_patch(Rectangle((0, 0), W, H, color="#b0bec5"))
    ax.text(W / 2, H / 2, f"W (frozen)\n{d_out} x {d_in}\n{d_in * d_out:,} params",
            ha="center", va="center", fontsize=10)
    ax0 = W + 1.0
    ax.add_patch(Rectangle((ax0, H - r), W, r, color="tab:orange"))  # A: rank x d_in
    ax.text(ax0 + W / 2, H - r - 0.15, f"A: {rank} x {d_in}", ha="center", va="top", fontsize=9)
    bx0 = ax0 + W + 0.8
    ax.add_patch(Rectangle((bx0, 0), r, H, color="tab:green"))  # B: d_out x rank
    ax.text(bx0 + r + 0.1, H / 2, f"B: {d_out} x {rank}", ha="left", va="center", fontsize=9)
    lora = rank * (d_in + d_out)
    ax.text(W + 0.5, H / 2 + 0.15, "+", ha="center", fontsize=16)
    ax.add_patch(FancyArrowPatch((ax0 + W, H - r / 2), (bx0, H - r / 2),
                                 arrowstyle="->", mutation_scale=10))
    ax.set_title(f"y = x W^T + {scaling:g} * (x A^T) B^T: the adapter adds {lora:,} parameters "
                 f"({lora / (d_in * d_out):.1%} of W) and two thin products", fontsize=10)
    ax.text(0, -0.35, "x (tokens x d_in) goes through W and, beside it, through A (shrink to "
            f"{rank} numbers per token) then B (expand back to {d_out})", fontsize=9)
    ax.set_xlim(-0.2, bx0 + 1.6)
    ax.set_ylim(-0.6, H + 0.3)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    return fig


@dataclass
class BatchingTime:
    num_adapters: int
    loop_ms: float
    gathered_ms: float


def _best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@torch.inference_mode()
def time_adapter_batching(num_tokens: int = 64, d: int = 512, rank: int = 16,
                          adapters=(1, 2, 4, 8, 16, 32), repeats: int = 20,
                          seed: int = 0) -> list[BatchingTime]:
    """A decode-like batch (one token per sequence) whose tokens use n different adapters, run
    both ways on the same data; checks they agree, returns the best time of each."""
    g = torch.Generator().manual_seed(seed)
    slots = max(adapters) + 1
    x = torch.randn(num_tokens, d, generator=g)
    w = torch.randn(d, d, generator=g) / d ** 0.5
    a = torch.randn(slots, rank, d, generator=g) / d ** 0.5
    b = torch.randn(slots, d, rank, generator=g) / rank ** 0.5
    a[0], b[0] = 0, 0  # slot 0: no adapter
    out = []
    for n in adapters:
        idx = torch.arange(num_tokens) % n + 1  # n adapters spread over the batch
        ref = loop_per_adapter(x, w, a, b, idx, 2.0)
        torch.testing.assert_close(gathered(x, w, a, b, idx, 2.0), ref, rtol=1e-4, atol=1e-4)
        out.append(BatchingTime(
            n, _best_ms(lambda: loop_per_adapter(x, w, a, b, idx, 2.0), repeats),
            _best_ms(lambda: gathered(x, w, a, b, idx, 2.0), repeats)))
    return out


def plot_adapter_batching(times: list[BatchingTime], title: str):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    n = [t.num_adapters for t in times]
    ax.plot(n, [t.loop_ms for t in times], "o-", label="loop per adapter")
    ax.plot(n, [t.gathered_ms for t in times], "s-", label="gathered (BGMV)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("different adapters in the batch")
    ax.set_ylabel("ms per layer (best)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    return fig
