"""`minipaged exercise list | start | check | hint | status | solution | capstone`.

    minipaged exercise list                    the thirteen stages in lesson order
    minipaged exercise list block_manager      one stage: what it needs, its concepts, lessons
    minipaged exercise start                   lays out the workspace: exercises/<stage>.py each
    minipaged exercise start block_manager     just one stage's file
    minipaged exercise check block_manager     grades it: the project's tests with your code in
    minipaged exercise check block_manager --solution    the same with the project's own code
    minipaged exercise hint block_manager      the next of three hints (--level N: that one)
    minipaged exercise status                  stages done, graders passing, lines written
    minipaged exercise solution block_manager  prints the solution
    minipaged exercise capstone                your engine on stories260K, against Hugging Face
    minipaged exercise check scheduler -- -x --tb=long   anything after -- goes to pytest

`check` runs `python -m pytest -p minipaged.exercises.plugin` in a fresh process from the
repository root (the graders are the project's tests/, so it needs a clone of the project);
`capstone` runs capstone.py in a fresh process. `--dir` picks another workspace.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Optional, Sequence

from minipaged.exercises.grading import REPO_ROOT, solution_lines, solution_source
from minipaged.exercises.hints import HINTS
from minipaged.exercises.progress import (DEFAULT_WORKSPACE, load, next_hint_level, stage_file,
                                          stage_status)
from minipaged.exercises.stages import STAGES, Stage, get_stage


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """Rows under headers, every column as wide as its widest cell (the last one free)."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    lines = []
    for r in [headers, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(r, widths)] + [str(r[-1])]
        lines.append((indent + "  ".join(cells)).rstrip())
    return "\n".join(lines)


def functions_of(stage: Stage) -> str:
    """"Class.{a, b}, f (module.py, ...)": the real functions a stage replaces."""
    modules = sorted({t.split(":")[0].removeprefix("minipaged.").replace(".", "/") + ".py"
                      for t in stage.real_targets})
    by_owner: dict[str, list[str]] = {}
    for t in stage.real_targets:
        owner, _, name = t.split(":")[1].rpartition(".")
        by_owner.setdefault(owner, []).append(name)
    parts = [", ".join(names) if not owner else
             f"{owner}.{names[0]}" if len(names) == 1 else f"{owner}.{{{', '.join(names)}}}"
             for owner, names in by_owner.items()]
    return f"{', '.join(parts)} ({', '.join(modules)})"


def markdown_table() -> str:
    """The track as the README and the book show it (tests/test_exercises.py keeps them equal)."""
    rows = ["| # | stage | lesson | what you write | about |", "|---:|---|---|---|---:|"]
    for i, st in enumerate(STAGES, 1):
        names = functions_of(st).rsplit(" (", 1)[0]
        rows.append(f"| {i} | `{st.name}` | [{st.lesson_number}](notebooks/{st.lesson}.ipynb) | "
                    f"{st.title}: `{names}` | {st.minutes} min |")
    return "\n".join(rows)


def state_word(status) -> str:
    if status.done:
        return "done"
    if status.state == "written" and status.passed is not None and not status.stale:
        return f"written, {status.passed}/{status.total} pass"
    return status.state


def child_env() -> dict:
    """The environment of `check`'s and `capstone`'s fresh process: this very package first on
    the path (not another copy installed elsewhere), one OpenMP thread (the models are tiny)."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def describe(st: Stage, workspace: Path) -> str:
    """One stage in full: `minipaged exercise list NAME`."""
    i = STAGES.index(st) + 1
    status = stage_status(workspace, st)
    lines = [f"stage {i} of {len(STAGES)}, {st.name}: {st.title}",
             f"  lesson:      notebooks/{st.lesson}.ipynb (about {st.minutes} min)",
             f"  you write:   {functions_of(st)}",
             f"  it needs:    {st.needs}",
             f"  your file:   {stage_file(workspace, st)} ({state_word(status)})",
             f"  capstone:    {st.capstone}",
             f"  graded by {len(st.tests)} of the project's tests, on these concepts:"]
    for c in st.concepts:
        lines.append(f"    {c.name}\n      ({c.where()})")
    return "\n".join(lines)


def cmd_list(a) -> int:
    if a.markdown:
        print(markdown_table())
        return 0
    if a.name:
        try:
            print(describe(get_stage(a.name), a.dir))
        except KeyError as e:
            print(e.args[0], file=sys.stderr)
            return 2
        return 0
    rows = []
    for i, st in enumerate(STAGES, 1):
        rows.append((str(i), st.name, st.lesson_number, f"{st.minutes} min",
                     state_word(stage_status(a.dir, st)), st.title))
    print(table(("#", "stage", "lesson", "about", "status", "what you build"), rows))
    print("\nwhat each stage writes, in your workspace's <stage>.py:")
    print(table(("stage", "the project's functions it replaces"),
                [(st.name, functions_of(st)) for st in STAGES]))
    lines = sum(solution_lines(st) for st in STAGES)
    hours = sum(st.minutes for st in STAGES) / 60
    print(f"\n{len(STAGES)} stages, about {lines} lines of code and {hours:.0f} hours in all. "
          "`minipaged exercise start` lays out the workspace; `minipaged exercise check NAME` "
          "grades a stage; `minipaged exercise capstone` runs your engine.")
    return 0


WORKSPACE_README = """# Your engine, stage by stage

