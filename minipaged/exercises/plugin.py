"""The pytest plugin behind `minipaged exercise check`: the project's tests, the learner's code.

    python -m pytest -p minipaged.exercises.plugin --exercise NAME --exercise-file F TESTS...

When pytest starts, the learner's file F is imported (a broken file stops the run with a clear
message); once the tests are collected, its functions replace the real ones (grading.swap_in)
until pytest exits; at the end a short summary says how many of the graders pass. Without
`--exercise` the plugin does nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

from minipaged.exercises import Exercise, get_exercise
from minipaged.exercises.grading import (ExerciseFileError, Undo, load_learner_module, swap_in,
                                         undo_swap)


@dataclass
class _Grading:
    exercise: Exercise
    path: Path
    learner: ModuleType
    undo: Undo = field(default_factory=list)


_GRADING = pytest.StashKey[_Grading]()


def pytest_addoption(parser):
    group = parser.getgroup("minipaged exercise")
    group.addoption("--exercise", default=None, metavar="NAME",
                    help="grade this exercise (minipaged/exercises): swap in --exercise-file")
    group.addoption("--exercise-file", default=None, metavar="PATH",
                    help="the learner's file (default: exercises/NAME.py)")


def pytest_configure(config):
    name = config.getoption("exercise")
    if not name:
        return
    try:
        exercise = get_exercise(name)
    except KeyError as e:
        raise pytest.UsageError(e.args[0]) from None
    path = Path(config.getoption("exercise_file") or f"exercises/{name}.py")
    try:
        learner = load_learner_module(exercise, path)
    except ExerciseFileError as e:
        raise pytest.UsageError(str(e)) from None
    config.stash[_GRADING] = _Grading(exercise, path, learner)


def pytest_collection_finish(session):
    grading = session.config.stash.get(_GRADING, None)
    if grading is not None:
        grading.undo = swap_in(grading.exercise, grading.learner)


def pytest_unconfigure(config):
    grading = config.stash.get(_GRADING, None)
    if grading is not None:
        undo_swap(grading.undo)
        grading.undo = []


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    grading = config.stash.get(_GRADING, None)
    if grading is None:
        return
    stats = terminalreporter.stats
    passed = len([r for r in stats.get("passed", []) if r.when == "call"])
    failing = {r.nodeid for key in ("failed", "error") for r in stats.get(key, [])}
    skipped = len(stats.get("skipped", []))
    total = passed + len(failing) + skipped
    ex = grading.exercise
    tw = terminalreporter
    tw.section(f"exercise {ex.name}: {grading.path}")
    if total and passed == total:
        tw.write_line(f"all {total} graders pass: your {', '.join(ex.functions)} run the "
                      "project's tests like the real code", green=True, bold=True)
        return
    tw.write_line(f"{passed} of {total} graders pass ({len(failing)} failing)", red=True, bold=True)
    if skipped:
        tw.write_line(f"  {skipped} skipped: a skipped grader grades nothing")
    tw.write_line(f"  lessons {', '.join(ex.lessons)} explain {', '.join(ex.functions)}")
