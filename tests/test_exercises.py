"""The build track (minipaged/exercises): its stages, their graders, and the capstone.

For every stage: the skeleton has the real signatures and docstrings; the graders fail on the
untouched skeleton, every failure naming its concept and lesson section; they pass on the
solution (the project's own code in the skeleton) and catch a one-line bug in it. Those runs use
exactly the arguments of `minipaged exercise check` (tests/grade_stage.py, one process per
stage); `check` itself runs once, as a learner would. The capstone runs the whole engine with
every solution (token-exact with HF), with the skeletons (zero stages, no traceback), and with
half of each (its report and figures). Then, in-process: the list in lesson order, the hints,
the status, the swap and its undo, a broken learner file explained, `start` keeping a learner's
work.
"""
from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

from minipaged.cli import main as minipaged_main
from minipaged.engine.block_manager import BlockManager
from minipaged.exercises import STAGES, get_stage
from minipaged.exercises.capstone import (Check, Workspace, read_workspace, run_check,
                                          swap_workspace)
from minipaged.exercises.cli import child_env, markdown_table
from minipaged.exercises.grading import (ExerciseFileError, is_written, load_learner_module,
                                         resolve, solution_lines, solution_source, swap_in,
                                         undo_swap, unwrap)
from minipaged.exercises.hints import HINTS
from minipaged.exercises.progress import record_check
from minipaged.sampling import apply_top_k_top_p_min_p  # noqa: F401 (swap_in must reach it)

ROOT = Path(__file__).resolve().parent.parent
NAMES = [st.name for st in STAGES]

# One realistic bug per stage, as (line of the solution, the buggy line): the graders must
# notice. The assertion on the count keeps this honest when the real code changes.
BUGS = {
    "block_allocator": ("block_id, _ = self.free_queue.popitem(last=False)",
                        "block_id, _ = self.free_queue.popitem(last=True)"),  # evicts the MRU
    "block_manager": ("ref_count > 1", "ref_count > 2"),  # copy-on-write only if 3 share a block
    "prepare_inputs": ("context_lens.append(start + n)", "context_lens.append(n)"),  # no prefix
    "step_loop": ("n_out >= p.max_tokens", "n_out > p.max_tokens"),  # one token too many
    "admission": ("n = seq.num_tokens - num_cached", "n = seq.num_tokens"),  # recomputes hits
    "scheduler": ("for seq in decodes + chunks:", "for seq in chunks + decodes:"),
    "sampler": ("(mass_before >= top_p[:, None])", "(mass_before > top_p[:, None])"),
    "online_softmax": ("acc = acc * alpha[..., None] + p @ v", "acc = acc + p @ v"),
    "triton_attention": ("acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot("),
    "fork": ("table = list(self.block_tables[parent.seq_id])",  # the child edits its parent's
             "table = self.block_tables[parent.seq_id]"),
    "beam_search": ("gen_len = beams[0].num_output_tokens + 1",  # the EOS not counted
                    "gen_len = beams[0].num_output_tokens"),
    "rejection_sampler": ("accept &= valid", "accept &= True"),  # padding counts as a guess
    "priority": ("self.running[-1].priority <= seq.priority",  # equals preempt each other
                 "self.running[-1].priority < seq.priority"),
}


def outcomes_of(report: Path) -> dict[str, str]:
    """JUnit XML -> {test name (with its parameters): passed | failure | error | skipped}."""
    out = {}
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            kinds = {child.tag for child in case} & {"failure", "error", "skipped"}
            out[f"{case.get('classname')}.{case.get('name')}"] = kinds.pop() if kinds else "passed"
    return out


def test_stages_follow_the_lessons_and_the_track_is_the_size_promised():
    assert len(STAGES) >= 12 and len(set(NAMES)) == len(NAMES)
    lessons = [st.lesson for st in STAGES]
    assert lessons == sorted(lessons), "stages must come in lesson order"
    assert sum(solution_lines(st) for st in STAGES) >= 600
    assert {st.lesson_number for st in STAGES} >= {"02", "02b", "03", "04", "05", "06", "10"}


