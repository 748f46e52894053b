"""Engine behaviour: stop conditions, aborts, logprobs, chat, request errors and config errors."""
import math

import pytest
import torch

from minipaged import LLM, LLMEngine, EngineConfig, RequestError, SamplingParams
from minipaged.engine.block_usage import check_invariants
from minipaged.models.loader import resolve_model
from minipaged.worker.wrapper import innermost


@pytest.fixture(scope="module")
def llm():
    return LLM("stories260K", block_size=8, num_blocks=256)


def test_text_prompt_and_greedy_text(llm):
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12),
                       use_tqdm=False)[0]
    assert out.prompt == "Once upon a time"
    assert out.outputs[0].text == ", there was a little girl named Lily. She"
    assert out.outputs[0].finish_reason == "length"
    assert out.finished


def test_stop_string_trims_text(llm):
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40,
                                                          stop=["Lily"]), use_tqdm=False)[0]
    assert out.outputs[0].text == ", there was a little girl named "
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == "Lily"
    kept = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop="Lily",
                                                           include_stop_str_in_output=True),
                        use_tqdm=False)[0]
    assert kept.outputs[0].text.endswith("named Lily")


def test_stop_token_ids(llm):
    # 426 is "." : the greedy story stops at the end of its first sentence.
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40,
                                                          stop_token_ids=[426]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids[-1] == 426
    assert 426 not in out.outputs[0].token_ids[:-1]
    assert out.outputs[0].stop_reason == 426


@pytest.fixture(scope="module")
def period_is_eos_model(tmp_path_factory):
    """stories260K greedy never writes EOS within 500 tokens, so declare "." (id 426) the EOS."""
    import json
    import shutil
    src = resolve_model("stories260K").path
    dst = tmp_path_factory.mktemp("eos") / "hf"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["eos_token_id"] = 426
    (dst / "config.json").write_text(json.dumps(cfg))
    return LLM(str(dst), num_blocks=128)


def test_eos_stops_and_ignore_eos_continues(period_is_eos_model):
    llm = period_is_eos_model
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=50),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == ", there was a little girl named Lily."
    assert out.token_ids[-1] == 426 and out.finish_reason == "stop" and out.stop_reason is None
    more = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=20,
                                                           ignore_eos=True), use_tqdm=False)[0]
    assert len(more.outputs[0].token_ids) == 20 and more.outputs[0].finish_reason == "length"
    assert more.outputs[0].token_ids[:len(out.token_ids)] == out.token_ids
    banned = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=20,
                                                             min_tokens=20), use_tqdm=False)[0]
    assert 426 not in banned.outputs[0].token_ids


