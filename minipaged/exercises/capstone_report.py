"""The capstone's pictures and printout: your engine's trace drawn, and what ran whose code.

`draw_figures` draws the parity run's trace with the lessons' own pictures (minipaged/lessons/
viz): the block tables at the step that held the most blocks, and the batch composition of
every step (prefill chunks, decodes, waits, preemptions). `print_report` says which stages are
yours, how each workload compared with its reference, and where the files are.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files, no window: the capstone runs in a terminal

import matplotlib.pyplot as plt  # noqa: E402

from minipaged.exercises.stages import STAGES  # noqa: E402


def busiest_step(trace) -> int:
    """The position in `trace` of the step whose block tables share the most blocks (forks),
    then hold the most blocks."""
    def key(i: int):
        tables = list((trace[i].block_tables or {}).values())
        entries = [b for t in tables for b in t]
        return len(entries) - len(set(entries)), len(entries), -i
    return max(range(len(trace)), key=key)


def draw_figures(llm, out: Path, num_yours: int) -> dict:
    """block_tables.png and batch_composition.png in `out`, from `llm`'s trace."""
    from minipaged.lessons import viz
    trace = llm.trace
    whose = f"your engine ({num_yours} of {len(STAGES)} stages yours)"
    pos = busiest_step(trace)
    rec = trace[pos]
    fig = viz.plot_block_tables(trace, pos, max_physical=llm.engine.block_manager.num_blocks,
                                title=f"{whose}: block tables after step {rec.step}")
    tables = out / "block_tables.png"
    fig.savefig(tables, dpi=90, bbox_inches="tight")
    plt.close(fig)
    fig = viz.plot_batch_gantt(trace, title=f"{whose}: batch composition, {len(trace)} steps, "
                                            f"{sum(len(r.preempted) for r in trace)} preemptions")
    gantt = out / "batch_composition.png"
    fig.savefig(gantt, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return {"block_tables": {"path": str(tables), "step": rec.step,
                             "sequences": len(rec.block_tables or {})},
            "batch_composition": {"path": str(gantt), "steps": len(trace)}}


def print_report(report: dict, out: Path) -> None:
    yours = report["yours"]
    print(f"your engine: {len(yours)} of {len(STAGES)} stages are yours"
          + (f" ({', '.join(yours)})" if yours else "; the project's code runs every stage "
             "(write a stage's functions in its file, then run this again)"))
    width = max(len(st.name) for st in STAGES)
    for i, st in enumerate(STAGES, 1):
        print(f"  {i:>2}  {st.name:<{width}}  lesson {st.lesson_number:<3}  "
              f"{report['stages'][st.name]}")
    print("\nworkloads (each against a reference that does not run your code):")
    for c in report["checks"]:
        mark = "ok  " if c["passed"] else "FAIL"
        mine = [s for s in c["stages"] if s in yours]
        print(f"  {mark} {c['name']}: " + (c["detail"] or "did not finish"))
        print(f"       your stages in it: {', '.join(mine) if mine else 'none yet'}")
        if c["error"]:
            print("       your engine raised " + c["error"].replace("\n", "\n       "))
    if report["story"]:
        print(f"\nthe story your engine wrote: {report['story']!r}")
    if report["figures"]:
        print("\nfrom your engine's trace: "
              + ", ".join(f["path"] for f in report["figures"].values()))
    print(f"report: {out / 'report.json'}")
    print("every workload matches its reference" if report["passed"] else
          "some workloads differ: `minipaged exercise check NAME` grades a stage alone, "
          "with the lessons' sections for what fails")
