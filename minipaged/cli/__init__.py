"""The `minipaged` command line, shaped like vLLM's: `minipaged COMMAND [MODEL] [flags]`.

    minipaged demo                              stories260K: minipaged vs naive HF, side by side
    minipaged generate stories260K --prompt "Once upon a time" --max-tokens 40
    minipaged chat stories260K                  type a line, get a reply (offline engine)
    minipaged bench stories260K --workload cpu  throughput table beside the HF baselines
    minipaged bench serve --request-rate 2,8    requests at a rate against a running server
    minipaged serve stories260K --port 8000     the OpenAI-compatible server
    minipaged download stories260K              fetch a model now, so later runs need no network
    minipaged exercise list                     the build-it track (minipaged/exercises/)

One module per command, each with `main(argv) -> int`; the modules are imported only when their
command runs, so `minipaged serve --help` needs none of the serve extras. The engine flags of
generate / chat / bench / serve come from `EngineConfig` (args.py); a mistake is one `error:`
line and exit status 2 (errors.py; `--debug` shows the traceback).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

__all__ = ["COMMANDS", "main"]

# The subcommands: name -> (module with `main(argv) -> int`, one line for `minipaged --help`).
# To add one, add its line here.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("minipaged.cli.demo", "stories260K through minipaged and naive HF, side by side"),
    "generate": ("minipaged.cli.generate", "generate text for one or more prompts"),
    "chat": ("minipaged.cli.chat", "chat with a model in the terminal (offline engine)"),
    "bench": ("minipaged.cli.bench", "throughput beside the Hugging Face baselines; "
                                     "`bench serve`: load at a rate against a server"),
    "serve": ("minipaged.cli.serve", "OpenAI-compatible server (vLLM's `vllm serve` flags)"),
    "download": ("minipaged.cli.download", "fetch a model into the cache now"),
    "exercise": ("minipaged.exercises.cli", "the build track: thirteen stages, graders, hints, the capstone"),
}


def main(argv: Optional[list[str]] = None) -> int:
    """`minipaged COMMAND ...`: hands `...` to the command's module."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        return module.main(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        ap = argparse.ArgumentParser(prog="minipaged", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        sub = ap.add_subparsers(metavar="COMMAND")
        for name, (_, help_text) in COMMANDS.items():
            sub.add_parser(name, help=f"{help_text} (`minipaged {name} --help`)")
        ap.print_help()
        return 0 if argv else 2
    print(f"error: unknown command {argv[0]!r}; the commands are {', '.join(COMMANDS)} "
          "(see `minipaged --help`)", file=sys.stderr)
    return 2
