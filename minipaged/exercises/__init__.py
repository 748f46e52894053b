"""Build it yourself: a track of thirteen stages, in lesson order, that together are your engine.

Lessons 02-06, 10 and 13 each end by pointing at their stages. A stage is a *skeleton* module
(skeletons/): the real signatures and docstrings of the functions to write, bodies that raise
NotImplementedError. You write it in a workspace of your own (`exercises/` by default; the files
are yours to keep), and the project's own tests grade it with your functions swapped in for the
real ones; the capstone then runs your whole engine on stories260K.

    minipaged exercise list [NAME]            the stages in lesson order (NAME: one in full)
    minipaged exercise start [NAME ...]       lays out the workspace (every stage, or some)
    minipaged exercise check NAME [--file F]  runs the stage's graders with your functions in
    minipaged exercise check NAME --solution  the same with the project's own code
    minipaged exercise hint NAME              the next of three hints (the last near pseudocode)
    minipaged exercise status                 stages done, graders passing, lines written
    minipaged exercise solution NAME          prints the solution
    minipaged exercise capstone               your engine, every stage you wrote at once

The solutions are the project's code itself, so they cannot drift: `--solution` grades the
skeleton with every function body replaced by the real one's source (grading.solution_source).

    stages.py    the stages: targets, graders grouped by concept and lesson section, needs
    hints.py     three hints per stage
    grading.py   load a learner's file, swap it in for the real symbols, write the solution
    plugin.py    the pytest plugin `check` runs the graders with (`-p minipaged.exercises.plugin`)
    progress.py  the workspace's record: checks, hints given, what `status` shows
    capstone.py  the whole engine with the learner's stages in, against Hugging Face
    capstone_report.py   the capstone's figures (the learner's trace) and printout
    cli.py       `minipaged exercise ...`
"""
from __future__ import annotations

from minipaged.exercises.stages import STAGES, Concept, Stage, get_stage

__all__ = ["STAGES", "Concept", "Stage", "get_stage"]
