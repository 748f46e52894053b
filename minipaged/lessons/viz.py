"""Pictures for the lessons: block tables, memory waste, batch Gantt charts, utilisation, speed.

Every function draws from real engine objects: a live `BlockManager`, an engine trace
(`llm.trace`, a list of `StepRecord`), the results of `minipaged.lessons.memory_waste`, or measured
throughput. Nothing here re-implements the engine; `python -m minipaged.lessons.figures` calls the same
functions to regenerate `figures/*.png`.

    from minipaged.lessons import viz
    viz.plot_block_tables(llm.engine.block_manager)      # logical -> physical, right now
    viz.plot_block_tables(llm.trace, step=12)            # ... as recorded at step 12
    viz.plot_batch_gantt(llm.trace)                      # who ran in which step, and how
    viz.trace_explorer(llm.trace)                        # a step slider (ipywidgets)

Plain matplotlib; ipywidgets only inside the two explorer functions, which fall back to a static
picture when widgets are not available, so the module imports (and the lessons run) headless.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import matplotlib
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from minipaged.engine.trace import RequestState, StepRecord, request_timeline, tokens_in_cache, \
    trace_request_ids  # noqa: E402

# --- colours ----------------------------------------------------------------------------------
OWNER_COLORS = plt.get_cmap("tab20").colors[::2] + plt.get_cmap("tab20").colors[1::2]
SHARED_COLOR = "#6a3d9a"
CACHED_COLOR = "#d9d9d9"
FREE_COLOR = "#ffffff"
CATEGORY_COLORS = {"token_states": "#2b8cbe", "reserved": "#fdae61",
                   "internal_fragmentation": "#d7191c", "external_fragmentation": "#8c510a",
                   "free": "#eeeeee"}
STATE_COLORS = {RequestState.ABSENT: "#ffffff", RequestState.WAITING: "#d9d9d9",
                RequestState.PREFILL: "#3182bd", RequestState.DECODE: "#31a354",
                RequestState.PREEMPTED: "#e31a1c", RequestState.REQUEUED: "#fcbba1",
                RequestState.STALLED: "#fee391", RequestState.PADDING: "#fd8d3c"}
STATE_LABELS = {RequestState.WAITING: "waiting", RequestState.PREFILL: "prefill (chunk)",
                RequestState.DECODE: "decode", RequestState.PREEMPTED: "preempted",
                RequestState.REQUEUED: "waiting after preemption",
                RequestState.STALLED: "admitted, not scheduled",
                RequestState.PADDING: "padding (wasted compute)"}


def owner_color(i: int):
    return OWNER_COLORS[i % len(OWNER_COLORS)]


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


def _figure(ax, figsize):
    """(fig, ax, own): a new figure of `figsize` when `ax` is None (own=True: the caller lays it
    out), else the figure `ax` belongs to."""
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
        return fig, ax, True
    return ax.figure, ax, False


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


# --- batch composition (lesson 03) ------------------------------------------------------------
def static_batching_timeline(prompt_lens: Sequence[int], output_lens: Sequence[int],
                             batch_size: int) -> list[list[RequestState]]:
    """The schedule of `minipaged.lessons.baseline.hf_static`: one column per forward pass.

    Batch after batch in arrival order; each batch does one prefill forward (prompts left-padded
    to the longest) and then decodes until its *longest* request is done, so rows that finished
    earlier are still computed (padding) and the next batch waits.
    """
    n = len(prompt_lens)
    cols: list[list[RequestState]] = [[] for _ in range(n)]
    for b in range(0, n, batch_size):
        members = range(b, min(b + batch_size, n))
        steps = max(output_lens[i] for i in members)  # prefill (token 1) + steps-1 decodes
        for i in range(n):
            if i in members:
                row = [RequestState.PREFILL] + [RequestState.DECODE if k < output_lens[i] else
                                                RequestState.PADDING for k in range(1, steps)]
            elif i >= b + batch_size:
                row = [RequestState.WAITING] * steps
            else:
                row = [RequestState.ABSENT] * steps
            cols[i] += row
    return cols


def _state_cmap():
    return ListedColormap([STATE_COLORS[RequestState(i)] for i in range(len(RequestState))])


def plot_gantt(states: Sequence[Sequence[RequestState]], labels: Optional[Sequence[str]] = None,
               ax=None, title: str = "", xlabel: str = "engine step", legend: bool = True,
               highlight: Optional[int] = None, max_cols: Optional[int] = None):
    """One row per request, one column per step, coloured by `RequestState`."""
    import numpy as np
    n = len(states)
    fig, ax, own = _figure(ax, (9, min(0.22 * n + 1.4, 7)))
    m = np.array([[int(s) for s in row] for row in states], dtype=float) if n else np.zeros((0, 0))
    if max_cols is not None and m.shape[1] < max_cols:
        pad = np.full((n, max_cols - m.shape[1]), float(RequestState.ABSENT))
        m = np.concatenate([m, pad], axis=1)
    ax.imshow(m, aspect="auto", interpolation="nearest", cmap=_state_cmap(), vmin=-0.5,
              vmax=len(RequestState) - 0.5)
    if labels is not None and n <= 40:
        ax.set_yticks(range(n), labels, fontsize=7)
    else:
        ax.set_yticks([])
    ax.set_ylabel("request")
    ax.set_xlabel(xlabel)
    if highlight is not None:
        ax.axvline(highlight, color="black", linewidth=1.2)
    if title:
        ax.set_title(title, fontsize=10)
    if legend:
        present = {RequestState(int(x)) for x in np.unique(m)} - {RequestState.ABSENT}
        handles = [Patch(facecolor=STATE_COLORS[s], label=STATE_LABELS[s])
                   for s in RequestState if s in present]
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  frameon=False)
    if own:
        fig.tight_layout()
    return fig


def plot_batch_gantt(trace: Sequence[StepRecord], ax=None, title: Optional[str] = None,
                     highlight: Optional[int] = None, **kw):
    """Batch composition of an engine run (`llm.trace`): prefill chunks, decodes, waits,
    preemptions, one row per request (in order of first scheduling)."""
    ids = trace_request_ids(trace)
    states = request_timeline(trace, ids)
    n_pre = sum(len(r.preempted) for r in trace)
    return plot_gantt(states, ids, ax=ax, highlight=highlight, title=title or (
        f"continuous batching (minipaged): {len(trace)} steps"
        + (f", {n_pre} preemptions" if n_pre else "")), **kw)


def gantt_utilisation(states: Sequence[Sequence[RequestState]]) -> dict:
    """Cell counts: useful work (prefill/decode), padding, waiting, over the whole chart."""
    c = Counter(s for row in states for s in row)
    useful = c[RequestState.PREFILL] + c[RequestState.DECODE]
    return {"steps": len(states[0]) if states else 0, "useful": useful,
            "padding": c[RequestState.PADDING], "waiting": c[RequestState.WAITING]
            + c[RequestState.REQUEUED], "preempted": c[RequestState.PREEMPTED]}


def plot_static_vs_continuous(trace: Sequence[StepRecord], prompt_lens: Sequence[int],
                              output_lens: Sequence[int], batch_size: int):
    """The same requests under HF static batching (left) and minipaged's continuous batching."""
    static = static_batching_timeline(prompt_lens, output_lens, batch_size)
    ids = trace_request_ids(trace)
    cont = request_timeline(trace, ids)
    # the engine schedules in arrival order; rows in request order for both charts
    order = sorted(range(len(ids)), key=lambda i: int(ids[i]) if ids[i].isdigit() else i)
    cont = [cont[i] for i in order]
    labels = [ids[i] for i in order]
    width = max(len(static[0]), len(cont[0]))
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, min(0.3 * len(labels) * 2 + 2, 9)), sharex=True)
    us, uc = gantt_utilisation(static), gantt_utilisation(cont)
    plot_gantt(static, labels, ax=a1, xlabel="", max_cols=width,
               title=f"HF static batching, batch_size={batch_size}: {us['steps']} forward passes, "
                     f"{us['padding']} padded row-steps")
    plot_gantt(cont, labels, ax=a2, max_cols=width,
               title=f"continuous batching (minipaged): {uc['steps']} steps, no padding")
    a2.set_xlabel("forward pass / engine step")
    fig.tight_layout()
    return fig


