"""Block tables: each sequence's logical blocks mapped to physical block ids, next to the pool.

`plot_block_tables` draws a live `BlockManager` or a step of an engine trace (through a
`BlockTableView`, the snapshot it draws from): how full each block is (internal fragmentation),
which blocks are shared after `fork` or a prefix-cache hit, and which free blocks still hold a
cached prefix. Lesson 02 (the block manager) and lesson 06 (sharing and preemption) show it, and
`timeline.trace_explorer` replays it step by step.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from minipaged.engine.trace import StepRecord
from minipaged.lessons.timeline import tokens_in_cache
from minipaged.lessons.viz.common import CACHED_COLOR, FREE_COLOR, SHARED_COLOR, owner_color


# --- block tables -----------------------------------------------------------------------------
@dataclass
class BlockTableView:
    """What the block-table picture shows: per sequence, its physical blocks and its tokens."""

    tables: dict[str, list[int]]  # name -> physical block ids (logical order)
    num_tokens: dict[str, int]  # name -> tokens in its blocks
    block_size: int
    num_blocks: int
    cached: set[int] = field(default_factory=set)  # free blocks still holding a cached prefix
    title: str = ""
    num_cached: Optional[int] = None  # when only the count is known (a trace snapshot)
    color_keys: dict[str, int] = field(default_factory=dict)  # stable colour per sequence

    @property
    def ref_counts(self) -> Counter:
        return Counter(b for t in self.tables.values() for b in t)

    @property
    def shared_blocks(self) -> set[int]:
        return {b for b, n in self.ref_counts.items() if n > 1}

    def fill(self, name: str, logical: int) -> int:
        """Slots of logical block `logical` of `name` that hold a token."""
        filled = self.num_tokens.get(name, 0) - logical * self.block_size
        return max(0, min(self.block_size, filled))

    @property
    def num_tokens_stored(self) -> int:
        """Slots holding a token, counting a shared block once (as `BlockUsage` does)."""
        filled: dict[int, int] = {}
        for name, table in self.tables.items():
            for i, b in enumerate(table):
                filled[b] = max(filled.get(b, 0), self.fill(name, i))
        return sum(filled.values())


def view_from_block_manager(bm, names: Optional[Mapping[int, str]] = None,
                            title: str = "") -> BlockTableView:
    """Snapshot of a live `BlockManager` (`names`: seq_id -> label; default "seq <id>")."""
    names = names or {}
    label = {sid: names.get(sid, f"seq {sid}") for sid in bm.block_tables}
    a = bm.allocator
    cached = {b for b in a.free_queue if a.blocks[b].block_hash is not None}
    return BlockTableView(tables={label[s]: list(t) for s, t in bm.block_tables.items()},
                          num_tokens={label[s]: bm.num_slots[s] for s in bm.block_tables},
                          block_size=bm.block_size, num_blocks=bm.num_blocks, cached=cached,
                          title=title, color_keys={label[s]: s for s in bm.block_tables})


def view_from_trace(trace: Sequence[StepRecord], position: int, block_size: Optional[int] = None,
                    num_blocks: Optional[int] = None) -> BlockTableView:
    """Snapshot recorded in `trace[position]` (the LLM needs `record_block_tables=True`)."""
    rec = trace[position]
    if rec.block_tables is None:
        raise ValueError("this trace has no block tables: create the LLM with "
                         "record_block_tables=True")
    if rec.usage is not None:
        block_size = block_size or rec.usage.block_size
        num_blocks = num_blocks or rec.usage.num_blocks
    if block_size is None or num_blocks is None:
        raise ValueError("pass block_size and num_blocks")
    tokens = tokens_in_cache(trace, position)
    return BlockTableView(tables={k: list(v) for k, v in rec.block_tables.items()},
                          num_tokens={k: tokens.get(k, 0) for k in rec.block_tables},
                          block_size=block_size, num_blocks=num_blocks,
                          title=f"after step {rec.step}", num_cached=rec.num_blocks_cached,
                          color_keys={k: int(k) for k in rec.block_tables if k.isdigit()})


def _as_view(source, step: Optional[int] = None, names=None) -> BlockTableView:
    if isinstance(source, BlockTableView):
        return source
    if hasattr(source, "block_tables") and hasattr(source, "allocator"):
        return view_from_block_manager(source, names)
    if isinstance(source, (list, tuple)):
        return view_from_trace(source, len(source) - 1 if step is None else step)
    raise TypeError(f"cannot draw block tables from {type(source).__name__}")


def plot_block_tables(source, step: Optional[int] = None, *, names=None,
                      max_physical: Optional[int] = None, physical_cols: int = 16,
                      max_rows: int = 12, title: Optional[str] = None):
    """Left: each sequence's logical blocks -> physical block ids. Right: the physical pool.

    `source`: a `BlockManager`, a trace (with `step` a position in it) or a `BlockTableView`.
    A block's shaded part is how many of its slots hold tokens (the last block is usually only
    partly full: internal fragmentation). Shared blocks (ref count > 1, after `fork` or a prefix
    cache hit) are hatched and labelled with their ref count.
    """
    v = _as_view(source, step, names)
    names_all = list(v.tables)
    names_shown = names_all[:max_rows]
    colour = {n: owner_color(v.color_keys.get(n, i)) for i, n in enumerate(names_all)}
    refs = v.ref_counts
    bs = v.block_size
    width = max((len(v.tables[n]) for n in names_shown), default=1)
    width = max(width, 1)
    used_ids = [b for t in v.tables.values() for b in t] + list(v.cached)
    if max_physical is None:
        rows_used = math.ceil((max(used_ids, default=0) + 1) / physical_cols)
        max_physical = min(v.num_blocks, max(32, physical_cols * rows_used))
    n_phys = min(v.num_blocks, max_physical)
    phys_rows = math.ceil(n_phys / physical_cols)

    left_w = min(4 + 0.55 * width, 9)
    height = max(2.6, 0.45 * max(len(names_shown), phys_rows) + 1.4)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(left_w + 4.5, height),
                                   gridspec_kw={"width_ratios": [left_w, 4.5]})
    # logical view
    for r, name in enumerate(names_shown):
        y = len(names_shown) - 1 - r
        for i, b in enumerate(v.tables[name]):
            filled = v.fill(name, i) / bs
            shared = refs[b] > 1
            ax1.add_patch(Rectangle((i, y + 0.1), 0.92, 0.8, facecolor="white", edgecolor="0.3"))
            ax1.add_patch(Rectangle((i, y + 0.1), 0.92 * filled, 0.8, facecolor=colour[name],
                                    edgecolor="none", alpha=0.85,
                                    hatch="//" if shared else None))
            if shared:
                ax1.add_patch(Rectangle((i, y + 0.1), 0.92, 0.8, fill=False, edgecolor=SHARED_COLOR,
                                        linewidth=2.2))
            label = f"{b}" + (f"\n×{refs[b]}" if shared else "")
            ax1.text(i + 0.46, y + 0.5, label, ha="center", va="center", fontsize=8,
                     bbox=dict(facecolor="white", edgecolor="none", alpha=0.85, pad=1)
                     if shared else None)
        ax1.text(-0.15, y + 0.5, f"{name}\n{v.num_tokens.get(name, 0)} tok", ha="right",
                 va="center", fontsize=8)
    ax1.set_xlim(-0.05, width)
    ax1.set_ylim(0, max(len(names_shown), 1))
    ax1.set_xticks([i + 0.46 for i in range(width)], [str(i) for i in range(width)], fontsize=8)
    ax1.set_yticks([])
    ax1.set_xlabel("logical block (the number inside: physical block id)")
    for s in ("top", "right", "left"):
        ax1.spines[s].set_visible(False)
    extra = f" (first {max_rows} of {len(names_all)})" if len(names_all) > max_rows else ""
    ax1.set_title(f"block tables{extra}, block_size={bs}", fontsize=10)

    # physical view
    owner: dict[int, str] = {}
    for name in names_all:
        for b in v.tables[name]:
            owner.setdefault(b, name)
    for b in range(n_phys):
        x, y = b % physical_cols, phys_rows - 1 - b // physical_cols
        if refs[b] > 1:
            fc, hatch = SHARED_COLOR, "//"
        elif b in owner:
            fc, hatch = colour[owner[b]], None
        elif b in v.cached:
            fc, hatch = CACHED_COLOR, ".."
        else:
            fc, hatch = FREE_COLOR, None
        ax2.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=fc, edgecolor="0.5", hatch=hatch,
                                linewidth=0.6))
        if physical_cols <= 16:
            ax2.text(x + 0.45, y + 0.45, str(b), ha="center", va="center", fontsize=6, color="0.2")
    ax2.set_xlim(0, physical_cols)
    ax2.set_ylim(0, phys_rows)
    ax2.set_aspect("equal")
    ax2.axis("off")
    used = len(owner)
    ax2.set_title(f"physical blocks {0}-{n_phys - 1} of {v.num_blocks}: {used} used"
                  + (f", {len(v.shared_blocks)} shared" if v.shared_blocks else "")
                  + (f", {len(v.cached)} cached" if v.cached else "")
                  + (f", {v.num_cached} cached (ids not recorded)" if v.num_cached else ""),
                  fontsize=10)
    handles = [Patch(facecolor=SHARED_COLOR, hatch="//", label="shared (ref count > 1)"),
               Patch(facecolor=CACHED_COLOR, hatch="..", label="free, holds a cached prefix"),
               Patch(facecolor=FREE_COLOR, edgecolor="0.5", label="free")]
    ax2.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=7, ncol=2,
               frameon=False)
    stored = v.num_tokens_stored
    slots = len(owner) * bs
    fig.suptitle(title if title is not None else
                 (f"{v.title}: " if v.title else "") + f"{stored} tokens in {slots} slots"
                 + (f" ({stored / slots:.0%} token states)" if slots else ""), fontsize=11)
    fig.tight_layout()
    return fig
