"""The build-it exercises (minipaged/exercises, lessons 02-06, 10 and 13) and their graders.

For every exercise: the skeleton has the real signatures and docstrings; `minipaged exercise
check` fails every grader on the untouched skeleton, passes every grader on the solution (the
project's own code in the skeleton), and catches a one-line bug in the solution. The checks run
the real command in a fresh process, as a learner would, and read pytest's JUnit report.
Then, in-process: the swap reaches every reference and is undone, a broken learner file is
explained, `start` keeps a learner's work.
"""
from __future__ import annotations

import inspect
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

from minipaged.cli import main as minipaged_main
from minipaged.engine.block_manager import BlockManager
from minipaged.exercises import EXERCISES, get_exercise
from minipaged.exercises.grading import (ExerciseFileError, load_learner_module, resolve,
                                         solution_source, swap_in, undo_swap)
from minipaged.sampling import apply_top_k_top_p_min_p  # noqa: F401 (swap_in must reach it)

NAMES = [ex.name for ex in EXERCISES]

# One realistic bug per exercise, as (line of the solution, the buggy line): the graders must
# notice. The assertion on the count keeps this honest when the real code changes.
BUGS = {
    "block_manager": ("ref_count > 1", "ref_count > 2"),  # copy-on-write only if 3 share a block
    "scheduler": ("for seq in decodes + chunks:", "for seq in chunks + decodes:"),
    "top_k_top_p": ("(mass_before >= top_p[:, None])", "(mass_before > top_p[:, None])"),
    "online_softmax": ("acc = acc * alpha[..., None] + p @ v", "acc = acc + p @ v"),
    "rejection_sampler": ("accept &= valid", "accept &= True"),  # padding counts as a guess
    "priority": ("self.running[-1].priority <= seq.priority",  # equals preempt each other
                 "self.running[-1].priority < seq.priority"),
}


