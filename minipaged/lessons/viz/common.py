"""What every picture of the lessons shares: the colours and the small figure helpers.

The colours of block owners, shared / cached / free blocks, the memory-waste categories and the
`RequestState`s of a Gantt chart, so that every lesson paints the same thing the same way;
`_figure` (draw on a given axis or a new figure), and `_widgets` / `_show`, which let the two
explorer widgets (lessons 01 and 02) fall back to a static picture without ipywidgets. It draws
nothing by itself; `blocks.py`, `waste.py`, `timeline.py` and `charts.py` import from it.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from minipaged.lessons.timeline import RequestState

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


def _figure(ax, figsize):
    """(fig, ax, own): a new figure of `figsize` when `ax` is None (own=True: the caller lays it
    out), else the figure `ax` belongs to."""
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
        return fig, ax, True
    return ax.figure, ax, False


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


def animate(draw, frames, interval_ms: int = 700, dpi: int = 72):
    """A picture per frame, played by matplotlib's JavaScript player (`to_jshtml`): the frames
    are PNGs inside the page, so the animation survives a static render (the course book, a
    notebook viewer) where a widget shows nothing. `draw(frame)` returns a figure."""
    import numpy as np
    from IPython.display import HTML
    from matplotlib.animation import ArtistAnimation

    images = []
    for frame in frames:
        fig = draw(frame)
        fig.set_dpi(dpi)
        fig.canvas.draw()
        images.append(np.asarray(fig.canvas.buffer_rgba()).copy())
        plt.close(fig)
    h = max(im.shape[0] for im in images)
    w = max(im.shape[1] for im in images)
    padded = []
    for im in images:  # frames of different sizes sit on one white canvas
        canvas = np.full((h, w, 4), 255, dtype=np.uint8)
        canvas[:im.shape[0], :im.shape[1]] = im
        padded.append(canvas)
    fig = plt.figure(figsize=(w / dpi, h / dpi), dpi=dpi)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.axis("off")
    anim = ArtistAnimation(fig, [[ax.imshow(im, animated=True)] for im in padded],
                           interval=interval_ms, blit=True)
    html = anim.to_jshtml(default_mode="once")
    plt.close(fig)
    return HTML(html)
