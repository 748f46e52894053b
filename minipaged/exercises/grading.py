"""How an exercise is graded: load the learner's file, swap its functions in, build the solution.

`minipaged exercise check NAME` (cli.py) runs pytest on the exercise's tests with plugin.py, which
calls `load_learner_module` when pytest starts and `swap_in` once the tests are collected. The
tests themselves are the project's own, unchanged: they import and call the real symbols, and
find the learner's functions there.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path
from types import ModuleType

from minipaged.exercises import Exercise

REPO_ROOT = Path(__file__).resolve().parents[2]  # where tests/ lives in a clone of the project

# What `swap_in` replaced, to put back: (module or class, attribute name, the original value).
Undo = list[tuple[object, str, object]]


class ExerciseFileError(Exception):
    """The learner's file is missing, does not import, or lacks a function the exercise needs."""


def resolve(target: str) -> tuple[object, str, object]:
    """"module:Qual.name" -> (owner, attribute, the real object); owner is a module or class."""
    module_name, qualname = target.split(":")
    owner = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr, vars(owner)[attr]


def load_learner_module(exercise: Exercise, path: Path) -> ModuleType:
    """Import the learner's file (any path) and check it defines every function to write."""
    path = Path(path)
    if not path.is_file():
        raise ExerciseFileError(f"{path} does not exist: `minipaged exercise start "
                                f"{exercise.name}` creates it from the skeleton")
    name = f"minipaged_exercise_{exercise.name}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would (dataclasses in the file look it up)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ExerciseFileError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    missing = [f for f in exercise.functions if not callable(getattr(module, f, None))]
    if missing:
        del sys.modules[name]
        raise ExerciseFileError(f"{path} defines no {', '.join(missing)}; exercise "
                                f"{exercise.name} needs {', '.join(exercise.functions)}")
    return module


def _module_items(module) -> list[tuple[str, object]]:
    namespace = getattr(module, "__dict__", None)
    return list(namespace.items()) if isinstance(namespace, dict) else []


def swap_in(exercise: Exercise, learner: ModuleType) -> Undo:
    """Put the learner's functions where the real ones are; returns what `undo_swap` restores.

    A method is replaced on its class. A module-level function is replaced in every loaded
    module that holds it, because `from minipaged.sampling import apply_top_k_top_p_min_p` in a
    test is a reference of its own: call this after the tests are imported. The learner's own
    module is left alone (it may keep the real function under another name to compare with).
    """
    undo: Undo = []
    for target, function in zip(exercise.targets, exercise.functions):
        owner, attr, real = resolve(target)
        mine = getattr(learner, function)
        if isinstance(owner, type):
            holders = [(owner, attr)]
        else:
            holders = [(m, name) for m in list(sys.modules.values()) if m is not learner
                       for name, value in _module_items(m) if value is real]
        for holder, name in holders:
            undo.append((holder, name, vars(holder)[name]))
            setattr(holder, name, mine)
    return undo


def undo_swap(undo: Undo) -> None:
    for holder, name, value in reversed(undo):
        setattr(holder, name, value)


def solution_source(exercise: Exercise) -> str:
    """The skeleton with every function to write replaced by the real one's source.

    That is the project's code in the learner's file: what `check --solution` grades and
    `minipaged exercise solution NAME` prints. Generated, so it never drifts from the code.
    """
    text = exercise.skeleton_path.read_text()
    lines = text.splitlines(keepends=True)
    defs = {node.name: node for node in ast.parse(text).body if isinstance(node, ast.FunctionDef)}
    # Bottom up, so the line numbers of the functions above stay valid.
    for target, function in sorted(zip(exercise.targets, exercise.functions),
                                   key=lambda tf: -defs[tf[1]].lineno):
        node = defs[function]
        real = resolve(target)[2]
        source, line = inspect.getsourcelines(real)
        where = Path(inspect.getsourcefile(real)).resolve().relative_to(REPO_ROOT)
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        lines[start:node.end_lineno] = [f"# the project's code, from {where}:{line}\n",
                                        textwrap.dedent("".join(source))]
    return (f"# Solution of exercise {exercise.name!r}: the skeleton with the project's own "
            "code in it.\n" + "".join(lines))