@pytest.mark.parametrize("name", NAMES)
def test_skeleton_has_the_real_signatures_and_docstrings(name):
    st = get_stage(name)
    skeleton = load_learner_module(st, st.skeleton_path)
    for target, function in zip(st.real_targets, st.functions):
        real, mine = unwrap(resolve(target)[2]), unwrap(getattr(skeleton, function))
        assert inspect.signature(mine) == inspect.signature(real), target
        doc = inspect.getdoc(real)
        assert doc is None or doc in (inspect.getdoc(mine) or ""), f"{target}: docstring differs"
        assert not is_written(getattr(skeleton, function))
    assert f"minipaged exercise check {name}" in skeleton.__doc__
    assert f"Stage {NAMES.index(name) + 1}, `{name}`" in skeleton.__doc__


def test_every_concept_points_at_a_section_of_its_lesson():
    for st in STAGES:
        assert st.concepts and st.tests
        for concept in st.concepts:
            nb = json.loads((ROOT / "notebooks" / f"{concept.lesson}.ipynb").read_text())
            headings = {line.lstrip("#").strip() for c in nb["cells"] if c["cell_type"] == "markdown"
                        for line in "".join(c["source"]).splitlines() if line.startswith("#")}
            assert concept.section in headings, (st.name, concept.lesson, concept.section)


@pytest.mark.parametrize("name", NAMES)
def test_graders_fail_on_the_skeleton_pass_on_the_solution_and_catch_a_bug(name, tmp_path):
    st = get_stage(name)
    right, wrong = BUGS[name]
    solution = solution_source(st)
    assert solution.count(right) == 1
    (tmp_path / "solution.py").write_text(solution)
    (tmp_path / "bug.py").write_text(solution.replace(right, wrong))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.grade_stage", name, str(tmp_path),
         f"skeleton={st.skeleton_path}", f"solution={tmp_path / 'solution.py'}",
         f"bug={tmp_path / 'bug.py'}:-x"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rc = {label: int((tmp_path / f"{label}.rc").read_text())
          for label in ("skeleton", "solution", "bug")}
    out = {label: (tmp_path / f"{label}.txt").read_text() for label in rc}
    on_skeleton = outcomes_of(tmp_path / "skeleton.xml")
    assert rc["skeleton"] == 1 and on_skeleton, out["skeleton"][-3000:]
    passing = [t for t, outcome in on_skeleton.items() if outcome != "failure"]
    assert not passing, f"graders that do not fail on the skeleton grade nothing: {passing}"
    assert "NotImplementedError: exercise: " in out["skeleton"]
    for concept in st.concepts:  # each failure names what it checks and where to reread it
        assert f"this grader checks: {concept.name}" in out["skeleton"], concept.name
        assert f"explained in {concept.where()}" in out["skeleton"]
        assert f"not yet: {concept.name}" in out["skeleton"]

    on_solution = outcomes_of(tmp_path / "solution.xml")
    assert rc["solution"] == 0, out["solution"][-3000:]
    assert set(on_solution) == set(on_skeleton)
    assert set(on_solution.values()) == {"passed"}, on_solution  # a skipped grader grades nothing
    assert f"all {len(on_solution)} graders pass" in out["solution"]

    assert rc["bug"] == 1 and "failure" in outcomes_of(tmp_path / "bug.xml").values(), \
        out["bug"][-3000:]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`minipaged exercise ARGS` in a fresh process in `cwd`, with this clone's package."""
    return subprocess.run([sys.executable, "-m", "minipaged.cli", "exercise", *args], cwd=cwd,
                          env=child_env(), capture_output=True, text=True, timeout=600)


def test_check_grades_the_workspace_file_and_status_counts_it(tmp_path):
    """The real commands, as a learner runs them: start, check (fails), write, check (passes),
    status."""
    assert cli("start", "online_softmax", cwd=tmp_path).returncode == 0
    failed = cli("check", "online_softmax", cwd=tmp_path)
    total = int(re.search(r"0 of (\d+) graders pass", failed.stdout).group(1))
    assert failed.returncode == 1 and total >= len(get_stage("online_softmax").tests)
    assert "reread lesson 05, section \"2. The block-table walk\"" in failed.stdout
    st = get_stage("online_softmax")
    (tmp_path / "exercises" / "online_softmax.py").write_text(solution_source(st))
    passed = cli("check", "online_softmax", cwd=tmp_path)
    assert passed.returncode == 0 and f"all {total} graders pass" in passed.stdout
    status = cli("status", cwd=tmp_path).stdout
    assert f"stages done: 1 of {len(STAGES)}" in status
    assert f"lines written: {solution_lines(st)} " in status
    row = next(line for line in status.splitlines() if " online_softmax " in line)
    assert row.split()[2:] == ["written", "1/1", str(solution_lines(st)), f"{total}/{total}",
                               "yes"]