def check(name: str, tmp_path: Path, *args: str, pytest_args: tuple[str, ...] = ()
          ) -> tuple[int, dict[str, str], str]:
    """`minipaged exercise check NAME ARGS` in a fresh process: (exit code, outcome of each
    test, output)."""
    report = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}.xml"
    cmd = [sys.executable, "-m", "minipaged.cli", "exercise", "check", name, *args,
           "--", f"--junitxml={report}", *pytest_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    outcomes = {}
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            kinds = {child.tag for child in case} & {"failure", "error", "skipped"}
            test = f"{case.get('classname')}.{case.get('name')}"
            outcomes[test] = kinds.pop() if kinds else "passed"
    return proc.returncode, outcomes, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", NAMES)
def test_skeleton_has_the_real_signatures_and_docstrings(name):
    ex = get_exercise(name)
    skeleton = load_learner_module(ex, ex.skeleton_path)
    for target, function in zip(ex.targets, ex.functions):
        real, mine = resolve(target)[2], getattr(skeleton, function)
        assert inspect.signature(mine) == inspect.signature(real), target
        assert inspect.getdoc(real) in inspect.getdoc(mine), f"{target}: docstring differs"
        assert "raise NotImplementedError(\"exercise: " in inspect.getsource(mine)


@pytest.mark.parametrize("name", NAMES)
def test_graders_fail_on_the_skeleton_and_pass_on_the_solution(name, tmp_path):
    ex = get_exercise(name)
    rc, on_skeleton, out = check(name, tmp_path, "--file", str(ex.skeleton_path))
    assert rc == 1 and on_skeleton, out[-3000:]
    passing = [t for t, outcome in on_skeleton.items() if outcome != "failure"]
    assert not passing, f"graders that do not fail on the skeleton grade nothing: {passing}"
    assert "NotImplementedError: exercise: " in out

    rc, on_solution, out = check(name, tmp_path, "--solution")
    assert rc == 0, out[-3000:]
    assert set(on_solution) == set(on_skeleton)
    assert set(on_solution.values()) == {"passed"}, on_solution  # a skipped grader grades nothing
    assert f"all {len(on_solution)} graders pass" in out


@pytest.mark.parametrize("name", NAMES)
def test_graders_catch_a_one_line_bug(name, tmp_path):
    right, wrong = BUGS[name]
    source = solution_source(get_exercise(name))
    assert source.count(right) == 1
    buggy = tmp_path / f"{name}.py"
    buggy.write_text(source.replace(right, wrong))
    rc, outcomes, out = check(name, tmp_path, "--file", str(buggy), pytest_args=("-x",))
    assert rc == 1 and "failure" in outcomes.values(), out[-3000:]


def test_swap_reaches_every_reference_and_is_undone():
    """A module function is replaced in every module holding it (this test module imported it
    by name), a method on its class; undo puts the originals back."""
    import minipaged.sampling
    import minipaged.sampling.sampler

    real = minipaged.sampling.sampler.apply_top_k_top_p_min_p
    learner = ModuleType("learner")
    learner.apply_top_k_top_p_min_p = lambda *a: "learner's"
    undo = swap_in(get_exercise("top_k_top_p"), learner)
    try:
        assert minipaged.sampling.sampler.apply_top_k_top_p_min_p is learner.apply_top_k_top_p_min_p
        assert minipaged.sampling.apply_top_k_top_p_min_p is learner.apply_top_k_top_p_min_p
        assert globals()["apply_top_k_top_p_min_p"] is learner.apply_top_k_top_p_min_p
    finally:
        undo_swap(undo)
    assert minipaged.sampling.sampler.apply_top_k_top_p_min_p is real
    assert minipaged.sampling.apply_top_k_top_p_min_p is real
    assert globals()["apply_top_k_top_p_min_p"] is real

    ex = get_exercise("block_manager")
    real = {f: vars(BlockManager)[f] for f in ex.functions}
    skeleton = load_learner_module(ex, ex.skeleton_path)
    undo = swap_in(ex, skeleton)
    try:
        with pytest.raises(NotImplementedError, match="exercise: write BlockManager.fork"):
            BlockManager(4, 4).fork(None, None)
    finally:
        undo_swap(undo)
    assert {f: vars(BlockManager)[f] for f in ex.functions} == real


def test_a_broken_learner_file_is_explained(tmp_path):
    ex = get_exercise("scheduler")
    with pytest.raises(ExerciseFileError, match="does not exist.*exercise start scheduler"):
        load_learner_module(ex, tmp_path / "nope.py")
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ExerciseFileError, match="defines no _schedule_running"):
        load_learner_module(ex, tmp_path / "empty.py")
    (tmp_path / "typo.py").write_text("def _schedule_running(self, out, budget)\n")
    with pytest.raises(ExerciseFileError, match="importing .*typo.py failed: SyntaxError"):
        load_learner_module(ex, tmp_path / "typo.py")
    assert "minipaged_exercise_scheduler" not in sys.modules


def test_start_writes_the_skeleton_and_keeps_a_learners_work(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ex = get_exercise("online_softmax")
    assert minipaged_main(["exercise", "check", ex.name]) == 2  # not started yet
    assert "exercise start online_softmax" in capsys.readouterr().err
    assert minipaged_main(["exercise", "start", ex.name]) == 0
    mine = tmp_path / "exercises" / "online_softmax.py"
    assert mine.read_text() == ex.skeleton_path.read_text()
    mine.write_text("# my work\n")
    assert minipaged_main(["exercise", "start", ex.name]) == 1
    assert mine.read_text() == "# my work\n"
    assert minipaged_main(["exercise", "start", ex.name, "--force"]) == 0
    assert mine.read_text() == ex.skeleton_path.read_text()
    capsys.readouterr()
    assert minipaged_main(["exercise", "list"]) == 0
    listing = capsys.readouterr().out
    assert all(n in listing for n in NAMES) and "exercises/online_softmax.py (started)" in listing


def test_solution_is_the_project_code_in_the_skeleton():
    for ex in EXERCISES:
        source = solution_source(ex)
        compile(source, f"{ex.name}_solution.py", "exec")
        assert "NotImplementedError" not in source
        for target in ex.targets:
            assert inspect.getsource(resolve(target)[2]).strip().splitlines()[-1].strip() in source
