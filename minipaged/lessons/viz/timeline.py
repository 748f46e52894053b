"""Batches over time: Gantt charts of who ran in which step, and KV cache use step by step.

`plot_gantt` colours one row per request by its `RequestState`; `static_batching_timeline`
builds the schedule of HF static batching (lesson 00) and `plot_batch_gantt` the one an engine
trace recorded, `plot_static_vs_continuous` puts the two side by side and `plot_kv_utilization`
draws blocks in use and requests running / waiting per step (lesson 03, continuous batching);
`trace_explorer` is a step slider over block tables and the Gantt chart (lesson 02).
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import matplotlib
import matplotlib.pyplot as plt
import matplotlib.ticker
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from minipaged.engine.trace import StepRecord
from minipaged.lessons.timeline import RequestState, request_timeline, trace_request_ids
from minipaged.lessons.viz.blocks import plot_block_tables
from minipaged.lessons.viz.common import (CACHED_COLOR, CATEGORY_COLORS, STATE_COLORS,
                                          STATE_LABELS, _figure, _show, _widgets, animate)


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


def _rows_in_request_order(trace: Sequence[StepRecord]):
    ids = trace_request_ids(trace)
    states = request_timeline(trace, ids)
    # the engine schedules in arrival order; rows in request order, as the static chart has them
    order = sorted(range(len(ids)), key=lambda i: int(ids[i]) if ids[i].isdigit() else i)
    return [states[i] for i in order], [ids[i] for i in order]


def max_running(trace: Sequence[StepRecord]) -> int:
    """The most sequences any step of `trace` ran at once: the seats the engine really used."""
    return max((len(r.scheduled) for r in trace), default=0)


def plot_static_vs_continuous(trace: Sequence[StepRecord], prompt_lens: Sequence[int],
                              output_lens: Sequence[int], batch_size: int,
                              more_seats: Optional[Sequence[StepRecord]] = None):
    """The same requests under HF static batching and minipaged's continuous batching, at the
    same number of seats; `more_seats` (a trace of an engine with more of them) adds a third
    chart: what more seats give, shown apart so that it is not credited to the scheduler.

    `trace` must come from an engine that never ran more than `batch_size` sequences at once
    (`LLM(..., max_num_seqs=batch_size)`): a comparison at different seat counts measures the
    seats, not the scheduling.
    """
    seats = max_running(trace)
    if seats > batch_size:
        raise ValueError(
            f"the continuous-batching trace ran {seats} sequences at once against static batches "
            f"of {batch_size}: compare at the same seats (LLM(..., max_num_seqs={batch_size})) "
            f"and pass the larger engine's trace as more_seats=")
    static = static_batching_timeline(prompt_lens, output_lens, batch_size)
    cont, labels = _rows_in_request_order(trace)
    charts = [static, cont]
    if more_seats is not None:
        wide, _ = _rows_in_request_order(more_seats)
        charts.append(wide)
    width = max(len(c[0]) for c in charts)
    n = len(charts)
    fig, axes = plt.subplots(n, 1, figsize=(9, min(0.22 * len(labels) * n + 1.6, 3.2 * n)),
                             sharex=True)
    us, uc = gantt_utilisation(static), gantt_utilisation(cont)
    plot_gantt(static, labels, ax=axes[0], xlabel="", max_cols=width,
               title=f"HF static batching, batches of {batch_size}: {us['steps']} forward "
                     f"passes, {us['padding']} padded row-steps")
    plot_gantt(cont, labels, ax=axes[1], xlabel="", max_cols=width,
               title=f"continuous batching (minipaged), the same {batch_size} seats "
                     f"(max_num_seqs={batch_size}): {uc['steps']} steps, no padding "
                     f"({us['steps'] / uc['steps']:.2f}x fewer)")
    if more_seats is not None:
        wide_seats = max_running(more_seats)
        uw = gantt_utilisation(charts[2])
        us_wide = gantt_utilisation(static_batching_timeline(prompt_lens, output_lens,
                                                             wide_seats))
        plot_gantt(charts[2], labels, ax=axes[2], xlabel="", max_cols=width,
                   title=f"more seats, apart: minipaged with {wide_seats} running, {uw['steps']} "
                         f"steps (static batches of {wide_seats}: {us_wide['steps']} passes, "
                         f"{us_wide['padding']} padded row-steps)")
    axes[-1].set_xlabel("forward pass / engine step")
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


# --- replaying a trace (lesson 02) ------------------------------------------------------------
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


def trace_animation(trace: Sequence[StepRecord], steps: Optional[Sequence[int]] = None,
                    interval_ms: int = 700):
    """The trace explorer as an animation: the block tables at each of `steps` (positions in the
    trace; default: every step, at most 40), one frame each, with the batch in the title.
    Needs `record_block_tables=True`. It survives a static render, unlike the slider."""
    if not trace or trace[0].block_tables is None:
        raise ValueError("this trace has no block tables: create the LLM with "
                         "record_block_tables=True")
    if steps is None:
        steps = list(range(0, len(trace), max(1, len(trace) // 40)))

    def draw(i: int):
        r = trace[i]
        return plot_block_tables(trace, i, title=f"step {r.step}: {len(r.scheduled)} sequences, "
                                                 f"{r.num_batched_tokens} tokens")
    return animate(draw, steps, interval_ms)
