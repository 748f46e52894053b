"""Show where a capability plugs into the core (the lessons of later capabilities open with it).

The core (engine/) names a later capability only where it attaches it through a seam: the step
loop (engine/step_loop.py), request extensions (engine/extensions.py), the scheduler's and the
block manager's subclasses, runner wrappers and module transforms. These helpers print those
few lines from the installed source, so a lesson shows the code as it is, not a copy.
"""
from __future__ import annotations

import inspect


def source(obj) -> str:
    """`obj`'s source (a function, class or method), as a string to print."""
    return inspect.getsource(obj)


def lines_with(module, *words: str) -> str:
    """The lines of `module`'s source that contain any of `words`, with their line numbers
    (`engine/llm_engine.py:123  ...`)."""
    name = module.__name__.replace(".", "/") + ".py"
    lines = inspect.getsource(module).splitlines()
    return "\n".join(f"{name}:{i:<4d} {line.strip()}" for i, line in enumerate(lines, 1)
                     if any(w in line for w in words))
