"""Lesson 12's helpers (minipaged/lessons/structured.py): the masks it draws are the ones the
engine applies, its rollback is exact, and its graded exercise fails on wrong schemas."""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.lessons import structured  # noqa: E402
from minipaged.structured_output import StructuredOutputsParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "12_structured_outputs.ipynb"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
SOLUTION = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
            "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                           "age": {"type": "integer", "minimum": 3, "maximum": 9},
                           "pets": {"type": "array", "maxItems": 2,
                                    "items": {"enum": ["cat", "dog"]}}}}


@pytest.fixture(scope="module")
def llm():
    return LLM("stories260K", device="cpu", seed=0, num_blocks=128)


def test_walk_masks_are_the_engines(llm):
    so = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)
    out = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    walk = structured.mask_walk(llm, so, out.token_ids)
    assert walk.masks.shape == (len(out.token_ids) + 1, 512)
    assert walk.allowed[0] == 1 and walk.pieces[out.token_ids[0]] == "<0x7B>"  # "{"
    assert all(walk.masks[i][t] for i, t in enumerate(out.token_ids))
    # the engine's own apply_masks on a fresh sequence after the same tokens: same allowed set
    eng = llm.engine
    for k in (0, 8, 20):
        seq = eng.add_request(f"walk-{k}", "Once upon a time", params)
        seq.output_token_ids.extend(out.token_ids[:k])  # what the sampler would have appended
        logits = eng.structured_output.apply_masks(torch.zeros(1, 512), [seq])
        assert torch.equal(torch.isfinite(logits[0]), torch.from_numpy(walk.masks[k])), k
        eng.abort_request(f"walk-{k}")
    with pytest.raises(ValueError, match="not allowed"):
        structured.mask_walk(llm, so, [out.token_ids[1]])  # '"' cannot open the output
    for fig in (structured.plot_mask_walk(walk),
                structured.plot_vocab_mask(walk.masks[0], walk.pieces, out.token_ids[0])):
        plt.close(fig)


def test_rollback_returns_to_the_earlier_state(llm):
    so = StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} is [1-9] years old\.")
    out = llm.generate(["Lily was"], SamplingParams(temperature=0.8, seed=3, max_tokens=40,
                                                    structured_outputs=so),
                       use_tqdm=False)[0].outputs[0]
    r = structured.rollback_check(llm, so, out.token_ids, k=4)
    assert r == {"tokens": len(out.token_ids), "rolled_back": 4, "mask_equals_earlier": True,
                 "mask_equals_end_after_replay": True}


def test_measure_cost_runs_both_ways_on_the_same_tokens(llm):
    live = structured.measure_cost(llm, num_requests=4, max_tokens=8, repeats=1)
    assert live["none"]["output_tokens"] == live["all constrained"]["output_tokens"] == 32
    assert live["none"]["mask_cpu_sec"] < live["all constrained"]["mask_cpu_sec"]
    assert live["none"]["accept_cpu_sec"] == 0 < live["all constrained"]["accept_cpu_sec"]
    assert live["ratio"] > 0
    committed = json.loads((ROOT / "benchmarks/results/structured_outputs_cpu_stories260k.json")
                           .read_text())
    plt.close(structured.plot_cost(live, committed))


def test_grader_fails_on_wrong_schemas_and_passes_the_solution(llm):
    with pytest.raises(AssertionError, match="accepts"):
        structured.grade_schema(llm, PERSON)  # no "pets" required
    loose = json.loads(json.dumps(SOLUTION))
    loose["properties"]["age"]["maximum"] = 12
    with pytest.raises(AssertionError, match='"age": 12'):
        structured.grade_schema(llm, loose)
    values = structured.grade_schema(llm, SOLUTION)
    assert len(values) == 2 and all(3 <= v["age"] <= 9 for v in values)


def test_the_graded_exercise_cell():
    nb = json.loads(NOTEBOOK.read_text())
    assert (nb["nbformat"], nb["nbformat_minor"]) == (4, 5)
    assert all("minipaged" in c["metadata"] for c in nb["cells"] if c["cell_type"] == "code")
    (cell,) = [c for c in nb["cells"] if "SCHEMA = None" in "".join(c["source"])]
    src = "".join(cell["source"])
    assert "if SCHEMA is not None:" in src and "structured.grade_schema(llm, SCHEMA)" in src
