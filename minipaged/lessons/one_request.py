"""Lesson 02b's helpers: the picture of one flattened step, and the exercise's solution.

    plot_flat_batch(input_ids, positions, metadata, names, token_text, filled)
        which token of which sequence sits in which row of the step, its position, and the
        cache slot its K/V is written to (arrows into the physical pool, block by block)
    filled_slots(k_cache)
        which slots of one layer's K cache hold something (nonzero): the "before" of a step
    next_decode_slot_mapping(engine)
        the solution of the lesson's exercise: the slot_mapping the next step will have when
        every running sequence decodes one token. tests/test_lessons.py checks it against the
        engine, step after step.

Everything drawn comes from the engine's own tensors (`ModelRunner.prepare_inputs`, the KV
cache); nothing here is on the engine's path.
"""
from __future__ import annotations

from typing import Optional, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.colors import to_rgba
from matplotlib.patches import Patch, Rectangle

from minipaged.attention.metadata import AttentionMetadata
from minipaged.lessons.viz.common import CACHED_COLOR, owner_color


def filled_slots(k_cache: torch.Tensor) -> torch.Tensor:
    """(num_blocks * block_size,) bool: the slots of one layer's K cache
    (num_blocks, block_size, kv_heads, head_dim) that hold a value (the cache starts zeroed)."""
    return (k_cache.reshape(k_cache.shape[0] * k_cache.shape[1], -1) != 0).any(-1)


