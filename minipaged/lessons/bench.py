"""Workloads and the side-by-side throughput runs of lessons 03 and 08: they live in
`minipaged/benchmark/throughput.py` (`minipaged bench` runs them); the notebooks import them
from here."""
from minipaged.benchmark.throughput import (BACKENDS, HF_WARMUP_TOKENS, PEAK_GB_PER_S,
                                            SAME_SHAPES, WORKLOADS, BenchResult, Warmup,
                                            Workload, bandwidth, environment, format_table,
                                            hf_from_dummy, make_workload, percentiles_ms, run_hf,
                                            run_minipaged, step_breakdown, step_ms, token_ids,
                                            warm_up)

__all__ = ["BACKENDS", "HF_WARMUP_TOKENS", "PEAK_GB_PER_S", "SAME_SHAPES", "WORKLOADS",
           "BenchResult", "Warmup", "Workload", "bandwidth", "environment", "format_table",
           "hf_from_dummy", "make_workload", "percentiles_ms", "run_hf", "run_minipaged",
           "step_breakdown", "step_ms", "token_ids", "warm_up"]
