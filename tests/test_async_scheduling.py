"""Async scheduling (async_sched/step_loop.py): step t+1 is planned before step t's tokens are
read.

On the GPU this hides the host's work behind the forward (tests/test_gpu.py runs it there, as the
CUDA default); here it runs on the CPU, forced on, where only its logic matters: every request
must end exactly as with synchronous steps, the host's sequences hold only tokens it has read,
and nothing unread leaks into outputs, prefix-cache hashes or the block pool.
"""
import json
import random
import shutil

import pytest

from minipaged import LLM, SamplingParams
from minipaged.engine.block_usage import check_invariants
from minipaged.models.loader import resolve_model


def _run(async_scheduling, prompts, params, **kw):
    llm = LLM("stories260K", async_scheduling=async_scheduling, block_size=8, seed=1, device="cpu",
              **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    check_invariants(eng.block_manager, [])  # every block back, ref counts exact
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             o.outputs[0].stop_reason) for o in outs], eng


def _mixed_workload():
    rng = random.Random(0)
    prompts = ["Once upon a time", "Lily went to the park", "The cat", "Tom had a big red ball"] * 5
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 60)) for _ in range(8)]
    params += [SamplingParams(temperature=0.8, seed=i, max_tokens=40) for i in range(6)]
    params += [SamplingParams(temperature=0, max_tokens=60, stop=["the"]) for _ in range(3)]
    params += [SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[426],
                              min_tokens=3) for _ in range(3)]
    return prompts, params


@pytest.mark.parametrize("kw", [
    {},  # everything fits
    {"num_blocks": 24, "max_model_len": 96},  # preemption (recompute) and readmission
    {"num_blocks": 24, "max_model_len": 96, "preemption_mode": "swap"},
    {"max_num_batched_tokens": 16},  # chunked prefills between the decodes
])
def test_async_equals_sync(kw):
    prompts, params = _mixed_workload()
    sync, _ = _run(False, prompts, params, **kw)
    asyn, eng = _run(True, prompts, params, **kw)
    assert asyn == sync
    if "num_blocks" in kw:
        assert eng.scheduler.num_preemptions > 0  # the case under test really happened


def _token_ids(path, text):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))(text).input_ids


def test_async_with_eos_and_max_model_len(tmp_path):
    """EOS read a step late: the extra token computed meanwhile is dropped, not returned."""
    src = resolve_model("stories260K").path
    shutil.copytree(src, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["eos_token_id"] = 426  # "." ends the story
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    long = "Once upon a time, there was a little girl named Lily. She loved to play outside"
    prompts = ["Once upon a time", "The dog", long, "Lily and Tom"]
    params = SamplingParams(temperature=0, max_tokens=200)
    res = []
    for a in (False, True):
        n_long = len(_token_ids(tmp_path / "hf", long))
        llm = LLM(str(tmp_path / "hf"), async_scheduling=a, max_model_len=n_long + 3,
                  num_blocks=64, device="cpu")
        outs = llm.generate(prompts, params, use_tqdm=False)
        res.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    assert res[0] == res[1]
    reasons = {r for _, r in res[1]}
    assert reasons == {"stop", "length"}  # EOS stops some, max_model_len the others
    assert all(0 <= t < 512 for ids, _ in res[1] for t in ids)  # real tokens only


def test_async_falls_back_for_groups_logprobs_and_penalties():
    """n > 1, logprobs and penalties need their tokens at once: those steps run synchronously."""
    prompts = ["Once upon a time", "The cat", "Lily went"]
    params = [SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=20),
              SamplingParams(temperature=0, logprobs=2, max_tokens=20),
              SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=20)]
    res = []
    for a in (False, True):
        llm = LLM("stories260K", async_scheduling=a, device="cpu")
        outs = llm.generate(prompts + ["Tom"], params + [SamplingParams(temperature=0)],
                            use_tqdm=False)
        res.append([[(c.token_ids, c.text, c.logprobs) for c in o.outputs] for o in outs])
    assert res[0] == res[1]


