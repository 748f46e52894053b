"""Workloads and the side-by-side throughput runs of lessons 03 and 08: they live in
`minipaged/benchmark/throughput.py` (`minipaged bench` runs them); the notebooks import them
from here."""
from minipaged.benchmark.throughput import (BACKENDS, PEAK_GB_PER_S, WORKLOADS, BenchResult,
                                            Workload, bandwidth, environment, format_table,
                                            hf_from_dummy, make_workload, percentiles_ms, run_hf,
                                            run_minipaged, step_breakdown)

__all__ = ["BACKENDS", "PEAK_GB_PER_S", "WORKLOADS", "BenchResult", "Workload", "bandwidth",
           "environment", "format_table", "hf_from_dummy", "make_workload", "percentiles_ms",
           "run_hf", "run_minipaged", "step_breakdown"]