These files are yours: each holds the functions of one stage of minipaged's build track, to
write in lesson order. `minipaged exercise list` shows the stages, `minipaged exercise check
NAME` grades one with the project's own tests, `minipaged exercise hint NAME` helps, and
`minipaged exercise capstone` runs every stage you wrote together as one engine on
stories260K. `.progress.json` is what `minipaged exercise status` remembers.
"""


def cmd_start(a) -> int:
    try:
        stages = [get_stage(n) for n in a.names] if a.names else list(STAGES)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    if a.file and len(stages) != 1:
        print("--file needs exactly one stage name", file=sys.stderr)
        return 2
    written, kept = [], []
    for st in stages:
        path = Path(a.file) if a.file else stage_file(a.dir, st)
        if path.exists() and not a.force:
            kept.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(st.skeleton_path.read_text())
        written.append((st, path))
    readme = Path(a.dir) / "README.md"
    if not a.file and not readme.exists():
        readme.parent.mkdir(parents=True, exist_ok=True)
        readme.write_text(WORKSPACE_README)
    for st, path in written:
        print(f"wrote {path}: write {', '.join(st.functions)} "
              f"(notebooks/{st.lesson}.ipynb explains them)")
    for path in kept:
        print(f"kept {path}: it exists (your work?); --force overwrites it with the skeleton",
              file=sys.stderr)
    if written:
        st, path = written[0]
        print(f"then grade a stage with `minipaged exercise check {st.name}`"
              + (f" --file {path}" if a.file else ""))
    return 0 if written or not kept else 1


def grader_args(stage: Stage, path: Path, record: Optional[Path],
                pytest_args: Sequence[str] = ()) -> list[str]:
    """pytest's arguments for the stage's graders with the functions of `path` swapped in
    (`record`: the workspace whose record the result goes to, or None)."""
    args = ["-p", "minipaged.exercises.plugin", "--exercise", stage.name,
            "--exercise-file", str(Path(path).resolve())]
    if record is not None:
        args += ["--exercise-record", str(Path(record).resolve())]
    return args + ["-p", "no:cacheprovider", "-q", "--tb=short", *stage.tests, *pytest_args]


def run_graders(stage: Stage, path: Path, pytest_args: list[str],
                record: Optional[Path] = None) -> int:
    """The stage's tests in a fresh pytest process with the functions of `path` swapped in."""
    if not (REPO_ROOT / "tests").is_dir():
        print(f"the graders are the project's tests, and {REPO_ROOT / 'tests'} is missing: "
              "run from a clone of the project (pip install -e .)", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "pytest", *grader_args(stage, path, record, pytest_args)]
    return subprocess.call(cmd, cwd=REPO_ROOT, env=child_env())


def cmd_check(a) -> int:
    st = get_stage(a.name)
    if a.solution:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{st.name}_solution.py"
            path.write_text(solution_source(st))
            return run_graders(st, path, a.pytest_args)
    path = Path(a.file) if a.file else stage_file(a.dir, st)
    if not path.is_file():
        print(f"{path} does not exist: `minipaged exercise start {st.name}` creates it",
              file=sys.stderr)
        return 2
    return run_graders(st, path, a.pytest_args, record=None if a.file else Path(a.dir))