def plot_kv_utilization(trace: Sequence[StepRecord], ax=None, title: Optional[str] = None):
    """KV blocks used (and cached) per step, with running / waiting requests on a second axis."""
    fig, ax, own = _figure(ax, (8, 3))
    xs = list(range(len(trace)))
    total = [r.num_blocks_used + r.num_blocks_free + r.num_blocks_cached for r in trace]
    used = [r.num_blocks_used / t for r, t in zip(trace, total)]
    cached = [(r.num_blocks_used + r.num_blocks_cached) / t for r, t in zip(trace, total)]
    ax.fill_between(xs, 0, used, color=CATEGORY_COLORS["token_states"], alpha=0.8,
                    label="blocks in use", step="post")
    ax.fill_between(xs, used, cached, color=CACHED_COLOR, alpha=0.9,
                    label="free, cached prefix", step="post")
    if trace and trace[0].usage is not None:
        share = [r.usage.num_tokens_stored / (r.usage.num_blocks * r.usage.block_size)
                 for r in trace]
        ax.step(xs, share, where="post", color="navy", linewidth=0.8, label="slots holding tokens")
    pre = [i for i, r in enumerate(trace) if r.preempted]
    if pre:
        ax.plot(pre, [1.02] * len(pre), "v", color=STATE_COLORS[RequestState.PREEMPTED],
                markersize=4, label="preemption", clip_on=False)
    ax.set_ylim(0, 1.05)
    ax.set_xlim(0, max(len(trace) - 1, 1))
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV cache")
    ax2 = ax.twinx()
    ax2.plot(xs, [r.num_running for r in trace], color="black", linewidth=1, label="running")
    ax2.plot(xs, [r.num_waiting for r in trace], color="0.5", linewidth=1, linestyle="--",
             label="waiting")
    ax2.set_ylabel("requests")
    ax2.set_ylim(bottom=0)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left", bbox_to_anchor=(1.08, 1.0),
              frameon=False)
    ax.set_title(title or f"KV cache utilisation over {len(trace)} steps", fontsize=10)
    if own:
        fig.tight_layout()
    return fig


