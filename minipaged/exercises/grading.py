"""How a stage is graded: load the learner's file, swap its functions in, build the solution.

`minipaged exercise check NAME` (cli.py) runs pytest on the stage's graders with plugin.py,
which calls `load_learner_module` when pytest starts and `swap_in` once the tests are
collected; the capstone (capstone.py) swaps every written stage in at once. The graders are the
project's own tests, unchanged: they import and call the real symbols, and find the learner's
functions there.
"""
from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from minipaged.exercises.stages import Stage

REPO_ROOT = Path(__file__).resolve().parents[2]  # where tests/ lives in a clone of the project
SKELETON_MARK = 'raise NotImplementedError("exercise: '  # what every untouched body raises



@dataclass
class Undo:
    """What `swap_in` replaced, to put back: (module or class, attribute name, the original
    value), and (the learner's function, the real one) for modules imported after the swap,
    which took the learner's function from a module that held it then."""

    replaced: list[tuple[object, str, object]] = field(default_factory=list)
    pairs: list[tuple[object, object]] = field(default_factory=list)


class ExerciseFileError(Exception):
    """The learner's file is missing, does not import, or lacks a function the stage needs."""


def unwrap(obj):
    """The Python function behind a Triton kernel (`@triton.jit` wraps it), else `obj`."""
    fn = getattr(obj, "fn", None)
    return fn if inspect.isfunction(fn) else obj


def resolve(target: str) -> tuple[object, str, object]:
    """"module:Qual.name" -> (owner, attribute, the real object); owner is a module or class."""
    module_name, qualname = target.split(":")
    owner = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attr, vars(owner)[attr]


def load_learner_module(stage: Stage, path: Path) -> ModuleType:
    """Import the learner's file (any path) and check it defines every function to write."""
    path = Path(path)
    if not path.is_file():
        raise ExerciseFileError(f"{path} does not exist: `minipaged exercise start "
                                f"{stage.name}` creates it from the skeleton")
    name = f"minipaged_exercise_{stage.name}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would (dataclasses in the file look it up)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ExerciseFileError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    missing = [f for f in stage.functions if not callable(getattr(module, f, None))]
    if missing:
        del sys.modules[name]
        raise ExerciseFileError(f"{path} defines no {', '.join(missing)}; stage "
                                f"{stage.name} needs {', '.join(stage.functions)}")
    return module


def _module_items(module) -> list[tuple[str, object]]:
    namespace = getattr(module, "__dict__", None)
    return list(namespace.items()) if isinstance(namespace, dict) else []


def swap_in(stage: Stage, learner: ModuleType) -> Undo:
    """Put the learner's functions where the real ones are; returns what `undo_swap` restores.

    A method is replaced on its class. A module-level function (or Triton kernel) is replaced
    in every loaded module that holds it, because `from minipaged.sampling import
    apply_top_k_top_p_min_p` in a test is a reference of its own: call this after the tests are
    imported. The learner's own module is left alone (it may keep the real function under
    another name to compare with).
    """
    undo = Undo()
    for target, function in zip(stage.real_targets, stage.functions):
        owner, attr, real = resolve(target)
        mine = getattr(learner, function)
        if isinstance(owner, type):
            holders = [(owner, attr)]
        else:
            holders = [(m, name) for m in list(sys.modules.values()) if m is not learner
                       for name, value in _module_items(m) if value is real]
        for holder, name in holders:
            undo.replaced.append((holder, name, vars(holder)[name]))
            setattr(holder, name, mine)
        undo.pairs.append((mine, real))
    return undo


def undo_swap(undo: Undo) -> None:
    for holder, name, value in reversed(undo.replaced):
        setattr(holder, name, value)
    real_of = {id(mine): real for mine, real in undo.pairs}
    for m in list(sys.modules.values()):  # modules imported while the swap was in place
        if not getattr(m, "__name__", "").startswith("minipaged_exercise_"):
            for name, value in _module_items(m):
                if id(value) in real_of:
                    setattr(m, name, real_of[id(value)])
    undo.replaced, undo.pairs = [], []


def is_written(function) -> bool:
    """False while the function is the skeleton's (its body still raises the exercise's
    NotImplementedError)."""
    try:
        source = inspect.getsource(unwrap(function))
    except (OSError, TypeError):
        return True
    return SKELETON_MARK not in source


def written_functions(stage: Stage, learner: ModuleType) -> list[str]:
    return [f for f in stage.functions if is_written(getattr(learner, f))]


def code_lines(function) -> int:
    """Lines of code in a function's body: no docstring, blank or comment-only lines, and not
    the skeleton's `raise NotImplementedError`."""
    source = textwrap.dedent(inspect.getsource(unwrap(function)))
    node = ast.parse(source).body[0]
    body = node.body
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]  # the docstring
    if not body:
        return 0
    lines = source.splitlines()[body[0].lineno - 1:node.end_lineno]
    return sum(1 for line in lines
               if line.strip() and not line.strip().startswith("#") and SKELETON_MARK not in line)


def solution_lines(stage: Stage) -> int:
    """What the learner writes in this stage, measured on the project's code."""
    return sum(code_lines(resolve(t)[2]) for t in stage.real_targets)


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def solution_source(stage: Stage) -> str:
    """The skeleton with every function to write replaced by the real one's source.

    That is the project's code in the learner's file: what `check --solution` grades and
    `minipaged exercise solution NAME` prints. Generated, so it never drifts from the code.
    """
    text = stage.skeleton_path.read_text()
    lines = text.splitlines(keepends=True)
    defs = {node.name: node for node in ast.parse(text).body if isinstance(node, ast.FunctionDef)}
    # Bottom up, so the line numbers of the functions above stay valid.
    for target, function in sorted(zip(stage.real_targets, stage.functions),
                                   key=lambda tf: -defs[tf[1]].lineno):
        node = defs[function]
        real = unwrap(resolve(target)[2])
        source, line = inspect.getsourcelines(real)
        where = Path(inspect.getsourcefile(real)).resolve().relative_to(REPO_ROOT)
        source = textwrap.dedent("".join(source))
        if real.__name__ != function:  # the learner's name for it (three `fork`s in one file)
            source = source.replace(f"def {real.__name__}(", f"def {function}(", 1)
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        lines[start:node.end_lineno] = [f"# the project's code, from {where}:{line}\n", source]
    return (f"# Solution of stage {stage.name!r}: the skeleton with the project's own "
            "code in it.\n" + "".join(lines))
