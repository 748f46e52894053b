"""One line per mistake: how every `minipaged` command reports an error.

A teaching error (a wrong flag or value, a model that is not there, `--device cuda` on a
CPU-only torch, a KV cache too small, a busy port) ends the command with one line on stderr,

    error: max_model_len=4096 is larger than the model's max_position_embeddings=512: ...

and exit status 2 (argparse's status for a usage error). `--debug` raises it instead, with the
full traceback. Anything else (a bug) keeps its traceback: it is not the user's mistake.

Each command's `main(argv) -> int` wraps its body in `run_command`, so `minipaged serve ...`
and `minipaged.cli.serve.main([...])` (lesson 07) behave the same.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence


class CLIError(Exception):
    """A mistake on the command line that is not a config or model error: a flag argparse
    refuses, a busy port, a missing install. Printed as one `error:` line."""


# RequestError (engine/processor.py) is a ValueError; so are EngineConfig's checks.
TEACHING_ERRORS = (CLIError, ValueError, FileNotFoundError, TimeoutError)


def one_line(message: str) -> str:
    """A message that may span lines, as one: lines joined with "; " (after ':' or '.', a space)."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    out = lines[0] if lines else ""
    for line in lines[1:]:
        out += (" " if out.endswith((":", ".")) else "; ") + line
    return out


def run_command(body: Callable[[list[str]], int], argv: Optional[Sequence[str]]) -> int:
    """`body(argv)`'s exit status; a teaching error becomes one `error:` line and status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    try:
        return body(argv)
    except TEACHING_ERRORS as e:
        if debug:
            raise
        print(f"error: {one_line(str(e)) or type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130


__all__ = ["CLIError", "TEACHING_ERRORS", "one_line", "run_command"]
