"""The pytest plugin behind `minipaged exercise check`: the project's tests, the learner's code.

    python -m pytest -p minipaged.exercises.plugin --exercise NAME --exercise-file F TESTS...

When pytest starts, the learner's file F is imported (a broken file stops the run with a clear
message); once the tests are collected, its functions replace the real ones (grading.swap_in)
until pytest exits. Every failing grader's report gets a section naming the concept it checks
and the lesson section that explains it, and at the end a summary says how many graders pass,
concept by concept; `--exercise-record` writes that to the workspace's record (progress.py).
Without `--exercise` the plugin does nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

from minipaged.exercises.grading import (ExerciseFileError, Undo, load_learner_module, swap_in,
                                         undo_swap)
from minipaged.exercises.stages import Concept, Stage, get_stage


@dataclass
class _Grading:
    stage: Stage
    path: Path
    learner: ModuleType
    record: Path | None
    undo: Undo = field(default_factory=Undo)


_GRADING = pytest.StashKey[_Grading]()


def pytest_addoption(parser):
    group = parser.getgroup("minipaged exercise")
    group.addoption("--exercise", default=None, metavar="NAME",
                    help="grade this stage (minipaged/exercises): swap in --exercise-file")
    group.addoption("--exercise-file", default=None, metavar="PATH",
                    help="the learner's file (default: exercises/NAME.py)")
    group.addoption("--exercise-record", default=None, metavar="WORKSPACE",
                    help="record the result in WORKSPACE/.progress.json")


def pytest_configure(config):
    name = config.getoption("exercise")
    if not name:
        return
    try:
        stage = get_stage(name)
    except KeyError as e:
        raise pytest.UsageError(e.args[0]) from None
    path = Path(config.getoption("exercise_file") or f"exercises/{name}.py")
    try:
        learner = load_learner_module(stage, path)
    except ExerciseFileError as e:
        raise pytest.UsageError(str(e)) from None
    record = config.getoption("exercise_record")
    config.stash[_GRADING] = _Grading(stage, path, learner, Path(record) if record else None)


def pytest_collection_finish(session):
    grading = session.config.stash.get(_GRADING, None)
    if grading is not None:
        grading.undo = swap_in(grading.stage, grading.learner)


def pytest_unconfigure(config):
    grading = config.stash.get(_GRADING, None)
    if grading is not None:
        undo_swap(grading.undo)


def explain(concept: Concept) -> str:
    return f"this grader checks: {concept.name}\nexplained in {concept.where()}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    grading = item.config.stash.get(_GRADING, None)
    report = outcome.get_result()
    if grading is not None and report.failed:
        try:
            concept = grading.stage.concept_of(item.nodeid)
        except KeyError:
            return
        report.sections.append((f"stage {grading.stage.name}", explain(concept)))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    grading = config.stash.get(_GRADING, None)
    if grading is None:
        return
    stats = terminalreporter.stats
    passed = {r.nodeid for r in stats.get("passed", []) if r.when == "call"}
    failing = {r.nodeid for key in ("failed", "error") for r in stats.get(key, [])}
    skipped = {r.nodeid for r in stats.get("skipped", [])}
    total = len(passed | failing | skipped)
    st = grading.stage
    tw = terminalreporter
    tw.section(f"stage {st.name}: {grading.path}")
    bad_concepts: dict[str, list[str]] = {}
    for nodeid in sorted(failing | skipped):
        try:
            concept = st.concept_of(nodeid)
        except KeyError:
            continue
        bad_concepts.setdefault(concept.name, []).append(nodeid.split("::")[-1])
    if total and len(passed) == total:
        tw.write_line(f"all {total} graders pass: your {', '.join(st.functions)} run the "
                      "project's tests like the real code", green=True, bold=True)
    else:
        tw.write_line(f"{len(passed)} of {total} graders pass ({len(failing)} failing)",
                      red=True, bold=True)
        if skipped:
            tw.write_line(f"  {len(skipped)} skipped: a skipped grader grades nothing")
        for concept in st.concepts:
            if concept.name in bad_concepts:
                tests = bad_concepts[concept.name]
                tw.write_line(f"  not yet: {concept.name}\n    reread {concept.where()}\n"
                              f"    failing: {', '.join(tests[:4])}"
                              + (f" and {len(tests) - 4} more" if len(tests) > 4 else ""))
        tw.write_line(f"  stuck? `minipaged exercise hint {st.name}` gives the next hint")
    if grading.record is not None and total:
        from minipaged.exercises.progress import record_check
        record_check(grading.record, st, grading.path, len(passed), total,
                     [c.name for c in st.concepts if c.name in bad_concepts])
