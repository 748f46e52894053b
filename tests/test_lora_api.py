"""Multi-LoRA's API beyond generate (minipaged/lora/): `RequestOutput.lora_request`, the CPU
cache bounded by `max_cpu_loras`, and beam search and n > 1 with adapters.

The adapters and their PEFT references come from tests/test_lora.py's fixtures (random PEFT
adapters with non-zero B on stories260K). Beam search is checked against Hugging Face's own
`generate(num_beams=k)` on the PEFT model: HF's beam rules and PEFT's LoRA, both independent of
minipaged.
"""
from __future__ import annotations

import copy
import shutil

import pytest

from minipaged import LLM, BeamSearchParams, EngineConfig, LoRARequest, SamplingParams
from minipaged.engine.block_usage import check_invariants
from minipaged.lora.manager import cpu_victim
from tests.test_beam_search import hf_beam_search
from tests.test_lora import (N_NEW, PROMPTS, adapters, base_tokens, greedy,  # noqa: F401
                             lora_llm, stories_hf, tokens)

peft = pytest.importorskip("peft")


# --- RequestOutput.lora_request ------------------------------------------------------------------
def test_every_output_carries_its_lora_request(adapters):
    a, b = adapters["all8"][0], adapters["attn4"][0]
    llm = lora_llm()
    loras = [a, None, b]
    outs = llm.generate(PROMPTS, greedy(4), use_tqdm=False, lora_request=loras)
    assert [o.lora_request for o in outs] == loras
    samples = llm.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=3), use_tqdm=False,
                           lora_request=b)
    assert samples[0].lora_request == b and len(samples[0].outputs) == 2
    template = "{{ bos_token }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
    chat = llm.chat([{"role": "user", "content": "Once"}], greedy(3), use_tqdm=False,
                    chat_template=template, lora_request=a)
    assert chat[0].lora_request == a
    # the engine's own outputs, as the server's engine core reads them: streamed ones too
    engine = llm.engine
    engine.stream_outputs = True
    engine.add_request("s", PROMPTS[0], greedy(3), lora_request=a)
    engine.add_request("base", PROMPTS[1], greedy(3))
    engine.add_request("beam", PROMPTS[2], BeamSearchParams(beam_width=2, max_tokens=3),
                       lora_request=b)
    seen = []
    while engine.has_unfinished_requests():
        seen += [(o.request_id, o.finished, o.lora_request) for o in engine.step()]
    want = {"s": a, "base": None, "beam": b}
    assert {rid for rid, finished, _ in seen if not finished} == set(want)  # streamed
    assert all(lora == want[rid] for rid, _, lora in seen)
    plain = LLM("stories260K", num_blocks=32, device="cpu")
    assert plain.generate(PROMPTS[:1], greedy(2), use_tqdm=False)[0].lora_request is None


# --- max_cpu_loras -------------------------------------------------------------------------------
def test_max_cpu_loras_config():
    with pytest.raises(ValueError, match=r"max_cpu_loras must be None or an integer >= 3 "
                                         r"\(max_loras=3.*got 2"):
        EngineConfig(enable_lora=True, max_loras=3, max_cpu_loras=2).validate()
    from minipaged.models.config import ModelConfig
    from minipaged.models.loader import resolve_model
    mc = ModelConfig.from_dict(resolve_model("stories260K").config)
    assert EngineConfig(device="cpu", max_loras=3).resolve(mc).max_cpu_loras == 3  # vLLM's
    assert EngineConfig(device="cpu", max_loras=3, max_cpu_loras=5).resolve(mc).max_cpu_loras == 5


def _watch_cpu_cache(manager) -> list[int]:
    """The CPU cache's size after every read of an adapter folder."""
    sizes: list[int] = []
    read = manager._read

    def watched(req, *keep):
        adapter = read(req, *keep)
        sizes.append(len(manager.adapters))
        return adapter
    manager._read = watched
    return sizes


@pytest.mark.parametrize("max_loras", [1, 2])
def test_cpu_cache_is_bounded_and_rereads_stay_exact(adapters, max_loras):
    llm = lora_llm(max_loras=max_loras, max_cpu_loras=2)
    manager = llm.engine.lora_manager
    sizes = _watch_cpu_cache(manager)
    for name in ("all8", "attn4", "mlp8", "all8"):  # one after another; all8 comes back
        req, expected = adapters[name]
        assert tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False,
                                   lora_request=req)) == expected, name
        assert len(manager.adapters) <= 2
    assert max(sizes) == 2 and manager.num_cpu_evictions >= 2
    assert manager.num_reads == 4  # all8 was dropped, then read again from its folder
    assert list(manager.adapters) == [3, 1]  # mlp8, then the most recently used all8


def test_cpu_cache_of_one_with_three_adapters_in_one_batch(adapters, base_tokens):
    """max_cpu_loras=1: every request's adapter is dropped by the next one's and read again
    when it is scheduled; the tokens stay PEFT's."""
    llm = lora_llm(max_loras=1, max_cpu_loras=1)
    manager = llm.engine.lora_manager
    sizes = _watch_cpu_cache(manager)
    names = ["all8", None, "attn4", "mlp8"]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [adapters[n][0] if n else None for _ in PROMPTS for n in names]
    expected = [adapters[n][1][j] if n else base_tokens[j]
                for j in range(len(PROMPTS)) for n in names]
    assert tokens(llm.generate(prompts, greedy(), use_tqdm=False, lora_request=loras)) == expected
    assert set(sizes) == {1} and manager.num_reads > 3  # re-read at scheduling


