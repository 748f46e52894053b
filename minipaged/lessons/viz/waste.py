"""Where the KV cache goes: the memory-waste bars and areas, and the block-size trade-off.

`plot_memory_waste` (the vLLM paper's Fig. 2) and `plot_waste_over_time` draw the results of
`minipaged.lessons.memory_waste`; `block_size_tradeoff` / `plot_block_size_tradeoff` run the
real `BlockManager` at several block sizes and set internal fragmentation against block-table
size; `block_size_explorer` is the same as a slider (ipywidgets). Lesson 01 (KV memory waste)
shows all of them.
"""
from __future__ import annotations

from typing import Optional, Sequence

import matplotlib
import matplotlib.pyplot as plt
import matplotlib.ticker

from minipaged.lessons.viz.common import CATEGORY_COLORS, _figure, _show, _widgets, animate


# --- memory waste (lesson 01) -----------------------------------------------------------------
def plot_memory_waste(results, ax=None, include_free: bool = False, paper: bool = True,
                      title: Optional[str] = None):
    """The vLLM paper's Fig. 2: time-averaged share of KV memory per category, per strategy.

    `results`: `memory_waste.WasteResult`s. Shares are of the taken memory (token states +
    reserved + fragmentation) unless `include_free`. The paper's token-state share is marked ◆.
    """
    from minipaged.lessons.memory_waste import CATEGORIES, CATEGORY_LABELS, PAPER_TOKEN_STATE_SHARE
    fig, ax, own = _figure(ax, (8, 0.5 * len(results) + 1.6))
    cats = CATEGORIES if include_free else CATEGORIES[:-1]
    labels = [r.label for r in results]
    for y, r in enumerate(results):
        sh = r.shares(include_free)
        left = 0.0
        for c in cats:
            ax.barh(y, sh[c], left=left, color=CATEGORY_COLORS[c], edgecolor="white",
                    label=CATEGORY_LABELS[c] if y == 0 else None)
            left += sh[c]
        small = sh["token_states"] < 0.15
        ax.text(sh["token_states"] + 0.01 if small else 0.01, y, f"{sh['token_states']:.1%}",
                va="center", ha="left", fontsize=8, color="black" if small else "white",
                fontweight="bold",
                bbox=dict(facecolor="white", edgecolor="none", pad=1) if small else None)
        key = "vLLM" if r.strategy == "paged" and r.block_size == 16 else r.label
        if paper and key in PAPER_TOKEN_STATE_SHARE:
            ax.plot(PAPER_TOKEN_STATE_SHARE[key], y, marker="D", color="black", markersize=5,
                    linestyle="none",
                    label="paper's token-state share" if not any(
                        h.get_label() == "paper's token-state share" for h in ax.lines) else None)
    ax.set_yticks(range(len(results)), labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel("share of the KV memory taken" if not include_free else "share of the KV cache")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.18 if own else -0.25),
              frameon=False)
    ax.set_title(title or "Where the KV cache goes (time-averaged)", fontsize=10)
    if own:
        fig.tight_layout()
    return fig


def plot_waste_over_time(result, ax=None, title: Optional[str] = None):
    """Stacked area of the five categories, step by step, for one strategy."""
    from minipaged.lessons.memory_waste import CATEGORIES, CATEGORY_LABELS
    fig, ax, own = _figure(ax, (7, 2.8))
    # step i's state holds from i to i + 1: draw steps, not lines between them
    xs = [s.step for s in result.steps] + [len(result.steps)]
    bottom = [0.0] * len(xs)
    for c in CATEGORIES:
        ys = [getattr(s, c) / result.capacity for s in result.steps]
        top = [b + y for b, y in zip(bottom, ys + ys[-1:])]
        ax.fill_between(xs, bottom, top, step="post", color=CATEGORY_COLORS[c],
                        label=CATEGORY_LABELS[c], linewidth=0)
        bottom = top
    ax.set_xlim(0, max(xs[-1], 1))
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel("engine step")
    ax.set_ylabel("share of the cache")
    ax.set_title(title or f"{result.label}: token states {result.token_state_share:.1%} of taken "
                 "memory", fontsize=10)
    if own:
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
    return fig