def run_capstone(workspace: Path) -> tuple[subprocess.CompletedProcess, dict]:
    proc = cli("capstone", "--dir", str(workspace), cwd=workspace.parent)
    report = workspace / "capstone" / "report.json"
    return proc, json.loads(report.read_text()) if report.exists() else {}


def solutions_in(workspace: Path, names) -> None:
    workspace.mkdir(parents=True, exist_ok=True)
    for name in names:
        (workspace / f"{name}.py").write_text(solution_source(get_stage(name)))


def test_capstone_with_every_solution_is_token_exact_with_hf(tmp_path):
    ws = tmp_path / "exercises"
    solutions_in(ws, NAMES)
    proc, report = run_capstone(ws)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["yours"] == NAMES and report["passed"]
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {"greedy parity", "seeded sampling", "beam search", "speculation",
                           "priorities", "Triton kernels"}
    assert all(c["passed"] and c["error"] is None for c in checks.values())
    assert checks["greedy parity"]["detail"].startswith("27 of 27 sequences token-exact")
    assert report["story"].startswith("Once upon a time, there was a little girl named Lily.")
    assert report["trace"]["preemptions"] > 0
    assert f"your engine: {len(NAMES)} of {len(NAMES)} stages are yours" in proc.stdout


def test_capstone_with_the_skeletons_reports_zero_stages_without_a_traceback(tmp_path):
    assert cli("start", cwd=tmp_path).returncode == 0  # every stage's skeleton
    proc, report = run_capstone(tmp_path / "exercises")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert f"your engine: 0 of {len(NAMES)} stages are yours" in proc.stdout
    assert report["yours"] == [] and report["passed"]
    assert all(state == "reference (0 of {} functions written)".format(len(st.functions))
               for st, state in zip(STAGES, report["stages"].values()))


def test_capstone_with_half_the_stages_reports_them_and_draws_their_trace(tmp_path):
    import matplotlib.image as mpimg
    ws = tmp_path / "exercises"
    mine = NAMES[1::2]  # every other stage: the rest is the reference's
    solutions_in(ws, mine)
    started = "beam_search"  # half written (beam_step, not step): the reference runs it
    st = get_stage(started)
    skeleton = st.skeleton_path.read_text()
    real = inspect.getsource(resolve(st.real_targets[1])[2])
    (ws / f"{started}.py").write_text(skeleton[:skeleton.index("def beam_step(")] + real)
    proc, report = run_capstone(ws)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["yours"] == mine and report["passed"]
    assert report["stages"][started] == "reference (1 of 2 functions written)"
    assert all(report["stages"][n] == "reference (not started)"
               for n in NAMES if n not in mine and n != started)
    assert f"your engine: {len(mine)} of {len(NAMES)} stages are yours ({', '.join(mine)})" \
        in proc.stdout
    checks = {c["name"]: c for c in report["checks"]}
    assert ("Triton kernels" in checks) == ("triton_attention" in mine)
    assert ("priorities" in checks) == ("priority" in mine)
    trace = report["trace"]
    figures = report["figures"]
    tables = mpimg.imread(figures["block_tables"]["path"])
    gantt = mpimg.imread(figures["batch_composition"]["path"])
    assert tables.shape[0] > 100 and gantt.shape[0] > 100
    assert figures["batch_composition"]["steps"] == trace["steps"] > 24
    assert figures["block_tables"]["sequences"] >= 2
    assert "from your engine's trace: " + ", ".join(f["path"] for f in figures.values()) \
        in proc.stdout


def test_swap_workspace_puts_every_stage_of_the_learner_in_the_engine(tmp_path):
    """What the capstone runs is the learner's: each target resolves to their function, and
    the reference backend attends through their online softmax."""
    from minipaged import LLM, SamplingParams
    from minipaged.attention.torch_ref import TorchRefBackend

    solutions_in(tmp_path, NAMES)
    ws = read_workspace(tmp_path)
    assert ws.yours == NAMES
    calls = []
    learner = ws.modules["online_softmax"]
    original = learner.online_softmax_attention
    learner.online_softmax_attention = lambda *a: calls.append(1) or original(*a)
    real_attend = TorchRefBackend.attend
    undo = swap_workspace(ws)
    try:
        for st in STAGES:
            for target, function in zip(st.real_targets, st.functions):
                assert resolve(target)[2] is getattr(ws.modules[st.name], function), target
        llm = LLM("stories260K", attention_backend="torch_ref", block_size=8, num_blocks=64)
        llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=3))
        assert calls
    finally:
        undo_swap(undo)
    assert TorchRefBackend.attend is real_attend
    assert all(not unwrap(resolve(t)[2]).__module__.startswith("minipaged_exercise")
               for st in STAGES for t in st.real_targets)


