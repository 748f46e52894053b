"""The lessons' exercises and their helpers: lesson 02b (minipaged/lessons/one_request.py)."""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Annotation  # noqa: E402

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.lessons.one_request import (filled_slots, next_decode_slot_mapping,  # noqa: E402
                                           plot_flat_batch)
from minipaged.worker.wrapper import innermost  # noqa: E402
from tests.helpers import exercise_cell  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "02b_one_request.ipynb"


def lesson_engine():
    """notebooks/02b_one_request.ipynb's engine: a first request come and gone, A and B queued."""
    llm = LLM("stories260K", device="cpu", block_size=4, num_blocks=16, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(["One day, a cat"], params, use_tqdm=False)
    engine = llm.engine
    a = engine.add_request("A", "The sun was hot", params)
    b = engine.add_request("B", "Tom had a red ball.", params)
    return engine, a, b


def record_slot_mappings(engine) -> list[list[int]]:
    """Every step's slot_mapping, as the engine's own ModelRunner.prepare_inputs builds it."""
    seen = []
    runner = innermost(engine.model_runner)  # (the runner inside the wrappers builds them)
    real = runner.prepare_inputs

    def recording(sched):
        out = real(sched)
        seen.append(out[2].slot_mapping.tolist())
        return out

    runner.prepare_inputs = recording
    return seen


def test_next_decode_slot_mapping_matches_the_engine():
    engine, a, b = lesson_engine()
    bm = engine.block_manager
    seen = record_slot_mappings(engine)
    engine.step()
    engine.step()
    # The numbers the lesson prints: A in blocks 4, 5 and B in 6, 7, 8, then one decode each.
    assert seen == [list(range(16, 23)) + list(range(24, 34)), [23, 34]]
    new_blocks = 0
    for _ in range(3, 9):  # steps 3..8: both decode until max_tokens=8
        predicted = next_decode_slot_mapping(engine)
        tables = [list(bm.block_tables[s.seq_id]) for s in (a, b)]
        engine.step()
        assert seen[-1] == predicted
        new_blocks += sum(slot // bm.block_size not in t for slot, t in zip(predicted, tables))
    # The graded exercise: A's position 8 starts a new block (the free queue's front, 9), B's
    # position 11 is the last slot of its block 8.
    assert seen[2] == [36, 35]
    assert new_blocks >= 2  # the prediction was checked across block boundaries of both
    assert a.is_finished and b.is_finished


def test_flat_batch_picture_draws_the_engines_step():
    engine, a, b = lesson_engine()
    sched = engine.scheduler.schedule()
    input_ids, positions, md, _ = engine.model_runner.prepare_inputs(sched)
    filled = filled_slots(engine.kv_cache[0, 0])
    assert int(filled.sum()) == 14  # the first request's 7 + 7 computed tokens, nothing of A or B
    fig = plot_flat_batch(input_ids, positions, md, ["A", "B"], [str(t) for t in input_ids.tolist()],
                          filled, color_keys=[a.seq_id, b.seq_id])
    ax = fig.axes[0]
    arrows = [t for t in ax.texts if isinstance(t, Annotation)]
    assert len(arrows) == md.num_tokens == 17
    written = [p for p in ax.patches if p.get_linewidth() == 1.4]  # the slots this step writes
    assert len(written) == 17
    plt.close(fig)


def test_the_graded_exercise_runs_in_ci_and_checks_when_filled():
    src = exercise_cell(NOTEBOOK)
    assert "if ANSWER is not None:" in src and "assert ANSWER == engine_slots" in src