def test_generation_stops_at_max_model_len():
    llm = LLM("stories260K", max_model_len=32, num_blocks=64)
    out = llm.generate([[1, 403, 407]], SamplingParams(temperature=0, max_tokens=100,
                                                       ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 32 - 3
    assert out.outputs[0].finish_reason == "length"


def test_logprobs(llm):
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    total = 0.0
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the top token
        assert len(lp) == 3
        assert all(v.logprob <= 0 for v in lp.values())
        total += lp[tok].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)
    plain = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5),
                         use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_seeded_sampling_reproducible_across_batches(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234)
    alone = llm.generate("Once upon a time", sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=15)] * 3
    batch = llm.generate(["Tom had a ball", "Once upon a time", "The sun", "A dog"],
                         [others[0], sp, others[1], others[2]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_abort_frees_blocks():
    llm = LLM("stories260K", block_size=8, num_blocks=128, enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request("a", "Once upon a time", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("b", "Tom had a big red ball", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.block_manager.num_free_blocks < 128
    eng.abort_request("a")
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.num_free_blocks == 128
    check_invariants(eng.block_manager, [])


def test_prompt_too_long_fails_alone_and_engine_keeps_serving():
    llm = LLM("stories260K", max_model_len=64, num_blocks=64)
    with pytest.raises(RequestError) as e:
        llm.generate([[1] * 80, [1, 403]], SamplingParams(max_tokens=4), use_tqdm=False)
    msg = str(e.value)
    assert "80 tokens" in msg and "max_model_len is 64" in msg and "at most 63" in msg
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == 64
    out = llm.generate([[1, 403]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_engine_request_error_leaves_others_running():
    eng = LLM("stories260K", max_model_len=64, num_blocks=64).engine
    eng.add_request("good", [1, 403, 407], SamplingParams(max_tokens=6, ignore_eos=True))
    eng.step()
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.add_request("bad", [1, 9999], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request("good", [1, 5], SamplingParams(max_tokens=4))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs] == ["good"] and len(outs[0].outputs[0].token_ids) == 6


def test_chat_without_template_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_chat_with_template(llm):
    template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    out = llm.chat([{"role": "user", "content": " Once upon a time"}],
                   SamplingParams(temperature=0, max_tokens=5), chat_template=template,
                   use_tqdm=False)[0]
    assert out.prompt_token_ids == [1, 403, 407, 261, 378]  # one BOS, from the template
    assert out.outputs[0].token_ids == [432, 383, 286, 261, 376]


# --- configuration errors that teach ----------------------------------------------------------

def test_max_model_len_above_position_embeddings():
    with pytest.raises(ValueError) as e:
        LLM("stories260K", max_model_len=4096)
    assert "max_model_len=4096" in str(e.value) and "max_position_embeddings=512" in str(e.value)


def test_kv_cache_too_small_names_the_numbers_and_knobs():
    with pytest.raises(ValueError) as e:
        LLM("stories260K", num_blocks=10, block_size=16)  # 160 slots < 512 tokens
    msg = str(e.value)
    assert "max_model_len=512" in msg
    assert "The largest max_model_len that fits is 160" in msg
    for knob in ("gpu_memory_utilization", "max_model_len", "num_blocks"):
        assert knob in msg
    assert "GiB" in msg and "1280 bytes per token" in msg


def test_kv_cache_memory_budget_sizes_the_cache():
    llm = LLM("stories260K", kv_cache_memory=1280 * 16 * 100, block_size=16)
    assert llm.engine.num_blocks == 100
    assert llm.engine.kv_cache.shape == (5, 2, 100, 16, 4, 8)


def test_chunked_prefill_off_needs_budget():
    with pytest.raises(ValueError, match="max_num_batched_tokens=100 is smaller than max_model_len=512"):
        LLM("stories260K", enable_chunked_prefill=False, max_num_batched_tokens=100)


@pytest.mark.parametrize("kw, match", [
    (dict(block_size=12), "power of two"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(attention_backend="flash"), "attention_backend must be"),
])
def test_bad_engine_args(kw, match):
    with pytest.raises(ValueError, match=match):
        LLM("stories260K", **kw)


def test_unknown_builtin_location_is_explained(monkeypatch, tmp_path):
    import huggingface_hub.constants
    import minipaged.models.source as source
    monkeypatch.setattr(source, "model_search_path", lambda: [tmp_path / "nowhere"])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never fetch here
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("stories260K")
    assert str(tmp_path / "nowhere") in str(e.value) and "MINIPAGED_MODEL_PATH" in str(e.value)


def test_dummy_preset_loads_with_right_shapes():
    eng = LLMEngine(EngineConfig(model="dummy:qwen3-0.6b", dtype="float32", max_model_len=64,
                                 num_blocks=8, device="cpu"))
    cfg = eng.model_config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (28, 16, 8, 128)
    assert cfg.qk_norm and cfg.tie_word_embeddings
    n_params = sum(p.numel() for p in eng.model.parameters())
    assert n_params == cfg.num_parameters()
    assert 0.59e9 < n_params < 0.61e9  # Qwen3-0.6B: 596M parameters with tied embeddings
    with pytest.raises(RequestError, match="no tokenizer"):
        eng.add_request("x", "hello")
    eng.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert torch.isfinite(eng.kv_cache).all()


def test_incremental_detokenization_matches_full_decoding(llm):
    """Streaming text is built a few tokens at a time; it must always be a prefix of (and at
    the end equal to) decoding the whole output at once, also when a character arrives as
    several byte-fallback tokens (stories260K: ids 3..258 are the bytes <0x00>..<0xFF>)."""
    import random

    from minipaged.engine.output import detokenize, detokenize_incrementally
    from minipaged.engine.sequence import Sequence
    tok = llm.get_tokenizer()
    byte_tokens = {ch: [3 + b for b in ch.encode()] for ch in "é→日🙂"}
    assert tok.decode(byte_tokens["é"]) == "é"
    rng = random.Random(0)
    for trial in range(20):
        prompt = tok("Once upon a time").input_ids if trial % 2 else [1] + [rng.randrange(259, 512)
                                                                           for _ in range(5)]
        seq = Sequence(request_id="x", prompt_token_ids=prompt, sampling_params=SamplingParams())
        seen, held_back = [], 0
        for _ in range(30):
            pieces = ([rng.randrange(259, 512)] if rng.random() < 0.7
                      else byte_tokens[rng.choice(list(byte_tokens))])
            for t in pieces:
                seq.append_token(t)
                detokenize_incrementally(tok, seq)
                assert "\ufffd" not in seq.output_text  # never half a character
                seen.append(seq.output_text)
                held_back += seq.output_text != detokenize(tok, seq.prompt_token_ids,
                                                           seq.output_token_ids, True)
            # every character complete: the streamed text is the whole text
            assert seq.output_text == detokenize(tok, seq.prompt_token_ids, seq.output_token_ids, True)
        assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))  # text only ever grows
        assert held_back > 0  # the multi-byte path was exercised


def test_gpu_model_runner_builds_the_same_step_as_the_lesson_runner():
    """On the GPU the model runner orders each step's batch decodes first, longest context first
    (the attention kernel's load balance), and packs and pads its inputs; logits rows must still
    come back in the scheduler's order and every token must equal the readable runner's."""
    from minipaged.worker.cpu_model_runner import CPUModelRunner
    from minipaged.worker.gpu_model_runner import GPUModelRunner
    from minipaged.worker.model_runner import ModelRunner
    prompts = ["Once upon a time", "The cat sat on the mat and looked at the", "Tom",
               "Lily went to the park with her mom and"]
    sp = [SamplingParams(temperature=0, max_tokens=n) for n in (30, 12, 25, 18)]
    res = []
    for gpu in (False, True):
        llm = LLM("stories260K", max_num_batched_tokens=16, device="cpu")  # chunked prefills mix in
        eng = llm.engine
        assert type(innermost(eng.model_runner)) is CPUModelRunner  # the CPU's choice
        if gpu:
            eng.model_runner = GPUModelRunner(eng.model, eng.kv_cache, eng.backend, 16,
                                              max_num_seqs=256, max_model_len=512,
                                              cuda_graphs=False)
        else:  # the readable runner, the one lesson 03 prints
            eng.model_runner = ModelRunner(eng.model, eng.kv_cache, eng.backend, 16)
        res.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
    assert res[0] == res[1]


@pytest.mark.parametrize("async_scheduling", [False, True])  # the CUDA default is True
def test_dropped_engine_is_freed_by_reference_counting(async_scheduling):
    """On CUDA the engine freezes the heap (`gpu_model_runner.freeze_gc_heap`): objects alive
    then are never walked by the cycle collector again. That is only safe if a dropped engine
    needs no cycle collection to go away: no reference cycle may run through it (async
    scheduling's `step` included)."""
    import gc
    import weakref

    from minipaged.worker.gpu_model_runner import freeze_gc_heap

    llm = LLM("stories260K", block_size=8, num_blocks=64, async_scheduling=async_scheduling)
    llm.generate(["Once upon a time", "Tom had"], SamplingParams(max_tokens=8), use_tqdm=False)
    refs = [weakref.ref(o) for o in (llm.engine, llm.engine.model, llm.engine.scheduler,
                                     llm.engine.block_manager, llm.engine.model_runner)]
    gc.disable()
    try:
        freeze_gc_heap()  # collects what set-up left behind, then freezes, as the CUDA engine does
        del llm
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.unfreeze()
        gc.enable()
