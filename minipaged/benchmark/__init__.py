"""Benchmarks the commands run (`minipaged bench`, `minipaged demo`), lessons 00, 03 and 08.

    throughput.py     workloads, the side-by-side throughput runs and their table
    hf_baselines.py   the naive Hugging Face baselines (sequential, static, continuous batching)

The lessons' notebooks use them too (lessons/bench.py and lessons/baseline.py re-export them);
they import nothing from lessons/, so the commands never do either.
"""