def test_capstone_names_the_learners_line_that_raised(tmp_path):
    st = get_stage("scheduler")
    path = tmp_path / "scheduler.py"
    path.write_text(solution_source(st).replace(
        "def finish(self, seq: Sequence, status: SequenceStatus) -> None:",
        "def finish(self, seq: Sequence, status: SequenceStatus) -> None:\n"
        "    raise ValueError('my bug')", 1))
    ws = Workspace(modules={"scheduler": load_learner_module(st, path)})
    check = run_check(Check("demo", ["scheduler"]), ws,
                      lambda: ws.modules["scheduler"].finish(None, None, None), False)
    assert not check.passed and check.error.startswith("ValueError: my bug")
    assert f"raised in stage scheduler, {path}:" in check.error
    assert "in finish: raise ValueError('my bug')" in check.error


def test_list_shows_the_stages_in_lesson_order_in_aligned_columns(tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.chdir(tmp_path)
    assert minipaged_main(["exercise", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[0], lines[1:1 + len(STAGES)]
    starts = [header.index(w) for w in ("stage", "lesson", "about", "status", "what you build")]
    for i, (row, st) in enumerate(zip(rows, STAGES), 1):
        assert row.split()[:3] == [str(i), st.name, st.lesson_number]
        for s in starts:  # every column starts where its header does
            assert row[s - 2:s] == "  " and row[s] != " ", (row, s)
    assert f"{len(STAGES)} stages, about {sum(solution_lines(s) for s in STAGES)} lines" \
        in "\n".join(lines)
    st = get_stage("fork")
    assert minipaged_main(["exercise", "list", "fork"]) == 0
    one = capsys.readouterr().out
    assert one.startswith(f"stage 10 of {len(STAGES)}, fork: {st.title}")
    assert f"it needs:    {st.needs}" in one
    assert all(c.name in one and c.where() in one for c in st.concepts)


def test_hint_gives_three_levels_then_stays_at_the_last(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert all(len(HINTS[n]) == 3 and all(HINTS[n]) for n in NAMES) and set(HINTS) == set(NAMES)
    seen = []
    for _ in range(4):
        assert minipaged_main(["exercise", "hint", "scheduler"]) == 0
        seen.append(capsys.readouterr().out)
    assert [s.splitlines()[0].split(" for ")[0] for s in seen] == \
        ["hint 1 of 3", "hint 2 of 3", "hint 3 of 3", "hint 3 of 3"]
    assert "That was the last hint" in seen[3] and "5. Preemption" in seen[3]
    assert minipaged_main(["exercise", "hint", "scheduler", "--level", "1"]) == 0
    assert capsys.readouterr().out.startswith("hint 1 of 3")


def test_status_counts_done_stages_and_notices_a_changed_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ws = tmp_path / "exercises"
    solutions_in(ws, ["sampler"])
    sampler = get_stage("sampler")
    record_check(ws, sampler, ws / "sampler.py", 12, 12, [])
    assert minipaged_main(["exercise", "start", "fork"]) == 0
    capsys.readouterr()
    assert minipaged_main(["exercise", "status"]) == 0
    out = capsys.readouterr().out
    assert f"stages done: 1 of {len(STAGES)}; graders passing at the last checks: 12 of 12" in out
    assert f"lines written: {solution_lines(sampler)} " in out
    assert "next: stage block_allocator" in out
    with open(ws / "sampler.py", "a") as f:
        f.write("\n# changed\n")
    assert minipaged_main(["exercise", "status"]) == 0
    out = capsys.readouterr().out
    assert "stages done: 0 of" in out and "12/12 (file changed since)" in out


def test_swap_reaches_every_reference_and_is_undone():
    """A module function is replaced in every module holding it (this test module imported it
    by name), a method on its class; undo puts the originals back, also in a module that took
    the learner's function while the swap was in place."""
    import minipaged.sampling
    import minipaged.sampling.sampler

    real = minipaged.sampling.sampler.apply_top_k_top_p_min_p
    st = get_stage("sampler")
    learner = ModuleType("learner")
    learner.apply_top_k_top_p_min_p = lambda *a: "learner's"
    learner._sample = lambda *a: "learner's"
    undo = swap_in(st, learner)
    late = ModuleType("imported_during_the_swap")
    sys.modules[late.__name__] = late
    try:
        assert minipaged.sampling.sampler.apply_top_k_top_p_min_p is learner.apply_top_k_top_p_min_p
        assert minipaged.sampling.apply_top_k_top_p_min_p is learner.apply_top_k_top_p_min_p
        assert globals()["apply_top_k_top_p_min_p"] is learner.apply_top_k_top_p_min_p
        late.apply_top_k_top_p_min_p = minipaged.sampling.apply_top_k_top_p_min_p
        undo_swap(undo)
        assert late.apply_top_k_top_p_min_p is real
    finally:
        del sys.modules[late.__name__]
    assert minipaged.sampling.sampler.apply_top_k_top_p_min_p is real
    assert minipaged.sampling.apply_top_k_top_p_min_p is real
    assert globals()["apply_top_k_top_p_min_p"] is real

    st = get_stage("block_manager")
    real = {f: vars(BlockManager)[f] for f in st.functions}
    skeleton = load_learner_module(st, st.skeleton_path)
    undo = swap_in(st, skeleton)
    try:
        with pytest.raises(NotImplementedError, match="exercise: write BlockManager.free"):
            BlockManager(4, 4).free(None)
    finally:
        undo_swap(undo)
    assert {f: vars(BlockManager)[f] for f in st.functions} == real


def test_a_broken_learner_file_is_explained(tmp_path):
    st = get_stage("scheduler")
    with pytest.raises(ExerciseFileError, match="does not exist.*exercise start scheduler"):
        load_learner_module(st, tmp_path / "nope.py")
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ExerciseFileError, match="defines no _schedule_running"):
        load_learner_module(st, tmp_path / "empty.py")
    (tmp_path / "typo.py").write_text("def _schedule_running(self, out, budget)\n")
    with pytest.raises(ExerciseFileError, match="importing .*typo.py failed: SyntaxError"):
        load_learner_module(st, tmp_path / "typo.py")
    assert "minipaged_exercise_scheduler" not in sys.modules


def test_start_lays_out_the_workspace_and_keeps_a_learners_work(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ws = tmp_path / "exercises"
    assert minipaged_main(["exercise", "check", "online_softmax"]) == 2  # not started yet
    assert "exercise start online_softmax" in capsys.readouterr().err
    assert minipaged_main(["exercise", "start", "online_softmax"]) == 0
    mine = ws / "online_softmax.py"
    assert mine.read_text() == get_stage("online_softmax").skeleton_path.read_text()
    mine.write_text("# my work\n")
    assert minipaged_main(["exercise", "start"]) == 0  # the others; mine is kept
    assert mine.read_text() == "# my work\n"
    assert sorted(p.stem for p in ws.glob("*.py")) == sorted(NAMES)
    assert (ws / "README.md").is_file()
    assert "kept exercises/online_softmax.py" in capsys.readouterr().err
    assert minipaged_main(["exercise", "start", "online_softmax"]) == 1
    assert minipaged_main(["exercise", "start", "online_softmax", "--force"]) == 0
    assert mine.read_text() == get_stage("online_softmax").skeleton_path.read_text()
    assert minipaged_main(["exercise", "start", "nope"]) == 2


def test_readme_and_the_book_show_the_track_as_it_is():
    table = markdown_table()
    for doc in ("README.md", "docs/build_track.md", "docs/index.md"):
        assert table in (ROOT / doc).read_text(), f"{doc}: `minipaged exercise list --markdown`"


def test_lessons_end_by_pointing_at_their_stages():
    for lesson in sorted({st.lesson for st in STAGES}):
        nb = json.loads((ROOT / "notebooks" / f"{lesson}.ipynb").read_text())
        last = nb["cells"][-1]
        text = "".join(last["source"])
        assert last["cell_type"] == "markdown" and last["id"] == "build-it-yourself", lesson
        for st in STAGES:
            if st.lesson == lesson:
                assert f"minipaged exercise check {st.name}" in text, (lesson, st.name)
        assert "../docs/build_track.md" in text


def test_solution_is_the_project_code_in_the_skeleton():
    for st in STAGES:
        source = solution_source(st)
        compile(source, f"{st.name}_solution.py", "exec")
        assert "NotImplementedError(\"exercise" not in source
        for target in st.real_targets:
            last = inspect.getsource(unwrap(resolve(target)[2])).strip().splitlines()[-1]
            assert last.strip() in source
