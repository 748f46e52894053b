"""The workspace's record of a learner's progress, and what `minipaged exercise status` shows.

The workspace (`exercises/` by default) holds the learner's files, one per stage, and
`.progress.json`: the last `check` of each stage (the file's digest, graders passing, failing
concepts) and how many hints each stage has given. A stage is *done* when its last check passed
every grader on the file as it is now.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from minipaged.exercises.grading import (ExerciseFileError, code_lines, file_digest,
                                         load_learner_module, written_functions)
from minipaged.exercises.stages import Stage

DEFAULT_WORKSPACE = Path("exercises")
RECORD = ".progress.json"


def stage_file(workspace: Path, stage: Stage) -> Path:
    return Path(workspace) / f"{stage.name}.py"


def load(workspace: Path) -> dict:
    path = Path(workspace) / RECORD
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data.setdefault("checks", {})
    data.setdefault("hints", {})
    return data


def save(workspace: Path, data: dict) -> None:
    Path(workspace).mkdir(parents=True, exist_ok=True)
    (Path(workspace) / RECORD).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def record_check(workspace: Path, stage: Stage, path: Path, passed: int, total: int,
                 failing: list[str]) -> None:
    """Remember a `check` of the learner's file `path` (`failing`: the concepts not passed)."""
    data = load(workspace)
    data["checks"][stage.name] = {"digest": file_digest(path), "passed": passed,
                                  "total": total, "failing": failing,
                                  "when": time.strftime("%Y-%m-%d %H:%M")}
    save(workspace, data)


def next_hint_level(workspace: Path, stage: Stage, levels: int) -> int:
    """The hint to show now (1-based), remembered: each call gives the next, up to the last."""
    data = load(workspace)
    level = min(data["hints"].get(stage.name, 0) + 1, levels)
    data["hints"][stage.name] = level
    save(workspace, data)
    return level


@dataclass
class StageStatus:
    stage: Stage
    state: str  # "not started", "broken" (does not import), "skeleton", "started", "written"
    num_written: int = 0  # functions written
    lines: int = 0  # lines of code written in them
    passed: Optional[int] = None  # graders passing at the last check of this very file
    total: Optional[int] = None
    stale: bool = False  # the file changed since its last check
    error: str = ""

    @property
    def done(self) -> bool:
        return (self.passed is not None and not self.stale and self.passed == self.total
                and self.state == "written")


def stage_status(workspace: Path, stage: Stage, record: Optional[dict] = None) -> StageStatus:
    path = stage_file(workspace, stage)
    if not path.is_file():
        return StageStatus(stage, "not started")
    try:
        module = load_learner_module(stage, path)
    except ExerciseFileError as e:
        return StageStatus(stage, "broken", error=str(e))
    written = written_functions(stage, module)
    lines = sum(code_lines(getattr(module, f)) for f in written)
    state = ("written" if len(written) == len(stage.functions)
             else "started" if written else "skeleton")
    status = StageStatus(stage, state, len(written), lines)
    check = (record if record is not None else load(workspace))["checks"].get(stage.name)
    if check is not None:
        status.passed, status.total = check["passed"], check["total"]
        status.stale = check["digest"] != file_digest(path)
    return status