def test_async_prefix_cache_hashes_only_real_tokens():
    """Full blocks are published to the prefix cache only once their tokens are known."""
    llm = LLM("stories260K", async_scheduling=True, block_size=4, device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=30)
    first = llm.generate("Once upon a time", sp, use_tqdm=False)[0]
    # The whole first conversation (prompt + output) as a new prompt hits the cached blocks.
    again = llm.generate([first.prompt_token_ids + first.outputs[0].token_ids[:-1]], sp,
                         use_tqdm=False)[0]
    assert again.num_cached_tokens >= 4 * ((len(first.prompt_token_ids) + 28) // 4) - 4
    vocab = llm.engine.model_config.vocab_size
    for block in llm.engine.block_manager.allocator.blocks:
        assert all(0 <= t < vocab for t in block.token_ids)  # real tokens only


def test_async_abort_while_a_token_is_pending():
    llm = LLM("stories260K", async_scheduling=True, num_blocks=64, device="cpu")
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=50)
    eng.add_request("a", "Once upon a time", sp)
    eng.add_request("b", "The cat", sp)
    for _ in range(4):
        eng.step()
    assert eng.step_loop.pending is not None
    assert eng.scheduler.in_flight  # the host holds true tokens; the unread ones are counted
    eng.abort_request("a")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == ["b"]
    ref = LLM("stories260K", async_scheduling=False, device="cpu").generate("The cat", sp, use_tqdm=False)[0]
    assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_async_streaming_text_matches_final_text():
    llm = LLM("stories260K", async_scheduling=True, device="cpu")
    eng = llm.engine
    eng.stream_outputs = True
    eng.add_request("s", "Once upon a time", SamplingParams(temperature=0, max_tokens=25))
    texts = []
    while eng.has_unfinished_requests():
        texts += [o.outputs[0].text for o in eng.step()]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw"[:len(texts[-1])]
    assert len(texts) == 25


def test_async_no_pending_step_left_once_every_request_stopped():
    """A request stopped by a token read late (stop string, EOS) was already in the next step;
    that step's tokens belong to nobody, so generate() leaves no work behind."""
    llm = LLM("stories260K", async_scheduling=True, device="cpu")
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=50,
                                                          stop=["park"]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert eng.step_loop.pending is None
    steps = len(eng.trace)
    assert eng.step() == [] and len(eng.trace) == steps  # nothing left to run or read


@pytest.mark.parametrize("blocks", [2, 3])
def test_async_publishes_the_last_full_block_like_sync(blocks):
    """A request ending by length whose last computed token fills a block: that block reaches the
    prefix cache in async mode too (its token is known only when read, a step late)."""
    cached = []
    for a in (False, True):
        llm = LLM("stories260K", async_scheduling=a, block_size=4, device="cpu")
        n_prompt = len(llm.engine.tokenize("Once upon a time"))
        # prompt + output = 4 * k + 1 tokens: the last computed one (all but the final token)
        # completes block k.
        sp = SamplingParams(temperature=0, max_tokens=4 * (n_prompt // 4 + blocks) + 1 - n_prompt)
        first = llm.generate("Once upon a time", sp, use_tqdm=False)[0]
        again = llm.generate([first.prompt_token_ids + first.outputs[0].token_ids], sp,
                             use_tqdm=False)[0]
        cached.append(again.num_cached_tokens)
    assert cached[1] == cached[0]


def test_async_min_tokens_bans_by_the_true_output_count():
    """min_tokens bans EOS / stop ids by the output count; with a token in flight the host's
    count is one short, so those steps are read synchronously. Stop id g[k] with min_tokens=k
    (g[k] unseen before): the ban never bites, and the request must stop right at g[k]."""
    prompt = "Once upon a time"
    free = _run(False, [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    g = free[0][0]
    k = next(i for i in range(3, len(g)) if g[i] not in g[:i])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, min_tokens=k,
                            stop_token_ids=[g[k]])
    sync, _ = _run(False, [prompt], params)
    asynchronous, _ = _run(True, [prompt], params)
    assert sync[0][0] == g[:k + 1] and sync[0][2] == "stop"
    assert asynchronous == sync