def cmd_hint(a) -> int:
    st = get_stage(a.name)
    hints = HINTS[st.name]
    level = a.level if a.level else next_hint_level(a.dir, st, len(hints))
    if not 1 <= level <= len(hints):
        print(f"--level must be 1 to {len(hints)}, got {level}", file=sys.stderr)
        return 2
    print(f"hint {level} of {len(hints)} for stage {st.name} "
          f"({', '.join(st.functions)}):\n")
    print("\n".join(textwrap.fill(part, 96) for part in hints[level - 1].split("\n")))
    if level < len(hints):
        print(f"\n(`minipaged exercise hint {st.name}` again gives hint {level + 1})")
    else:
        where = "\n".join(f"  {w}" for w in dict.fromkeys(c.where() for c in st.concepts))
        print(f"\nThat was the last hint. The lessons explain it in\n{where}\n"
              f"and `minipaged exercise solution {st.name}` prints the project's code.")
    return 0


def cmd_status(a) -> int:
    record = load(a.dir)
    rows, done, passed, total, lines = [], 0, 0, 0, 0
    for i, st in enumerate(STAGES, 1):
        s = stage_status(a.dir, st, record)
        graders = "-" if s.passed is None else f"{s.passed}/{s.total}" + (
            " (file changed since)" if s.stale else "")
        rows.append((str(i), st.name, s.state, f"{s.num_written}/{len(st.functions)}",
                     str(s.lines), graders, "yes" if s.done else ""))
        done += s.done
        lines += s.lines
        if s.passed is not None and not s.stale:
            passed, total = passed + s.passed, total + s.total
    print(table(("#", "stage", "file", "functions", "lines", "graders passing", "done"), rows))
    print(f"\nstages done: {done} of {len(STAGES)}; graders passing at the last checks: "
          f"{passed} of {total}; lines written: {lines} (the solutions have about "
          f"{sum(solution_lines(st) for st in STAGES)})")
    todo = next((st for st in STAGES if not stage_status(a.dir, st, record).done), None)
    if todo is None:
        print("every stage is done: `minipaged exercise capstone` runs your engine")
    else:
        print(f"next: stage {todo.name} (lesson {todo.lesson_number}): "
              f"`minipaged exercise check {todo.name}`")
    return 0


def cmd_solution(a) -> int:
    print(solution_source(get_stage(a.name)), end="")
    return 0


def cmd_capstone(a) -> int:
    cmd = [sys.executable, "-m", "minipaged.exercises.capstone", "--dir", str(a.dir),
           "--out", str(a.out or Path(a.dir) / "capstone")]
    return subprocess.call(cmd, env=child_env())


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="minipaged exercise", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    names = [st.name for st in STAGES]

    def add(name: str, what: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=what)
        p.add_argument("--dir", type=Path, default=DEFAULT_WORKSPACE,
                       help="the workspace (default: exercises/)")
        return p

    ls = add("list", "the stages in lesson order, what each asks")
    ls.add_argument("name", nargs="?", metavar="NAME", help="one stage in full")
    ls.add_argument("--markdown", action="store_true", help="as the table of README.md")
    s = add("start", "lay out the workspace: the skeleton of every stage (or of NAME ...)")
    s.add_argument("names", nargs="*", metavar="NAME", help="stages (default: all of them)")
    s.add_argument("--file", help="write the one stage's skeleton here instead")
    s.add_argument("--force", action="store_true", help="overwrite existing files")
    c = add("check", "run the project's tests with your functions swapped in")
    c.add_argument("name", choices=names)
    c.add_argument("--file", help="your file (default: <workspace>/NAME.py)")
    c.add_argument("--solution", action="store_true", help="grade the project's own code")
    h = add("hint", "the next of three hints for a stage")
    h.add_argument("name", choices=names)
    h.add_argument("--level", type=int, help="show this hint (1-3) instead of the next")
    add("status", "stages done, graders passing, lines written")
    o = add("solution", "print the solution (the project's own code)")
    o.add_argument("name", choices=names)
    k = add("capstone", "run your whole engine on stories260K against Hugging Face")
    k.add_argument("--out", type=Path, help="where the report and figures go "
                                            "(default: <workspace>/capstone)")
    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything after `--` goes to pytest untouched (argparse would read it as our options).
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.pytest_args = argv[cut + 1:]
    return {"list": cmd_list, "start": cmd_start, "check": cmd_check, "hint": cmd_hint,
            "status": cmd_status, "solution": cmd_solution, "capstone": cmd_capstone}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
