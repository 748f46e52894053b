"""Grade one stage of the build track several times in one process (tests/test_exercises.py).

    python -m tests.grade_stage NAME OUT_DIR LABEL=FILE[:PYTEST_ARG,...] ...   (from the root)

Each LABEL runs pytest on the stage's graders with FILE's functions swapped in, with exactly
the arguments `minipaged exercise check` passes (cli.grader_args), and writes OUT_DIR/LABEL.xml
(JUnit) and OUT_DIR/LABEL.txt (pytest's output) and OUT_DIR/LABEL.rc. One process for all the
runs of a stage: torch, the package and the test modules are imported once, not once a run.
Hypothesis does not shrink a failing example here (a learner's `check` does): these runs only
ask whether the graders fail, and shrinking every failure of a skeleton takes seconds each.
"""
from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, settings

from minipaged.exercises import get_stage
from minipaged.exercises.cli import grader_args


def main(argv: list[str]) -> None:
    settings.register_profile("grade_stage", phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("grade_stage")  # before the test modules make their settings
    stage, out = get_stage(argv[0]), Path(argv[1])
    for spec in argv[2:]:
        label, _, rest = spec.partition("=")
        path, _, extra = rest.partition(":")
        buf = io.StringIO()
        args = grader_args(stage, Path(path), None,
                           [f"--junitxml={out / (label + '.xml')}", *filter(None, extra.split(","))])
        with contextlib.redirect_stdout(buf):
            rc = pytest.main(args)
        (out / f"{label}.txt").write_text(buf.getvalue())
        (out / f"{label}.rc").write_text(str(int(rc)))


if __name__ == "__main__":
    main(sys.argv[1:])
