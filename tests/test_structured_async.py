"""Grammar rows under async scheduling (structured_output/background.py): the masks are filled on
a worker thread and a constrained step is sampled only once the next step has been scheduled,
and the outputs are still exactly a synchronous engine's; a row that raises fails alone."""
import threading

import pytest

from minipaged import LLM, SamplingParams
from minipaged.sampling.kernel_sampler import KernelSampler
from minipaged.structured_output import StructuredOutputsParams as SO
from minipaged.structured_output import background, batch_calls
from minipaged.structured_output.background import BackgroundFill
from minipaged.structured_output.batch_calls import BatchCalls
from tests.helpers import IGNORE_INTERPRETER_WARNINGS
from tests.test_failures import run
from tests.test_structured_output import CHOICES, PERSON, PROMPTS, REGEX, check_valid, constraints


def _params(ignore_eos=False, temperature=0.0, n=1, seeded=True, max_tokens=120):
    """`temperature`: one for every row, or a list to cycle through."""
    temps = temperature if isinstance(temperature, list) else [temperature]
    plain = [SamplingParams(temperature=temps[0], seed=5 if seeded else None,
                            max_tokens=40)] * 2
    return plain + [SamplingParams(temperature=temps[i % len(temps)],
                                   seed=i if seeded else None, max_tokens=max_tokens, n=n,
                                   ignore_eos=ignore_eos, structured_outputs=so)
                    for i, so in enumerate(constraints())]


def _run(async_scheduling, params, kernel=False, **cfg):
    llm = LLM("stories260K", block_size=8, seed=1, device="cpu",
              async_scheduling=async_scheduling, **cfg)
    # kernel: the Triton sampling kernels (interpreted), which a CUDA engine uses; under async
    # scheduling they apply the masks and flag the grammars that ended (sampling/kernels.py)
    if kernel:
        llm.engine.sampler = KernelSampler(seed=1, eos_token_ids=llm.engine.eos_token_ids)
    sampler = llm.engine.sampler
    inner, llm.masked_in_kernels = sampler.sample_masked, []
    sampler.sample_masked = lambda *a: llm.masked_in_kernels.append(inner(*a)) or \
        llm.masked_in_kernels[-1]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], llm


@IGNORE_INTERPRETER_WARNINGS
@pytest.mark.parametrize("case", ["greedy", "ignore_eos", "sampled", "n=2", "preempted",
                                  "kernel greedy", "kernel sampled", "public batch calls"])
def test_async_equals_sync(case, monkeypatch):
    kw, cfg = {}, {}
    if case == "public batch calls":  # xgrammar's public batched methods (batch_calls.py)
        monkeypatch.setattr(batch_calls, "_direct_calls", lambda: None)
        kw = dict(temperature=1.0)
    if case.startswith("kernel"):  # unseeded rows: the kernels' own draw
        kw = dict(seeded=False, max_tokens=50,  # sampled: greedy and two temperatures mixed
                  temperature=[1.0, 0.0, 0.7] if case.endswith("sampled") else 0.0)
        cfg = dict(kernel=True)
    if case == "ignore_eos":  # the grammar's own end (a stop token it accepted) stops the row
        kw = dict(ignore_eos=True)
    elif case == "sampled":
        kw = dict(temperature=1.0)
    elif case == "n=2":  # groups run synchronously inside async scheduling
        kw = dict(temperature=1.0, n=2)
    elif case == "preempted":
        cfg = dict(num_blocks=20, max_model_len=160, max_num_batched_tokens=64,
                   enable_prefix_caching=False)
    params = _params(**kw)
    ref, _ = _run(False, params, **cfg)
    got, llm = _run(True, params, **cfg)
    assert got == ref
    if case == "preempted":
        assert sum(len(r.preempted) for r in llm.trace) > 0
    # the kernels sampled the constrained steps with their masks (else the torch path)
    in_kernels = [out is not None for out in llm.masked_in_kernels]
    assert (len(in_kernels) > 10 and all(in_kernels)) if "kernel" in case else not any(in_kernels)
    for so, out in zip(constraints(), got[2:]):
        assert out[0][1] in ("stop", "length")