def test_cpu_victim_prefers_unneeded_then_slot_copies():
    lru = [1, 2, 3, 4]
    assert cpu_victim(lru, in_slot={1: 0}, live={2}) == 3  # neither in a slot nor waited for
    assert cpu_victim(lru, in_slot={3: 0, 4: 1}, live={1, 2}) == 3  # the slot keeps its copy
    assert cpu_victim(lru, in_slot={}, live={1, 2, 3, 4}) == 1  # read again when scheduled


def test_cpu_cache_keeps_a_waiting_requests_adapter(adapters):
    """Through the engine: the least recently used copy is a waiting request's, so the cache
    drops the copy of the adapter in the slot instead (plain LRU would drop the waited-for one)."""
    (a, want_a), (b, want_b), (c, want_c) = (adapters[n] for n in ("all8", "attn4", "mlp8"))
    llm = lora_llm(max_loras=1, max_cpu_loras=2)
    manager, engine = llm.engine.lora_manager, llm.engine
    llm.generate(PROMPTS[:1], greedy(2), use_tqdm=False, lora_request=a)  # a in the slot
    engine.add_request("b", PROMPTS[0], greedy(), lora_request=b)  # cache: a, b
    engine.add_request("a", PROMPTS[0], greedy(), lora_request=a)  # a used again: b, a
    engine.add_request("c", PROMPTS[0], greedy(), lora_request=c)
    assert list(manager.adapters) == [2, 3] and manager.slot_of == {1: 0}
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert done == {"a": want_a[0], "b": want_b[0], "c": want_c[0]}


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
         "prompt_lookup_min": 1}


@pytest.mark.parametrize("step", [{}, {"async_scheduling": True}, {"speculative_config": NGRAM}],
                         ids=["sync", "async", "speculative"])
def test_dropped_adapter_whose_folder_is_gone_fails_alone(adapters, base_tokens, tmp_path, step):
    """An adapter the CPU cache dropped is read again before its step; its folder is gone, so
    its request fails alone (before the forward) and the others keep their exact tokens."""
    a, b = (LoRARequest(n, i, str(shutil.copytree(adapters[n][0].lora_path, tmp_path / n)))
            for i, n in ((1, "all8"), (2, "attn4")))
    llm = lora_llm(max_loras=1, max_cpu_loras=1, **step)
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], greedy(), lora_request=a)
    engine.add_request("base", PROMPTS[1], greedy())
    engine.add_request("b", PROMPTS[2], greedy(), lora_request=b)  # drops a's copy
    shutil.rmtree(a.lora_path)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert done["a"].outputs[0].finish_reason == "error" and done["a"].outputs[0].token_ids == []
    assert done["a"].error.startswith("ValueError: LoRA adapter 'all8' (lora_int_id=1) was "
                                      "dropped from the CPU cache and cannot be read again: ")
    assert "lora_path is not a folder" in done["a"].error
    assert done["base"].outputs[0].token_ids == base_tokens[1]
    assert done["b"].outputs[0].token_ids == adapters["attn4"][1][2]
    assert any("a" in r.finished for r in llm.trace)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    check_invariants(bm, [])


def test_a_step_whose_only_requests_fail_is_progress(adapters, tmp_path):
    """The failed request was all the step had (the other waits for the slot): the step
    reports it, and the engine does not take the empty step for a stuck scheduler."""
    a = LoRARequest("all8", 1, str(shutil.copytree(adapters["all8"][0].lora_path, tmp_path / "a")))
    llm = lora_llm(max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], greedy(), lora_request=a)
    engine.add_request("b", PROMPTS[2], greedy(), lora_request=adapters["attn4"][0])
    shutil.rmtree(a.lora_path)
    first = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in first] == [("a", "error")]
    assert llm.trace[-1].finished == ["a"] and llm.trace[-1].scheduled == []
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert done == {"b": adapters["attn4"][1][2]}


# --- beam search and n > 1 -----------------------------------------------------------------------
def test_beam_search_with_adapters_equals_hf_beams_on_peft(adapters, stories_hf):
    """Three prompts with two adapters and the base model, one slot: the beams of an adapter
    wait for it as a group; every beam keeps its prompt's adapter when it forks."""
    names = ["all8", None, "mlp8"]
    llm = lora_llm(max_loras=1)
    params = BeamSearchParams(beam_width=3, max_tokens=N_NEW, ignore_eos=True)
    loras = [adapters[n][0] if n else None for n in names]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params,
                           lora_request=loras)
    for name, ids, out in zip(names, PROMPTS, outs):
        model = stories_hf if name is None else peft.PeftModel.from_pretrained(
            copy.deepcopy(stories_hf), adapters[name][0].lora_path).eval()
        ref = hf_beam_search(model, ids, 3, N_NEW, 1.0, False, -1)  # -1: no EOS at all
        assert [s.tokens[len(ids):] for s in out.sequences] == [r[0] for r in ref], name
        for s, (_, hf_score) in zip(out.sequences, ref):
            assert s.score == pytest.approx(hf_score, rel=1e-5)
    base = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)[0]
    assert base.sequences[0].tokens != outs[0].sequences[0].tokens  # the adapter matters
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_seeded_samples_keep_the_adapter(adapters):
    """n=3 seeded samples of an adapter are the three single requests seeded seed + i with it
    (sample i draws from seed + i): each fork ran the adapter, not the base model."""
    req = adapters["all8"][0]
    llm = lora_llm()

    def sample(n, seed, lora):
        params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=N_NEW,
                                ignore_eos=True)
        out = llm.generate(PROMPTS[:1], params, use_tqdm=False, lora_request=lora)[0]
        return [c.token_ids for c in out.outputs]

    together = sample(3, 11, req)
    assert together == [sample(1, 11 + i, req)[0] for i in range(3)]
    assert together != [sample(1, 11 + i, None)[0] for i in range(3)]
