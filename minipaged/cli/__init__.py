"""The `minipaged` command line: `demo`, `generate`, `bench` and `serve` (vLLM's flags).

    commands.py   `minipaged demo | generate`, and `main`, which hands `bench` and `serve` on
    bench.py      `minipaged bench`: the throughput table (minipaged beside the HF baselines)
    serve.py      `minipaged serve MODEL`: the OpenAI-compatible server of `minipaged/server/`
    download.py   `minipaged download MODEL`: fetch, check and convert a model into the cache
"""
import sys
from typing import Optional

from minipaged.cli import commands

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> int:
    """`minipaged download ...` here; every other command goes on to `commands.main`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "download":
        from minipaged.cli.download import main as download_main
        return download_main(argv[1:])
    if argv and argv[0] == "exercise":  # the build-it track: minipaged/exercises/cli.py
        from minipaged.exercises.cli import main as exercise_main
        return exercise_main(argv[1:])
    return commands.main(argv)