def block_size_tradeoff(requests, capacity: int, block_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32,
                                                                              64, 128, 256),
                        **kw) -> list[dict]:
    """Token-state share and block-table size of the real BlockManager, per block size."""
    from minipaged.lessons.memory_waste import simulate_paged
    rows = []
    for bs in block_sizes:
        r = simulate_paged(requests, capacity // bs, bs, **kw)
        used_blocks = sum((s.token_states + s.internal_fragmentation) // bs for s in r.steps)
        rows.append({"block_size": bs, "token_state_share": r.token_state_share,
                     "internal_fragmentation": r.shares()["internal_fragmentation"],
                     "mean_table_entries": used_blocks / max(r.num_steps, 1),
                     "mean_running": r.mean_running, "steps": r.num_steps,
                     "preemptions": r.num_preemptions})
    return rows


def plot_block_size_tradeoff(rows: Sequence[dict], ax=None, title: Optional[str] = None):
    """Internal fragmentation (falls with smaller blocks) vs block-table entries (grow)."""
    fig, ax, own = _figure(ax, (6.5, 3.2))
    bss = [r["block_size"] for r in rows]
    ax.plot(bss, [r["internal_fragmentation"] for r in rows], "o-", color=CATEGORY_COLORS[
        "internal_fragmentation"], label="internal fragmentation")
    ax.set_xscale("log", base=2)
    ax.set_xticks(bss, [str(b) for b in bss])
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel("block_size (tokens per block)")
    ax.set_ylabel("internal fragmentation", color=CATEGORY_COLORS["internal_fragmentation"])
    ax2 = ax.twinx()
    ax2.plot(bss, [r["mean_table_entries"] for r in rows], "s--", color="0.3",
             label="block-table entries")
    ax2.set_yscale("log")
    ax2.set_ylabel("block-table entries (mean per step)")
    ax.set_title(title or "Block size: waste vs bookkeeping", fontsize=10)
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper center")
    if own:
        fig.tight_layout()
    return fig


def block_size_explorer(requests, capacity: int, block_sizes: Sequence[int] = (1, 2, 4, 8, 16,
                                                                              32, 64, 128),
                        start: int = 16, **kw):
    """A block-size slider: the paged token-state share of a fixed workload, recomputed with the
    real `BlockManager` for each block size (results are cached per block size)."""
    from minipaged.lessons.memory_waste import simulate_paged
    cache: dict[int, object] = {}

    def draw(block_size: int):
        if block_size not in cache:
            cache[block_size] = simulate_paged(requests, capacity // block_size, block_size, **kw)
        r = cache[block_size]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 2.8), gridspec_kw={"width_ratios": [1, 2]})
        plot_memory_waste([r], ax=a1, paper=False, title=f"block_size={block_size}")
        plot_waste_over_time(r, ax=a2)
        fig.tight_layout()
        _show(fig)

    w = _widgets()
    if w is None:
        draw(start)
        return None
    slider = w.SelectionSlider(options=list(block_sizes), value=start, description="block_size",
                               continuous_update=False)
    return w.interactive(draw, block_size=slider)


def block_size_animation(requests, capacity: int,
                         block_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128), **kw):
    """The block-size slider as an animation (one frame per block size, the real `BlockManager`
    behind each), so it survives a static render."""
    from minipaged.lessons.memory_waste import simulate_paged

    def draw(block_size: int):
        r = simulate_paged(requests, capacity // block_size, block_size, **kw)
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 2.8), gridspec_kw={"width_ratios": [1, 2]})
        plot_memory_waste([r], ax=a1, paper=False, title=f"block_size={block_size}")
        plot_waste_over_time(r, ax=a2)
        fig.tight_layout()
        return fig
    return animate(draw, block_sizes)
