"""The `minipaged` command line: `demo`, `generate`, `bench` and `serve` (vLLM's flags).

    commands.py   `minipaged demo | generate`, and `main`, which hands `bench` and `serve` on
    bench.py      `minipaged bench`: the throughput table (minipaged beside the HF baselines)
    serve.py      `minipaged serve MODEL`: the OpenAI-compatible server of `minipaged/server/`
"""
from minipaged.cli.commands import main

__all__ = ["main"]
