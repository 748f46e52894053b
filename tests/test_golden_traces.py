"""Golden outputs and step traces: the engine must reproduce tests/golden/traces.json exactly.

What this proves: a change that passes made no observable difference to any recorded scenario
(tests/golden/record.py lists them: the synchronous and the async-scheduling step loops, crossed
with greedy and seeded sampling, n > 1, beam search, recompute and swap preemption, chunked and
whole prefill, prefix caching, LoRA, n-gram and draft-model speculation, structured outputs,
EOS, requests arriving mid-run and aborts, and tensor parallelism). Not only the tokens, texts,
finish and stop reasons of every completion are the same, but the engine took the same path to
them: every step scheduled the same sequences for the same prefill / decode tokens, preempted,
swapped, shared, copied, streamed and finished the same ones, and held the same number of used,
free and cached blocks (`greedy_*` and `tp2_sync`: the same block tables); at the end every
block is free. It is the safety net of refactors that move the engine's code without meaning to
change what it does.

It does not prove the recorded behaviour right: the parity tests (HF's tokens) and each
capability's own tests do that. A failure names the scenario and, for the requests, the end
state and the trace, the first field that differs with both values.

Re-record only when a change is *meant* to change behaviour (a new scheduling rule, a fixed
bug), and say so in its commit with the scenarios it changed:

    python -m tests.golden.record              # every scenario
    python -m tests.golden.record NAME ...     # only these

Seeded sampling is recorded too: it is exact on one machine, but a sampled token may in rare
cases depend on the last bits of a BLAS sum that another CPU computes differently.
"""
import json

import pytest
import torch.distributed as dist

from tests.golden.record import SCENARIOS, Assets, load, run_scenario

GOLDEN = load()
_ABSENT = object()  # a key one side has and the other lacks


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return Assets(tmp_path_factory.mktemp("golden"))


def _short(value, limit: int = 400) -> str:
    text = "absent" if value is _ABSENT else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + " ..."


def first_difference(want, got, path: str = ""):
    """(path, recorded value, new value) of the first place `got` differs from `want`, or None.
    Dicts are walked in the recorded key order, lists item by item, then by length."""
    if isinstance(want, dict) and isinstance(got, dict):
        for key in list(want) + [k for k in got if k not in want]:
            diff = first_difference(want.get(key, _ABSENT), got.get(key, _ABSENT),
                                    f"{path}.{key}")
            if diff:
                return diff
        return None
    if isinstance(want, list) and isinstance(got, list):
        for i, (w, g) in enumerate(zip(want, got)):
            diff = first_difference(w, g, f"{path}[{i}]")
            if diff:
                return diff
        if len(want) != len(got):
            return f"{path} (length)", len(want), len(got)
        return None
    if want is _ABSENT or got is _ABSENT or type(want) is not type(got) or want != got:
        return path, want, got
    return None


def differences(name: str, want: dict, got: dict) -> list[str]:
    """One line per part (requests, end, trace, streamed) that differs: where first, and both
    values."""
    lines = []
    for part in list(want) + [k for k in got if k not in want]:
        if part not in want or part not in got:
            lines.append(f"{name}: {part}: recorded {'present' if part in want else 'absent'}"
                         f", got {'present' if part in got else 'absent'}")
            continue
        diff = first_difference(want[part], got[part], part)
        if diff is None:
            continue
        path, w, g = diff
        line = f"{name}: {path}: recorded {_short(w)}, got {_short(g)}"
        if part == "trace" and path.startswith("trace["):
            i = int(path[len("trace["):].split("]")[0])
            line += (f"\n  recorded step {i}: {_short(want['trace'][i])}"
                     f"\n  got step {i}:      "
                     f"{_short(got['trace'][i]) if i < len(got['trace']) else 'absent'}")
        lines.append(line)
    return lines


def test_every_scenario_is_recorded():
    assert list(GOLDEN) == list(SCENARIOS), (
        "tests/golden/traces.json and record.py's SCENARIOS name different scenarios: record "
        "the new ones (python -m tests.golden.record NAME ...) or drop the old ones")


def test_recorded_tensor_parallel_run_equals_the_single_process_one():
    """tp2_sync runs greedy_sync's workload on 2 processes: the driver schedules alike and the
    sharded model computes the same greedy tokens, so the records must be equal too."""
    assert SCENARIOS["tp2_sync"].params is SCENARIOS["greedy_sync"].params
    assert not differences("tp2_sync", GOLDEN["greedy_sync"], GOLDEN["tp2_sync"])


def _scenarios():
    needs_gloo = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch's gloo")
    return [pytest.param(name, id=name, marks=[needs_gloo] if sc.tensor_parallel else [])
            for name, sc in SCENARIOS.items()]


@pytest.mark.parametrize("name", _scenarios())
def test_scenario_reproduces_its_record(name, assets):
    got = json.loads(json.dumps(run_scenario(SCENARIOS[name], assets)))  # as the file holds it
    end = got["end"]
    assert end["num_free_blocks"] == end["num_blocks"], f"{name}: blocks left in use: {end}"
    assert not end["has_unfinished_requests"], f"{name}: requests left unfinished"
    assert name in GOLDEN, f"{name} is not recorded: python -m tests.golden.record {name}"
    lines = differences(name, GOLDEN[name], got)
    if lines:
        pytest.fail("differs from tests/golden/traces.json:\n" + "\n".join(lines), pytrace=False)


def test_a_difference_is_named_with_its_step_and_field():
    """The comparison itself: a changed decode count is reported at its step and field."""
    name = next(iter(GOLDEN))
    want = GOLDEN[name]
    got = json.loads(json.dumps(want))
    got["trace"][3]["scheduled"][0][3] += 1
    got["requests"][0]["outputs" if "outputs" in got["requests"][0] else "sequences"].append({})
    lines = differences(name, want, got)
    assert len(lines) == 2
    assert "requests[0]" in lines[0] and "(length)" in lines[0]
    assert lines[1].startswith(f"{name}: trace[3].scheduled[0][3]: recorded ")
    assert "recorded step 3:" in lines[1]
    assert differences(name, want, json.loads(json.dumps(want))) == []