# --- throughput -------------------------------------------------------------------------------
def plot_throughput(results, baseline: Optional[str] = None, ax=None, title: Optional[str] = None,
                    note: str = ""):
    """Horizontal bars of output tokens/s, each labelled with its ratio to `baseline`.

    `results`: {name: tokens_per_sec}, or objects with `.tokens_per_sec` and `.name` /
    `.backend` (`BaselineResult`, `BenchResult`).
    """
    if not isinstance(results, Mapping):
        results = {getattr(r, "backend", None) or r.name: r.tokens_per_sec for r in results}
    names = list(results)
    vals = [results[n] for n in names]
    base = results.get(baseline) if baseline else None
    fig, ax, own = _figure(ax, (7, 0.5 * len(names) + 1.3))
    colors = ["#2b8cbe" if n.startswith("minipaged") else "0.6" for n in names]
    ax.barh(range(len(names)), vals, color=colors)
    for i, v in enumerate(vals):
        txt = f"{v:,.0f} tok/s" + (f"  ({v / base:.2f}x)" if base else "")
        ax.text(v, i, " " + txt, va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(vals) * 1.45 if vals else 1)
    ax.set_xlabel("output tokens / s")
    ax.set_title(title or "Throughput" + (f" (ratios vs {baseline})" if base else ""), fontsize=10)
    if note:
        ax.text(0, -0.25, note, transform=ax.transAxes, fontsize=7, color="0.3", va="top")
    if own:
        fig.tight_layout()
    return fig


# --- lesson 08: where a GPU decode step goes ---------------------------------------------------
DECODE_PARTS = [("attention", "tab:blue"), ("matmul", "tab:orange"),
                ("norm/rope/silu", "tab:green"), ("sampler", "tab:purple"), ("other", "tab:gray")]


