"""What the notebooks import: experiments, plots and baselines around the engine.

    viz.py            block tables, Gantt charts, KV use, throughput and sampling plots; widgets
    figures.py        the lessons' experiments and `python -m minipaged.lessons.figures`
    memory_waste.py   lesson 01's allocator simulations (the vLLM paper's Fig. 2)
    one_request.py    lesson 02b's picture of one flat step and its exercise's solution
    chunked_prefill.py  lesson 03's decode ITL, chunked prefill on and off
    sharing.py        lesson 06's memory saved by sharing; n samples by fork vs by n requests
    preemption.py     lesson 06's recompute vs swap preemption runs and the swap copy timing
    baseline.py       the naive Hugging Face baselines (re-exported from minipaged/benchmark/)
    bench.py          workloads and the side-by-side throughput runs (the same: `minipaged bench`)
    tp.py             lesson 09's tensor-parallel shards and data-flow pictures
    tp_measure.py     lesson 09's gloo timings of one step (compute vs communication)
    quantization.py   lesson 11's fp8 measurements: logits cosine, top-1 agreement, weight error
    structured.py     lesson 12's grammar masks drawn and measured, its graded exercise
    server.py         an in-process `minipaged serve` for lessons 07 and 12

None of it is on the engine's path: the engine never imports this package.
"""