def test_a_stop_token_the_grammar_accepts_in_an_unchanged_batch_ends_the_request(monkeypatch):
    """With ignore_eos, a constrained row that samples EOS where its grammar may end but could
    also go on has a matcher that accepted a stop token: the request finishes ("stop"), as in
    the synchronous engine, though the batch is the same as the step before (where the rows'
    matchers are reused). The sampler is made to pick EOS, once the row has a few tokens, wherever
    the mask allows it."""
    params = [SamplingParams(temperature=0, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                             structured_outputs=SO(regex="[a-z ]+"))]

    def run(async_scheduling):
        llm = LLM("stories260K", block_size=8, seed=1, device="cpu",
                  async_scheduling=async_scheduling)
        sampler, eos = llm.engine.sampler, llm.engine.tokenizer.eos_token_id
        sample = sampler.sample

        def eos_when_allowed(logits, seqs):
            logits = logits.clone()
            for i, seq in enumerate(seqs):
                if (seq.sampling_params.structured_outputs is not None
                        and seq.num_output_tokens >= 4 and logits[i, eos] > float("-inf")):
                    logits[i, eos] = 1e4
            return sample(logits, seqs)
        monkeypatch.setattr(sampler, "sample", eos_when_allowed)
        outs = llm.generate(["Once upon a time", "The cat"], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    ref = run(False)
    assert ref[1][1] == "stop" and len(ref[1][0]) == 5  # four letters, then EOS accepted
    fast = []
    same_batch = BackgroundFill._advance_same_batch
    monkeypatch.setattr(BackgroundFill, "_advance_same_batch",
                        lambda self, *a: fast.append(1) or same_batch(self, *a))
    assert run(True) == ref
    assert fast  # the rows were reused on the steps before


def test_masks_are_filled_off_the_main_thread_after_the_next_step_is_scheduled(monkeypatch):
    llm = LLM("stories260K", block_size=8, seed=1, device="cpu", async_scheduling=True)
    eng = llm.engine
    events = []
    fill, start, schedule = background._fill, BackgroundFill.start, eng.schedule
    on_main = []
    sample_deferred = eng.step_loop.sample_deferred

    def traced_fill(*args):
        on_main.append(threading.current_thread() is threading.main_thread())
        return fill(*args)

    def traced_start(self, *args, **kwargs):
        events.append("start")
        return start(self, *args, **kwargs)

    def traced_schedule():
        events.append("schedule")
        return schedule()

    def traced_sample(step):
        events.append("sample")
        return sample_deferred(step)
    monkeypatch.setattr(background, "_fill", traced_fill)
    monkeypatch.setattr(BackgroundFill, "start", traced_start)
    monkeypatch.setattr(eng, "schedule", traced_schedule)
    monkeypatch.setattr(eng.step_loop, "sample_deferred", traced_sample)
    accepted = []
    accept = eng.structured_output.accept
    monkeypatch.setattr(eng.structured_output, "accept",
                        lambda seq: accepted.append(accept(seq)) or accepted[-1])
    so = SO(json=PERSON)
    (out,) = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=200,
                                                               structured_outputs=so),
                          use_tqdm=False)
    check_valid(so, out.outputs[0].text, out.outputs[0].finish_reason)
    assert len(on_main) > 10 and not any(on_main)  # every fill on the worker
    # each deferred step is sampled after the next step was scheduled: start, schedule, sample
    pairs = [(i, events.index("sample", i)) for i, k in enumerate(events) if k == "start"
             and "sample" in events[i:]]
    assert len(pairs) > 10 and all("schedule" in events[a:b] for a, b in pairs)
    assert accepted and not any(accepted)  # accept leaves the matchers to the fill's start


class FaultySampler:
    """Raises on the culprit's 3rd token, after sampling the whole batch."""

    def __init__(self, sampler, culprit):
        self.inner, self.culprit = sampler, culprit

    def _check(self, seqs):
        if any(s.request_id == self.culprit and s.num_output_tokens == 2 for s in seqs):
            raise RuntimeError("injected sampler fault")

    def __call__(self, logits, seqs):
        out = self.inner(logits, seqs)
        self._check(seqs)
        return out

    def sample(self, logits, seqs):
        tokens = self.inner.sample(logits, seqs)
        self._check(seqs)
        return tokens

    def sample_masked(self, logits, seqs, mask):
        out = self.inner.sample_masked(logits, seqs, mask)
        if out is not None:
            self._check(seqs)
        return out


