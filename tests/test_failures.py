"""A failing request fails alone (engine/failures.py): faults injected into one request.

Whatever raises while one request is stepped (the sampler, a stop check, making its output, a
beam step) must end that request with finish_reason "error" and its blocks freed, while every
other request in the same batch finishes with exactly the tokens it gets without the culprit;
offline, `LLM.generate` raises a `RequestError` naming the prompt and leaves the `LLM` holding
nothing. Without the guards the fault escapes `step()` and every test here fails.
"""
from __future__ import annotations

import pytest
import torch

from minipaged import LLM, BeamSearchParams, RequestError, SamplingParams
from minipaged.engine.block_usage import check_invariants
from minipaged.engine.sequence import SequenceStatus

CULPRIT = [1, 319, 280, 261, 450, 400]  # the faults below fire only for this prompt
BYSTANDERS = {
    "greedy": ("Once upon a time", SamplingParams(temperature=0, max_tokens=12)),
    "seeded": ("Lily went to the park", SamplingParams(temperature=0.9, seed=7, max_tokens=12)),
    "short": ("The cat", SamplingParams(temperature=0, max_tokens=3)),
}
CULPRIT_PARAMS = SamplingParams(temperature=0, max_tokens=12)
# On a GPU machine the same faults run on CUDA too (the sampler's kernels, CUDA generators).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _is_culprit(seq) -> bool:
    return seq.prompt_token_ids == CULPRIT


class FaultySampler:
    """Raises for the culprit's 3rd token (counted by the tokens computed, which async
    scheduling counts alike), *after* the real sampler ran on the whole batch: the seeded rows'
    generators have advanced by then, as they would for a late raise."""

    def __init__(self, sampler):
        self.inner = sampler

    def _check(self, seqs):
        if any(_is_culprit(s) and s.num_computed_tokens >= len(CULPRIT) + 2 for s in seqs):
            raise RuntimeError("injected sampler fault")

    def __call__(self, logits, seqs):
        out = self.inner(logits, seqs)
        self._check(seqs)
        return out

    def sample(self, logits, seqs):  # async scheduling's deferred path
        tokens = self.inner.sample(logits, seqs)
        self._check(seqs)
        return tokens


def inject(eng, where: str, monkeypatch) -> None:
    if where == "sampler":
        monkeypatch.setattr(eng, "sampler", FaultySampler(eng.sampler))
        return
    proc = eng.output_processor
    original = getattr(proc, where)

    def check_stop(seq, token):
        if _is_culprit(seq) and seq.num_output_tokens == 3:
            raise RuntimeError("injected stop-check fault")
        return original(seq, token)

    def make_output(seq):
        if _is_culprit(seq):
            raise RuntimeError("injected output fault")
        return original(seq)

    def make_group_output(group, root):
        if _is_culprit(group.seqs[0]) and group.is_finished:
            raise RuntimeError("injected group output fault")
        return original(group, root)

    faulty = {"check_stop": check_stop, "make_output": make_output,
              "make_group_output": make_group_output}
    monkeypatch.setattr(proc, where, faulty[where])


def make_llm(async_scheduling: bool, device: str = "cpu") -> LLM:
    return LLM("stories260K", block_size=8, num_blocks=96, dtype="float32", device=device,
               async_scheduling=async_scheduling, max_num_seqs=16)