def next_decode_slot_mapping(engine) -> list[int]:
    """The slot of each running sequence's newest token, in the order the scheduler will take
    them, when the next step is all decodes (no waiting prompt, nothing preempted).

    The newest token's position is `num_computed_tokens` (its K/V is not written yet). If that
    position starts a new logical block, `append_slots` will take a fresh block, and the
    allocator hands out the front of its free queue first (one block per sequence that needs one,
    in scheduling order).
    """
    bm = engine.block_manager
    bs = bm.block_size
    fresh = iter(bm.allocator.free_queue)  # block ids, the next one handed out first
    slots = []
    for seq in engine.scheduler.running:  # decodes go in running (admission) order
        pos = seq.num_computed_tokens
        table = bm.block_tables[seq.seq_id]
        block = table[pos // bs] if pos // bs < len(table) else next(fresh)
        slots.append(block * bs + pos % bs)
    return slots


def plot_flat_batch(input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                    names: Sequence[str], token_text: Sequence[str],
                    filled: Optional[torch.Tensor] = None, num_slots: Optional[int] = None,
                    title: Optional[str] = None, color_keys: Optional[Sequence[int]] = None):
    """Top: the step's flat batch, one box per row (token), coloured by sequence, with its
    position and slot. Bottom: the physical cache slots, block by block; arrows show where each
    row's K/V is written, and the slots of each sequence's earlier keys (the ones its attention
    reads besides this step's) are shaded in its colour. `filled`: slots that held K/V before the
    step (grey: other sequences' or freed ones), e.g. `filled_slots(...)` taken before the
    forward. `color_keys`: one int per sequence, e.g. the seq_ids, so that the colours match
    `viz.plot_block_tables`."""
    bs = metadata.block_size
    slots = metadata.slot_mapping.tolist()
    pos = positions.tolist()
    cu = metadata.cu_seqlens_q.tolist()
    if num_slots is None:
        num_slots = len(filled) if filled is not None else (max(slots) // bs + 1) * bs
    num_blocks = num_slots // bs
    gap = 0.35
    slot_x = [s + (s // bs) * gap for s in range(num_slots)]  # left edge of each slot
    width = slot_x[-1] + 1
    seq_of_row = [i for i in range(len(names)) for _ in range(cu[i], cu[i + 1])]
    keys = list(color_keys) if color_keys is not None else list(range(len(names)))
    colour = [owner_color(k) for k in keys]
    tables = metadata.block_tables.tolist()
    earlier = {}  # slot -> sequence, for the keys each sequence had before this step
    for i, (q_len, ctx) in enumerate(zip(metadata.query_lens, metadata.context_lens_host)):
        for p in range(ctx - q_len):
            earlier[tables[i][p // bs] * bs + p % bs] = i
    n = len(slots)
    pitch = min(width / max(n, 1), 4.0)
    left = (width - pitch * n) / 2

    fig, ax = plt.subplots(figsize=(13, 3.9))
    y_tok, y_slot = 3.0, 0.0
    for t in range(n):
        i = seq_of_row[t]
        x = left + t * pitch + 0.1 * pitch
        w = 0.8 * pitch
        ax.add_patch(Rectangle((x, y_tok), w, 0.8, facecolor=colour[i], edgecolor="0.3",
                               alpha=0.85))
        ax.text(x + w / 2, y_tok + 0.4, repr(token_text[t])[1:-1], ha="center", va="center",
                fontsize=7)
        ax.text(x + w / 2, y_tok + 1.0, f"row {t}", ha="center", va="bottom", fontsize=6,
                color="0.35")
        ax.text(x + w / 2, y_tok - 0.12, f"pos {pos[t]}\nslot {slots[t]}", ha="center",
                va="top", fontsize=6.5)
        sx = slot_x[slots[t]] + 0.45
        ax.annotate("", xy=(sx, y_slot + 0.95), xytext=(x + w / 2, y_tok - 0.75),
                    arrowprops=dict(arrowstyle="->", lw=0.7, color=colour[i]))
    for i, name in enumerate(names):  # which rows each sequence owns: cu_seqlens_q
        a, b = left + cu[i] * pitch, left + cu[i + 1] * pitch
        ax.plot([a + 0.05, a + 0.05, b - 0.05, b - 0.05], [y_tok + 1.35, y_tok + 1.5, y_tok + 1.5,
                y_tok + 1.35], color=colour[i], lw=1.2)
        rows = f"rows {cu[i]}..{cu[i + 1] - 1}" if cu[i + 1] - cu[i] > 1 else f"row {cu[i]}"
        ax.text((a + b) / 2, y_tok + 1.6, f"{name}: {rows}" if b - a > 8 else name,
                ha="center", va="bottom", fontsize=7.5)
    ax.text(-0.6, y_tok + 1.6, f"cu_seqlens_q = {cu}", ha="right", va="bottom", fontsize=8)
    written = {s: seq_of_row[t] for t, s in enumerate(slots) if s >= 0}
    for s in range(num_slots):
        if s in written:
            fc, lw = colour[written[s]], 1.4
        elif s in earlier:
            fc, lw = to_rgba(colour[earlier[s]], 0.35), 0.5
        elif filled is not None and bool(filled[s]):
            fc, lw = CACHED_COLOR, 0.5
        else:
            fc, lw = "white", 0.5
        ax.add_patch(Rectangle((slot_x[s], y_slot), 0.9, 0.9, facecolor=fc, edgecolor="0.3",
                               linewidth=lw))
    for b in range(num_blocks):
        ax.text(slot_x[b * bs] + bs / 2, y_slot - 0.2, f"block {b}", ha="center", va="top",
                fontsize=6.5)
    ax.text(-0.6, y_tok + 0.4, "flat batch\n(input_ids)", ha="right", va="center", fontsize=8)
    ax.text(-0.6, y_slot + 0.45, "cache slots\n(one layer)", ha="right", va="center", fontsize=8)
    handles = [Patch(facecolor=colour[i], label=f"{name}: written this step")
               for i, name in enumerate(names)]
    handles += [Patch(facecolor=to_rgba(colour[i], 0.35), label=f"{name}: earlier keys")
                for i, name in enumerate(names) if i in earlier.values()]
    if filled is not None:
        handles.append(Patch(facecolor=CACHED_COLOR, edgecolor="0.3", label="other K/V"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=len(handles),
              fontsize=7.5, frameon=False)
    ax.set_xlim(-7, width + 0.5)
    ax.set_ylim(-0.9, y_tok + 2.1)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
