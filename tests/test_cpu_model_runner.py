"""The CPU model runner (minipaged/worker/cpu_model_runner.py) against `ModelRunner`.

On a decode-only step it lays the sequences out by context length and builds the step's tensors
with its own code; they must equal what `ModelRunner.prepare_inputs` builds for that order, and
the rows it samples must be the scheduler's sequences in the scheduler's order. The CPU backend
then finds the tokens in length order and reorders nothing (`plan.order` stays None).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from minipaged import LLM, SamplingParams
from minipaged.attention import cpu_backend
from minipaged.attention.cpu_backend import CPUBackend
from minipaged.attention.torch_ref import paged_attention_reference
from minipaged.worker.cpu_model_runner import CPUModelRunner
from minipaged.worker.model_runner import ModelRunner
from minipaged.worker.wrapper import innermost
from tests.helpers import store_and_attend
from tests.test_cpu_backend import make_step

# prompt lengths chosen so that the scheduler's order is not the context-length order
PROMPTS = [[1] + [(7 * i + j) % 500 + 3 for j in range(n)]
           for i, n in enumerate([30, 2, 17, 9, 41, 1, 24, 5])]


def _decode_step(llm):
    """The engine after its prefill step, and the SchedulerOutput of its first decode step."""
    for i, p in enumerate(PROMPTS):
        llm.engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=8))
    llm.engine.step()  # all prompts in one prefill step
    return llm.engine.scheduler.schedule()


def test_cpu_backend_engines_get_the_cpu_runner():
    assert type(innermost(LLM("stories260K").engine.model_runner)) is CPUModelRunner
    llm = LLM("stories260K", attention_backend="torch_ref")
    assert type(innermost(llm.engine.model_runner)) is ModelRunner


def test_decode_inputs_equal_model_runner_in_length_order():
    llm = LLM("stories260K", block_size=8)
    runner = innermost(llm.engine.model_runner)
    sched = _decode_step(llm)
    order = runner.step_order(sched)
    lens = [s.seq.num_computed_tokens for s in order]
    assert lens == sorted(lens) and order != sched.scheduled  # the test needs a reorder
    ids, pos, md, rows = runner.prepare_inputs(sched)
    ref_ids, ref_pos, ref_md, _ = ModelRunner.prepare_inputs(runner,
                                                             replace(sched, scheduled=order))
    assert torch.equal(ids, ref_ids) and torch.equal(pos, ref_pos)
    for name in ("slot_mapping", "block_tables", "context_lens", "cu_seqlens_q"):
        a, b = getattr(md, name), getattr(ref_md, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("query_lens", "context_lens_host", "max_query_len", "max_context_len",
                 "block_size", "num_decode_tokens"):
        assert getattr(md, name) == getattr(ref_md, name), name
    # row r of the logits is the scheduler's r-th sequence: its token in the sorted layout
    assert [order[r] for r in rows] == list(sched.scheduled)


def test_prefill_steps_keep_the_scheduler_order():
    llm = LLM("stories260K", block_size=8)
    for i, p in enumerate(PROMPTS):
        llm.engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=8))
    sched = llm.engine.scheduler.schedule()  # the prefill step
    runner = innermost(llm.engine.model_runner)
    assert runner.step_order(sched) is sched.scheduled
    ids, _, md, rows = runner.prepare_inputs(sched)
    ref_ids, _, ref_md, ref_rows = ModelRunner.prepare_inputs(runner, sched)
    assert torch.equal(ids, ref_ids) and rows == ref_rows
    assert torch.equal(md.slot_mapping, ref_md.slot_mapping)


def test_greedy_tokens_equal_model_runner():
    """The same engine with either runner: the same greedy tokens for every request."""
    llm = LLM("stories260K", block_size=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for cls in (CPUModelRunner, ModelRunner):
        innermost(llm.engine.model_runner).__class__ = cls
        res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        outs[cls] = [o.outputs[0].token_ids for o in res]
    assert outs[CPUModelRunner] == outs[ModelRunner]


def test_backend_reorders_only_unsorted_steps(monkeypatch):
    """Several chunks: sequences already in length order are attended without a reorder (the
    guard in `plan_chunks`); shuffled ones are reordered; both equal the reference."""
    monkeypatch.setattr(cpu_backend, "GATHER_CHUNK_BYTES", 4096)  # several chunks
    for lens, sorted_in in (([1, 3, 8, 9, 17, 25, 40, 64], True),
                            ([40, 3, 64, 9, 1, 25, 8, 17], False)):
        q, k, v, k_cache, v_cache, md = make_step([(1, c) for c in lens], 8, 4, 8)
        backend = CPUBackend()
        backend.prepare(md)
        out = store_and_attend(backend, q, k, v, k_cache, v_cache, md, 1 / math.sqrt(8))
        ref = paged_attention_reference(q, k_cache, v_cache, md, 1 / math.sqrt(8))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)
        assert len(md.plan.chunks) > 1
        assert (md.plan.order is None) == sorted_in


def test_modules_call_forward_directly_and_hooks_still_run():
    """The CPU runner's model: every submodule's __call__ is its forward (direct_calls.py); a
    hook registered afterwards gives the module its usual calls back, and sees each of them."""
    from torch import nn

    from minipaged.worker.direct_calls import call_forward_directly
    llm = LLM("stories260K")
    model = llm.engine.model
    assert type(model) is type(model).__mro__[0] and "__call__" not in vars(type(model))
    mlp = model.model.layers[2].mlp
    assert type(mlp).__call__ is type(mlp).forward
    assert isinstance(mlp, nn.Module) and type(mlp).__name__ == "LlamaMLP"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
    seen = []
    handle = mlp.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    after = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
    assert len(seen) == 6  # one prefill step and five decode steps, each seen by the hook
    assert [o.outputs[0].token_ids for o in before] == [o.outputs[0].token_ids for o in after]
    handle.remove()
    # a module hooked before the conversion keeps its usual calls
    layer = nn.Linear(4, 4)
    layer.register_forward_pre_hook(lambda m, i: seen.append("pre"))
    parent = nn.Sequential(layer, nn.ReLU())
    call_forward_directly(parent)
    parent(torch.ones(1, 4))
    assert seen[-1] == "pre" and type(parent[1]).__call__ is nn.ReLU.forward


def test_member_copies_stay_true():
    """Each converted module finds its parameters, buffers and submodules in its __dict__; the
    copies follow assignment, deletion and `.to()`, and a hook drops them with the subclass."""
    from torch import nn

    from minipaged.worker.direct_calls import call_forward_directly
    inner = nn.Linear(3, 2)
    inner.register_buffer("scale", torch.ones(2))
    outer = nn.Sequential(nn.Sequential(inner))
    call_forward_directly(outer)
    assert inner.__dict__["weight"] is inner._parameters["weight"]
    assert inner.__dict__["scale"] is inner._buffers["scale"]
    x = torch.ones(1, 3)
    torch.testing.assert_close(outer(x), x @ inner.weight.t() + inner.bias)
    inner.bias = nn.Parameter(torch.full((2,), 5.0))  # a new Parameter
    inner.scale = torch.full((2,), 3.0)  # a tensor into an existing buffer: only _buffers
    assert inner.scale is inner._buffers["scale"] and float(inner.scale[0]) == 3.0
    inner.weight = None  # an existing parameter set to None: only _parameters
    assert inner.weight is None
    inner.weight = nn.Parameter(torch.zeros(2, 3))
    torch.testing.assert_close(outer(x), torch.full((1, 2), 5.0))
    outer.double()  # _apply puts new buffers in _buffers
    assert inner.scale.dtype == torch.float64 and inner.scale is inner._buffers["scale"]
    assert inner.weight.dtype == torch.float64
    del inner.scale
    assert "scale" not in inner.__dict__ and not hasattr(inner, "scale")
    inner.register_forward_hook(lambda m, i, o: None)  # back to nn.Linear, copies dropped
    assert type(inner) is nn.Linear and "weight" not in inner.__dict__
    assert outer(x.double()).dtype == torch.float64