def plot_decode_breakdown(data: Mapping):
    """Two panels from `benchmarks/decode_breakdown.py`'s JSON: ms per decode step stacked by
    kernel family plus GPU idle time, at each measured point of the run; and attention's achieved
    read rate against a plain streaming read on the same GPU."""
    rows = data["rows"]
    labels = [f"step {r['decode_step']}\n{r['running']} seqs" for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    bottom = [0.0] * len(rows)
    for name, color in DECODE_PARTS:
        vals = [r["ms"][name] for r in rows]
        ax.bar(labels, vals, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar(labels, [r["idle_ms"] for r in rows], bottom=bottom, color="white", edgecolor="black",
           hatch="//", label="GPU idle (launch gaps, host)")
    for i, r in enumerate(rows):
        ax.text(i, r["wall_ms"] * 1.01, f"{r['wall_ms']:.1f} ms", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per decode step (CUDA graphs on)")
    ax.set_title(f"Where a decode step goes: {data['model'].replace('dummy:', '')}, "
                 f"nano-vllm workload, {data['gpu']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    ax.tick_params(axis="x", labelsize=7)
    ceiling = data["read_ceiling"]["triton_read_tbs"]
    ax2.plot([r["running"] for r in rows], [r["attention_tbs"] for r in rows], "o-",
             label="attention (K+V of every context)")
    ax2.axhline(ceiling, color="k", ls="--", label=f"plain streaming read {ceiling:.2f}")
    ax2.axhline(4.8, color="gray", ls=":", label="datasheet 4.8")
    ax2.set_xlabel("running sequences")
    ax2.set_ylabel("TB/s")
    ax2.set_ylim(0, 5.2)
    ax2.invert_xaxis()
    ax2.set_title("attention's read rate as the batch shrinks", fontsize=9)
    ax2.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


# --- lesson 00: how big the KV cache is -------------------------------------------------------
def plot_kv_cache_size(models: Mapping[str, int], max_tokens: int = 131072,
                       budget_gib: Optional[float] = None, ax=None, title: Optional[str] = None):
    """KV cache GiB vs tokens, for {name: bytes per token}; optionally a memory budget line."""
    fig, ax, own = _figure(ax, (7, 3.2))
    xs = [2 ** k for k in range(4, int(math.log2(max_tokens)) + 1)]
    for name, bpt in models.items():
        ys = [x * bpt / 2 ** 30 for x in xs]
        ax.plot(xs, ys, "o-", markersize=3, label=f"{name}: {bpt / 1024:.2f} KiB/token")
        ax.annotate(f"{ys[-1]:.2f} GiB at {xs[-1]:,}", (xs[-1], ys[-1]), textcoords="offset points",
                    xytext=(-10, 0), ha="right", va="center", fontsize=7,
                    bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1))
    if budget_gib is not None:
        ax.axhline(budget_gib, color=CATEGORY_COLORS["internal_fragmentation"], linestyle="--",
                   label=f"KV memory available: {budget_gib:.2f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the cache (summed over all sequences)")
    ax.set_ylabel("KV cache (GiB)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(title or "KV cache = 2 × layers × kv_heads × head_dim × bytes × tokens",
                 fontsize=10)
    if own:
        fig.tight_layout()
    return fig


# --- lesson 04: sampling ----------------------------------------------------------------------
def sampling_stages(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0):
    """Probabilities after each stage of `minipaged.sampling` for one row of logits.

    Returns {stage name: probabilities (vocab,)}; the masking is
    `minipaged.sampling.apply_top_k_top_p_min_p`, the function the `Sampler` calls.
    """
    import torch

    from minipaged.sampling import apply_top_k_top_p_min_p
    x = logits.float().reshape(1, -1)
    out = {"raw (T=1)": x.softmax(-1)[0]}
    scaled = x / max(temperature, 1e-5)
    out[f"temperature {temperature:g}"] = scaled.softmax(-1)[0]
    one = lambda v, dt: torch.tensor([v], dtype=dt)  # noqa: E731
    if top_k:
        out[f"top_k {top_k}"] = apply_top_k_top_p_min_p(scaled, one(top_k, torch.long),
                                                        one(1.0, torch.float), one(0.0, torch.float)
                                                        ).softmax(-1)[0]
    if top_p < 1.0:
        out[f"top_p {top_p:g}"] = apply_top_k_top_p_min_p(scaled, one(0, torch.long),
                                                          one(top_p, torch.float),
                                                          one(0.0, torch.float)).softmax(-1)[0]
    if min_p > 0.0:
        out[f"min_p {min_p:g}"] = apply_top_k_top_p_min_p(scaled, one(0, torch.long),
                                                          one(1.0, torch.float),
                                                          one(min_p, torch.float)).softmax(-1)[0]
    return out


def plot_token_distributions(stages: Mapping[str, "object"], token_labels: Sequence[str],
                             top: int = 20, title: str = ""):
    """One bar chart per stage over the `top` most likely raw tokens.

    Dotted outlines: the raw probabilities; a red × marks a token the stage masked out.
    """
    import torch
    names = list(stages)
    first = stages[names[0]]
    order = torch.argsort(first, descending=True)[:top].tolist()
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.35 * len(names) + 0.9), sharex=True)
    axes = [axes] if len(names) == 1 else list(axes)
    for ax, name in zip(axes, names):
        p = stages[name]
        vals = [float(p[i]) for i in order]
        raw = [float(first[i]) for i in order]
        kept = int((p > 0).sum())
        ax.bar(range(len(order)), raw, color="none", edgecolor="#bbbbbb", linestyle=":",
               label="raw p" if ax is axes[0] else None)
        ax.bar(range(len(order)), vals, color=["#2b8cbe" if v > 0 else "none" for v in vals])
        for i, v in enumerate(vals):
            if v == 0:
                ax.text(i, 0, "×", ha="center", va="bottom", fontsize=8, color="#d7191c")
        ax.set_ylabel("p", fontsize=8)
        ent = float(-(p[p > 0] * p[p > 0].log()).sum())
        ax.set_title(f"{name}: {kept} tokens can be drawn, entropy {ent:.2f} nats", fontsize=9,
                     loc="left")
        ax.set_ylim(0, max(max(vals), max(raw), 1e-3) * 1.15)
    axes[-1].set_xticks(range(len(order)), [repr(token_labels[i])[1:-1] for i in order],
                        rotation=60, fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# --- widgets ----------------------------------------------------------------------------------
def _widgets():
    try:
        import ipywidgets
        return ipywidgets
    except ImportError:  # pragma: no cover - ipywidgets is a dependency, but stay importable
        return None


def _show(fig):
    from IPython.display import display
    display(fig)
    plt.close(fig)


def trace_explorer(trace: Sequence[StepRecord], start: Optional[int] = None):
    """A step slider replaying a trace: block tables at step t above the batch Gantt chart.

    Needs `record_block_tables=True`. Without ipywidgets, draws step `start` once.
    """
    if not trace:
        raise ValueError("the trace is empty: generate something first")
    if trace[0].block_tables is None:
        raise ValueError("this trace has no block tables: create the LLM with "
                         "record_block_tables=True")
    start = len(trace) // 2 if start is None else start
    ids = trace_request_ids(trace)
    states = request_timeline(trace, ids)

    def draw(step: int):
        _show(plot_block_tables(trace, step))
        fig = plot_gantt(states, ids, highlight=step, title=f"batch at step {trace[step].step} "
                         f"(black line): {len(trace[step].scheduled)} sequences, "
                         f"{trace[step].num_batched_tokens} tokens")
        _show(fig)

    w = _widgets()
    if w is None:
        draw(start)
        return None
    slider = w.IntSlider(value=start, min=0, max=len(trace) - 1, description="step",
                         continuous_update=False)
    return w.interactive(draw, step=slider)


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


__all__ = ["BlockTableView", "view_from_block_manager", "view_from_trace", "plot_block_tables",
           "plot_memory_waste", "plot_waste_over_time", "block_size_tradeoff",
           "plot_block_size_tradeoff", "static_batching_timeline", "plot_gantt",
           "plot_batch_gantt", "plot_static_vs_continuous", "gantt_utilisation",
           "plot_kv_utilization", "plot_throughput", "plot_kv_cache_size", "sampling_stages",
           "plot_token_distributions", "trace_explorer", "block_size_explorer"]
