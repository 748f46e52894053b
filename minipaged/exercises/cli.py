"""`minipaged exercise list | start NAME | check NAME [--file F] [--solution] | solution NAME`.

    minipaged exercise list                  what there is to build, which lessons explain it
    minipaged exercise start block_manager   writes exercises/block_manager.py from the skeleton
    minipaged exercise check block_manager   grades it: the project's tests with your code in
    minipaged exercise check block_manager --solution    the same with the project's own code
    minipaged exercise solution block_manager            prints the solution
    minipaged exercise check scheduler -- -x --tb=long   anything after -- goes to pytest

`check` runs `python -m pytest -p minipaged.exercises.plugin` in a fresh process from the
repository root (the graders are the project's tests/, so it needs a clone of the project).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from minipaged.exercises import EXERCISES, Exercise, get_exercise
from minipaged.exercises.grading import REPO_ROOT, solution_source


def default_file(exercise: Exercise) -> Path:
    return Path("exercises") / f"{exercise.name}.py"


def cmd_list(_a) -> int:
    for ex in EXERCISES:
        modules = sorted({t.split(":")[0].replace(".", "/") + ".py" for t in ex.targets})
        qualnames = [t.split(":")[1] for t in ex.targets]
        status = "started" if default_file(ex).is_file() else "not started"
        numbers = ", ".join(n[:2] for n in ex.lessons)
        lessons = f"lesson{'s' if len(ex.lessons) > 1 else ''} {numbers}"
        print(f"{ex.name:15s} {lessons}: {ex.summary}\n"
              f"{'':15s} write {', '.join(qualnames)} of {', '.join(modules)}\n"
              f"{'':15s} in {default_file(ex)} ({status})\n")
    print("start one with `minipaged exercise start NAME`, grade it with "
          "`minipaged exercise check NAME`")
    return 0


def cmd_start(a) -> int:
    ex = get_exercise(a.name)
    path = Path(a.file) if a.file else default_file(ex)
    if path.exists() and not a.force:
        print(f"{path} already exists (your work?); --force overwrites it with the skeleton",
              file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(ex.skeleton_path.read_text())
    print(f"wrote {path}: write {', '.join(ex.functions)} "
          f"(notebooks/{ex.lessons[0]}.ipynb explains them), then run\n"
          f"    minipaged exercise check {ex.name}" + (f" --file {path}" if a.file else ""))
    return 0


def run_graders(ex: Exercise, path: Path, pytest_args: list[str]) -> int:
    """The exercise's tests in a fresh pytest process with the functions of `path` swapped in."""
    if not (REPO_ROOT / "tests").is_dir():
        print(f"the graders are the project's tests, and {REPO_ROOT / 'tests'} is missing: "
              "run from a clone of the project (pip install -e .)", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "pytest", "-p", "minipaged.exercises.plugin",
           "--exercise", ex.name, "--exercise-file", str(path.resolve()),
           "-p", "no:cacheprovider", "-q", "--tb=short", *ex.tests, *pytest_args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # the test models are tiny (tests/conftest.py)
    return subprocess.call(cmd, cwd=REPO_ROOT, env=env)


def cmd_check(a) -> int:
    ex = get_exercise(a.name)
    pytest_args = a.pytest_args
    if a.solution:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{ex.name}_solution.py"
            path.write_text(solution_source(ex))
            return run_graders(ex, path, pytest_args)
    path = Path(a.file) if a.file else default_file(ex)
    if not path.is_file():
        print(f"{path} does not exist: `minipaged exercise start {ex.name}` creates it",
              file=sys.stderr)
        return 2
    return run_graders(ex, path, pytest_args)


def cmd_solution(a) -> int:
    print(solution_source(get_exercise(a.name)), end="")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="minipaged exercise", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    names = [ex.name for ex in EXERCISES]
    sub.add_parser("list", help="the exercises, their lessons and what to write")
    s = sub.add_parser("start", help="write the skeleton to exercises/NAME.py")
    s.add_argument("name", choices=names)
    s.add_argument("--file", help="write it here instead")
    s.add_argument("--force", action="store_true", help="overwrite an existing file")
    c = sub.add_parser("check", help="run the project's tests with your functions swapped in")
    c.add_argument("name", choices=names)
    c.add_argument("--file", help="your file (default: exercises/NAME.py)")
    c.add_argument("--solution", action="store_true", help="grade the project's own code")
    o = sub.add_parser("solution", help="print the solution (the project's own code)")
    o.add_argument("name", choices=names)
    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything after `--` goes to pytest untouched (argparse would read it as our options).
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.pytest_args = argv[cut + 1:]
    return {"list": cmd_list, "start": cmd_start, "check": cmd_check,
            "solution": cmd_solution}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