class FaultyMatcher:
    """An xgrammar matcher that raises as its sequence's 3rd token is accepted."""

    def __init__(self, matcher, seq):
        self.inner, self.seq = matcher, seq

    def accept_token(self, token):
        if self.seq.num_output_tokens == 2:
            raise RuntimeError("injected grammar fault")
        return self.inner.accept_token(token)

    def __getattr__(self, name):
        return getattr(self.inner, name)


REQUESTS = {"plain": ("The cat", SamplingParams(temperature=0, max_tokens=30)),
            "regex": ("Tom had a big red ball",
                      SamplingParams(temperature=0, max_tokens=80, structured_outputs=SO(regex=REGEX))),
            "culprit": ("Once upon a time", SamplingParams(temperature=0, max_tokens=80,
                                                           structured_outputs=SO(choice=CHOICES)))}


def _run_requests(eng):
    outs = run(eng, REQUESTS)  # tests/test_failures.py: each request finishes once
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    return outs


@pytest.fixture(scope="module")
def reference():
    return _run_requests(LLM("stories260K", block_size=8, seed=1, device="cpu").engine)


def _faulty_batch(monkeypatch, refuse):
    """The batched accept (batch_calls.py) of a batch holding the culprit's row as it accepts
    its 3rd token: with `refuse`, xgrammar refuses that token (the other rows accept theirs);
    else the call raises after half the rows' matchers have moved, as a C++ error midway would
    leave them."""
    accept = BatchCalls.accept

    def faulty(self, tokens):
        culprit = [k for k, m in enumerate(self.matchers)
                   if isinstance(m, FaultyMatcher) and m.seq.num_output_tokens == 2]
        if not culprit:
            return accept(self, tokens)
        if refuse:
            others = [k for k in range(len(tokens)) if k not in culprit]
            part = BatchCalls([self.matchers[k] for k in others])
            assert not accept(part, [tokens[k] for k in others])
            return culprit
        half = len(tokens) // 2
        accept(BatchCalls(self.matchers[:half]), tokens[:half])
        raise RuntimeError("injected grammar fault")
    monkeypatch.setattr(BatchCalls, "accept", faulty)
    if refuse:
        return
    start, checked = BackgroundFill.start, []

    def replayed(self, *args, **kwargs):  # each kept matcher is in its tokens' state
        import xgrammar as xgr
        mgr, plan = self.manager, self._plan
        for i, st in zip(plan.rows, plan.states) if plan is not None else ():
            fresh = xgr.GrammarMatcher(st.compiled, override_stop_tokens=mgr.eos_token_ids)
            assert all(fresh.accept_token(t) for t in plan.seqs[i].output_token_ids[
                :st.num_accepted])
            assert (st.matcher._debug_print_internal_state()
                    == fresh._debug_print_internal_state())
            checked.append(i)
        return start(self, *args, **kwargs)
    monkeypatch.setattr(BackgroundFill, "start", replayed)
    return checked


@IGNORE_INTERPRETER_WARNINGS
@pytest.mark.parametrize("where", ["sampler", "sampler's kernels", "matcher",
                                   "batched accept raises", "batched accept refuses",
                                   "batched accept raises, batch changed",
                                   "batched accept refuses, batch changed"])
