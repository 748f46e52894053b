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

Which file draws what, and which lessons show it:

- `blocks.py`: block tables, logical -> physical, and the physical pool (lessons 02 and 06).
- `waste.py`: where the KV cache goes, per strategy and over time, the block-size trade-off and
  its slider `block_size_explorer` and animation `block_size_animation` (lesson 01).
- `timeline.py`: Gantt charts of batches (static batching in lesson 00, continuous in lesson 03),
  the trace replayed as an animation (`trace_animation`, lesson 02),
  KV cache utilisation over time (lesson 03) and the step slider `trace_explorer` (lesson 02).
- `charts.py`: throughput (lessons 00, 03, 08), a decode step's breakdown (lesson 08), KV cache
  size (lesson 00), sampling stages and token distributions (lesson 04), the served path beside
  the offline engine (lesson 07).
- `common.py`: the colours, the small helpers the others share, and `animate` (a JavaScript
  player over one picture per frame, which survives a static render).

Plain matplotlib; ipywidgets only inside the two explorer functions, which fall back to a static
picture when widgets are not available, so the package imports (and the lessons run) headless.
Every name is re-exported here: use `viz.<name>`, not the submodules.
"""
from __future__ import annotations

from minipaged.lessons.viz.blocks import (BlockTableView, plot_block_tables,
                                          view_from_block_manager, view_from_trace)
from minipaged.lessons.viz.charts import (DECODE_PARTS, plot_decode_breakdown,
                                          plot_kv_cache_size, plot_serve_vs_offline,
                                          plot_throughput, serve_vs_offline_rows,
                                          plot_token_distributions, sampling_stages)
from minipaged.lessons.viz.common import (CACHED_COLOR, CATEGORY_COLORS, FREE_COLOR, OWNER_COLORS,
                                          SHARED_COLOR, STATE_COLORS, STATE_LABELS, animate,
                                          owner_color)
from minipaged.lessons.viz.timeline import (gantt_utilisation, plot_batch_gantt, plot_gantt,
                                            plot_kv_utilization, plot_static_vs_continuous,
                                            static_batching_timeline, trace_animation,
                                            trace_explorer)
from minipaged.lessons.viz.waste import (block_size_animation, block_size_explorer,
                                         block_size_tradeoff,
                                         plot_block_size_tradeoff, plot_memory_waste,
                                         plot_waste_over_time)

__all__ = ["animate", "trace_animation", "block_size_animation", "BlockTableView", "view_from_block_manager", "view_from_trace", "plot_block_tables",
           "plot_memory_waste", "plot_waste_over_time", "block_size_tradeoff",
           "plot_block_size_tradeoff", "static_batching_timeline", "plot_gantt",
           "plot_batch_gantt", "plot_static_vs_continuous", "gantt_utilisation",
           "plot_kv_utilization", "plot_throughput", "plot_decode_breakdown",
           "plot_serve_vs_offline", "serve_vs_offline_rows", "plot_kv_cache_size",
           "sampling_stages", "plot_token_distributions", "trace_explorer", "block_size_explorer",
           "owner_color", "OWNER_COLORS", "SHARED_COLOR", "CACHED_COLOR", "FREE_COLOR",
           "CATEGORY_COLORS", "STATE_COLORS", "STATE_LABELS", "DECODE_PARTS"]
