"""Benchmarks the commands run (`minipaged bench`, `bench serve`, `demo`), lessons 00, 03, 08, 13.

    throughput.py     workloads, the side-by-side throughput runs and their table
    hf_baselines.py   the naive Hugging Face baselines (sequential, static, continuous batching)
    serving.py        one streamed request, Poisson / gamma arrivals, vLLM's serving metrics
    load_client.py    open-loop load from several client processes (`minipaged bench serve`)

The lessons' notebooks use them too (lessons/bench.py and lessons/baseline.py re-export them);
they import nothing from lessons/, so the commands never do either.
"""