def test_a_fault_in_a_deferred_step_fails_its_request_alone(reference, monkeypatch, where):
    eng = LLM("stories260K", block_size=8, seed=1, device="cpu", async_scheduling=True).engine
    if where.startswith("sampler"):
        if where == "sampler's kernels":  # masks inside the kernels
            eng.sampler = KernelSampler(seed=1, eos_token_ids=eng.eos_token_ids)
        monkeypatch.setattr(eng, "sampler", FaultySampler(eng.sampler, "culprit"))
    else:  # its matcher raises (or refuses) as it accepts the 3rd token (the fill's start)
        mgr = eng.structured_output
        matcher_of = mgr.matcher_of

        def faulty(seq):
            st = matcher_of(seq)
            if seq.request_id == "culprit" and not isinstance(st.matcher, FaultyMatcher):
                st.matcher = FaultyMatcher(st.matcher, seq)
            return st
        monkeypatch.setattr(mgr, "matcher_of", faulty)
        if where.startswith("batched"):  # the batch is the same as the step before's
            checked = _faulty_batch(monkeypatch, refuse="refuses" in where)
            if where.endswith("changed"):  # every step as if the batch had changed: the rows
                advance = BackgroundFill._advance  # that lack only their new token, batched
                monkeypatch.setattr(BackgroundFill, "_advance_same_batch",
                                    lambda self, seqs, plan, just_read, job:
                                    advance(self, seqs, just_read, job))
        else:  # each matcher accepting its tokens one by one (as a row that is behind does)
            advance = BackgroundFill._advance
            monkeypatch.setattr(BackgroundFill, "_advance_same_batch",
                                lambda self, seqs, plan, just_read, job:
                                advance(self, seqs, just_read, job, batched=False))
            monkeypatch.setattr(BackgroundFill, "_advance",
                                lambda self, seqs, just_read, job, batched=True:
                                advance(self, seqs, just_read, job, batched=False))
    outs = _run_requests(eng)
    bad = outs.pop("culprit")
    assert bad.outputs[0].finish_reason == "error"
    assert ("does not allow token" if "refuses" in where else "injected") in bad.error
    # the sampler raises for its 3rd token; the matcher raises as it accepts the 3rd token,
    # read with the step before and appended before that step's error is
    kept = 2 if where.startswith("sampler") else 3
    assert bad.outputs[0].token_ids == reference["culprit"].outputs[0].token_ids[:kept]
    for rid, o in outs.items():
        assert o.outputs[0].token_ids == reference[rid].outputs[0].token_ids
    assert eng.step_loop.pending is None and not eng.has_unfinished_requests()
    if where.startswith("batched accept raises"):  # the other rows' matchers were made again
        assert len(checked) > 10


def test_a_matcher_made_again_while_its_token_is_in_flight_catches_up_first(reference,
                                                                          monkeypatch):
    """A row whose matcher is new while its sequence has tokens (made again, as after a batched
    accept that raised) and its next token has just been read: it must accept the sequence's
    tokens before that one, not join the batched accept of the rows that lack only their new
    token."""
    start, calls = BackgroundFill.start, []

    def forgetting(self, seqs, pin, just_read=None):
        calls.append(just_read is not None)
        if sum(calls) == 6:
            for seq in seqs:
                self.manager.forget(seq)
            self._plan = None
        return start(self, seqs, pin, just_read)
    monkeypatch.setattr(BackgroundFill, "start", forgetting)
    eng = LLM("stories260K", block_size=8, seed=1, device="cpu", async_scheduling=True).engine
    outs = _run_requests(eng)
    assert sum(calls) > 6
    for rid, o in outs.items():
        assert o.outputs[0].token_ids == reference[rid].outputs[0].token_ids, rid


def test_a_worker_that_raises_anything_fails_that_fill_and_the_engine_goes_on(monkeypatch):
    """Even a BaseException (SystemExit here) in the worker's fill ends only the rows of that
    fill: the worker thread lives on, so later steps do not wait for it for ever."""
    calls = []
    fill = background._fill

    def exits_once(mgr, job):
        calls.append(1)
        if len(calls) == 3:
            raise SystemExit("injected")
        return fill(mgr, job)
    monkeypatch.setattr(background, "_fill", exits_once)
    eng = LLM("stories260K", block_size=8, seed=1, device="cpu", async_scheduling=True).engine
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(regex=REGEX))
    first = run(eng, {"first": ("Tom had a big red ball", sp)})["first"]
    assert first.outputs[0].finish_reason == "error" and "injected" in first.error
    again = run(eng, {"again": ("Tom had a big red ball", sp)})["again"]
    (ref,) = LLM("stories260K", block_size=8, seed=1, device="cpu").generate(
        ["Tom had a big red ball"], sp, use_tqdm=False)
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_a_dropped_engine_is_freed_and_its_grammar_worker_ends():
    """The CUDA engine freezes the heap (tests/test_engine.py says why): an engine that ran
    constrained steps under async scheduling must go away by reference counting alone, and its
    worker thread with it."""
    import gc
    import weakref

    from minipaged.worker.gpu_model_runner import freeze_gc_heap
    llm = LLM("stories260K", block_size=8, seed=1, device="cpu", async_scheduling=True)
    llm.generate(["Tom had a big red ball"], SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=SO(regex=REGEX)), use_tqdm=False)
    thread = llm.engine.step_loop.fill._thread
    refs = [weakref.ref(o) for o in (llm.engine, llm.engine.structured_output,
                                     llm.engine.step_loop.fill)]
    gc.disable()
    try:
        freeze_gc_heap()
        del llm
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.unfreeze()
        gc.enable()
    thread.join(5.0)
    assert not thread.is_alive()