def run(eng, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    outs = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                assert out.request_id not in outs, "a request finished twice"
                outs[out.request_id] = out
    return outs


def assert_holds_nothing(eng):
    assert not eng.has_unfinished_requests() and eng.get_num_unfinished_requests() == 0
    assert not eng.groups
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    check_invariants(eng.block_manager, [])


def tokens(outs: dict) -> dict:
    return {rid: [c.token_ids for c in o.outputs] for rid, o in outs.items()}


@pytest.fixture(scope="module")
def references():
    """Per device, the requests without faults: bystanders and the culprit's normal tokens."""
    return {d: tokens(run(make_llm(False, d).engine,
                          {**BYSTANDERS, "culprit": (CULPRIT, CULPRIT_PARAMS)})) for d in DEVICES}


@pytest.fixture(scope="module")
def reference(references):
    return references["cpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where, expected_tokens", [
    ("sampler", 2),  # its 3rd token is never sampled
    ("check_stop", 3),  # its 3rd token is appended, then the stop check raises
    ("make_output", 12),  # it finished, then its output could not be made
])
def test_a_fault_fails_its_request_alone(references, monkeypatch, where, expected_tokens,
                                         async_scheduling, device):
    reference = references[device]
    eng = make_llm(async_scheduling, device).engine
    inject(eng, where, monkeypatch)
    outs = run(eng, {**BYSTANDERS, "culprit": (CULPRIT, CULPRIT_PARAMS)})
    bad = outs.pop("culprit")
    assert tokens(outs) == {rid: reference[rid] for rid in BYSTANDERS}  # exactly as without it
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert bad.error.startswith("RuntimeError: injected") and "fault" in bad.error
    got = bad.outputs[0].token_ids
    assert got == reference["culprit"][0][:expected_tokens]  # its tokens so far
    assert sum(r.finished.count("culprit") for r in eng.trace) == 1  # in the trace, once
    assert_holds_nothing(eng)
    assert run(eng, {"again": BYSTANDERS["greedy"]})["again"].outputs[0].token_ids == \
        reference["greedy"][0]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_offline_generate_raises_for_the_failed_prompt_and_holds_nothing(reference, monkeypatch,
                                                                         async_scheduling):
    llm = make_llm(async_scheduling)
    inject(llm.engine, "check_stop", monkeypatch)
    prompts = ["Once upon a time", CULPRIT, "The cat"]
    with pytest.raises(RequestError) as e:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert str(e.value) == ("prompt 1 failed while it was generated: RuntimeError: injected "
                            "stop-check fault")
    assert_holds_nothing(llm.engine)  # the other two prompts were aborted
    out = llm.generate(prompts[0], BYSTANDERS["greedy"][1], use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference["greedy"][0]
    assert_holds_nothing(llm.engine)


@pytest.mark.parametrize("where", ["sampler", "check_stop", "make_group_output"])
def test_a_failing_sample_ends_its_whole_group(reference, monkeypatch, where):
    eng = make_llm(False).engine
    inject(eng, where, monkeypatch)
    group = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12)
    outs = run(eng, {**BYSTANDERS, "culprit": (CULPRIT, group)})
    bad = outs.pop("culprit")
    assert tokens(outs) == {rid: reference[rid] for rid in BYSTANDERS}
    assert bad.error.startswith("RuntimeError: injected")
    assert len(bad.outputs) == 3 and [c.index for c in bad.outputs] == [0, 1, 2]
    if where == "make_group_output":  # every sample had finished; the first one takes the blame
        assert [c.finish_reason for c in bad.outputs] == ["error", "length", "length"]
    else:
        assert all(c.finish_reason == "error" for c in bad.outputs)
    assert_holds_nothing(eng)


def test_a_failing_beam_step_frees_every_beam_even_half_forked(monkeypatch):
    """The fault comes after the beam step forked a parent: the children are in the scheduler
    but not yet in the group, and must be freed too."""
    eng = make_llm(False).engine
    ref = run(eng, {"beam": (CULPRIT, BeamSearchParams(beam_width=3, max_tokens=8)),
                    "greedy": BYSTANDERS["greedy"]})
    original = eng.scheduler.fork
    forks = []

    def fork(parent, children):
        original(parent, children)
        if parent.group is not None and parent.group.beam is not None and children:
            forks.append(len(children))
            if len(forks) == 2:
                raise RuntimeError("injected beam fault")

    monkeypatch.setattr(eng.scheduler, "fork", fork)
    outs = run(eng, {"beam": (CULPRIT, BeamSearchParams(beam_width=3, max_tokens=8)),
                     "greedy": BYSTANDERS["greedy"]})
    assert len(forks) == 2  # the fault really came mid-step
    assert outs["greedy"].outputs[0].token_ids == ref["greedy"].outputs[0].token_ids
    assert outs["beam"].error == "RuntimeError: injected beam fault"
    assert all(c.finish_reason == "error" for c in outs["beam"].outputs)
    assert_holds_nothing(eng)


def test_an_error_in_the_model_forward_is_not_a_requests_fault(monkeypatch, reference):
    llm = make_llm(False)
    runner = llm.engine.model_runner

    def broken(*args, **kwargs):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(runner, "execute", broken)
    with pytest.raises(RuntimeError, match="the device is gone"):
        llm.generate(["Once upon a time", "The cat"], SamplingParams(max_tokens=4), use_tqdm=False)
    monkeypatch.undo()
    assert_holds_nothing(llm.engine)  # generate aborted its requests on the way out
    out = llm.generate("Once upon a time", BYSTANDERS["greedy"][1], use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference["greedy"][0]


def test_seeded_rows_replay_the_draw_of_the_failed_batch(monkeypatch):
    """The retry after a raise restores the seeded generators: without that, the seeded
    bystander would draw a second time and its tokens would change."""
    eng = make_llm(False).engine
    alone = run(eng, {"s": BYSTANDERS["seeded"]})["s"].outputs[0].token_ids
    inject(eng, "sampler", monkeypatch)
    outs = run(eng, {"s": BYSTANDERS["seeded"], "culprit": (CULPRIT, CULPRIT_PARAMS)})
    assert outs["s"].outputs[0].token_ids == alone
    assert outs["culprit"].outputs[0].finish_reason == SequenceStatus.FINISHED_ERROR.value
    assert_holds_nothing(eng)
