"""Beam search (`LLM.beam_search`, `minipaged/groups/beam_search.py`): token-exact with Hugging Face
`generate(num_beams=k, do_sample=False, length_penalty=..., early_stopping=...)`, and the block
bookkeeping of beams (fork every step, free dropped beams, copy-on-write, no leaks).

stories260K never writes its EOS in these lengths, so the HF comparison uses a copy of it whose
EOS is "." (id 426): sentences end often, which exercises every finishing rule (hypotheses
ending early, length penalties favouring short or long ones, HF's early-stop heuristic).
"""
import json
import shutil

import pytest
import torch

from minipaged import LLM, BeamSearchParams, RequestError
from minipaged.engine.block_usage import check_invariants
from minipaged.models.loader import resolve_model

PERIOD = 426
PROMPTS = ["Once upon a time", "Tom had a big red ball", "The sun", "One day, a little",
           "Lily and her mom went to the park", "He"]


@pytest.fixture(scope="module")
def period_eos_dir(tmp_path_factory):
    dst = tmp_path_factory.mktemp("beam") / "hf"
    shutil.copytree(resolve_model("stories260K").path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["eos_token_id"] = PERIOD
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def hf_model(period_eos_dir):
    from minipaged.lessons.baseline import load_hf_model
    return load_hf_model(str(period_eos_dir))


@pytest.fixture(scope="module")
def llm(period_eos_dir):
    return LLM(str(period_eos_dir), block_size=8, num_blocks=1024)


def hf_beam_search(model, ids, k, max_new_tokens, length_penalty, early_stopping, eos):
    """HF's beams: (generated tokens, score) best first; the EOS, if any, included."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), num_beams=k,
                             num_return_sequences=k, do_sample=False,
                             max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                             early_stopping=early_stopping, pad_token_id=0, eos_token_id=eos,
                             return_dict_in_generate=True, output_scores=True)
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [(out.sequences[i, len(ids):len(ids) + n].tolist(), float(out.sequences_scores[i]))
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_token_exact_with_hf(llm, hf_model, early_stopping):
    tok = llm.get_tokenizer()
    prompts = [tok(p).input_ids for p in PROMPTS]
    stops = 0
    for k, length_penalty in [(2, 1.0), (3, 0.0), (4, 2.0), (4, -1.0), (6, 1.0)]:
        params = BeamSearchParams(beam_width=k, max_tokens=24, length_penalty=length_penalty,
                                  early_stopping=early_stopping)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for ids, out in zip(prompts, outs):
            ref = hf_beam_search(hf_model, ids, k, 24, length_penalty, early_stopping, PERIOD)
            mine = [(s.tokens[len(ids):], s.score) for s in out.sequences]
            assert [m[0] for m in mine] == [r[0] for r in ref], (k, length_penalty, ids)
            for (_, score), (_, hf_score) in zip(mine, ref):
                assert score == pytest.approx(hf_score, rel=1e-5)
            scores = [s.score for s in out.sequences]
            assert scores == sorted(scores, reverse=True)
            stops += sum(s.finish_reason == "stop" for s in out.sequences)
    assert stops > 0, "no hypothesis ended in EOS: the test would not test the finishing rules"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    check_invariants(bm, [])


@pytest.mark.parametrize("early_stopping", [True, False])
def test_width_one_is_greedy(llm, hf_model, early_stopping):
    """The documented difference: HF's num_beams=1 is greedy search; our width 1 follows the
    beam rules, which give the same tokens unless early_stopping="never" (beam_search.py)."""
    tok = llm.get_tokenizer()
    for text in PROMPTS:
        ids = tok(text).input_ids
        x = torch.tensor([ids])
        with torch.no_grad():
            greedy = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                       max_new_tokens=24, pad_token_id=0,
                                       eos_token_id=PERIOD)[0, len(ids):].tolist()
        if PERIOD in greedy:
            greedy = greedy[:greedy.index(PERIOD) + 1]
        out = llm.beam_search([ids], BeamSearchParams(beam_width=1, max_tokens=24,
                                                      early_stopping=early_stopping))[0]
        assert out.sequences[0].tokens[len(ids):] == greedy


def test_ignore_eos_with_hf_on_the_real_model(hf_model):
    llm = LLM("stories260K", block_size=16, num_blocks=256)
    ids = llm.get_tokenizer()("Lily and her mom").input_ids
    out = llm.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=16, ignore_eos=True))[0]
    ref = hf_beam_search(hf_model, ids, 3, 16, 1.0, False, -1)  # -1: no EOS at all
    assert [s.tokens for s in out.sequences] == [ids + r[0] for r in ref]
    best = out.sequences[0]
    assert best.text.startswith("Lily and her mom") and best.finish_reason == "length"
    assert len(best.logprobs) == 16
    assert best.cum_logprob == pytest.approx(sum(d[t].logprob for d, t in
                                                 zip(best.logprobs, best.tokens[len(ids):])),
                                             abs=1e-4)
    assert best.score == pytest.approx(best.cum_logprob / 16, rel=1e-6)


def test_beams_fork_free_and_copy_on_write_every_step():
    llm = LLM("stories260K", block_size=4, num_blocks=256, max_model_len=128,
              enable_prefix_caching=False)
    eng, bm = llm.engine, llm.engine.block_manager
    prompt = llm.get_tokenizer()("Once upon a time there").input_ids  # 6 tokens
    eng.add_request("b", prompt, BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))
    shared_steps = copies = 0
    while eng.has_unfinished_requests():
        eng.step()
        check_invariants(bm, [s.seq_id for s in eng.scheduler.running])
        group = eng.groups.get("b")
        if group is None:
            break
        tables = [bm.block_tables[s.seq_id] for s in group.seqs]
        assert len(tables) == 4 and len(eng.scheduler.running) == 4
        # every live beam holds the prompt's first full block, shared by all
        assert len({t[0] for t in tables}) == 1 and bm.allocator.blocks[tables[0][0]].ref_count == 4
        shared_steps += eng.trace[-1].num_blocks_saved_by_sharing > 0
        copies += eng.trace[-1].num_cow_copies
        lengths = {s.num_tokens for s in group.seqs}
        assert len(lengths) == 1, "beams advance in lockstep"
    assert shared_steps >= 10 and copies > 0
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_beam_search_frees_blocks():
    llm = LLM("stories260K", block_size=4, num_blocks=128, max_model_len=128)
    eng = llm.engine
    eng.add_request("b", [1, 403, 407, 261, 378], BeamSearchParams(beam_width=3, max_tokens=30,
                                                                  ignore_eos=True))
    for _ in range(5):
        eng.step()
    assert len(eng.groups["b"].seqs) == 3
    eng.abort_request("b")
    assert not eng.has_unfinished_requests() and eng.scheduler.num_reserved_seats == 0
    assert eng.block_manager.num_free_blocks == 128
    check_invariants(eng.block_manager, [])


def test_beam_search_params_and_errors():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="temperature=0"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    llm = LLM("stories260K", block_size=8, num_blocks=64)
    with pytest.raises(RequestError, match="may need 72 KV blocks") as e:
        llm.beam_search([[1, 403]], BeamSearchParams(beam_width=4, max_tokens=140))
    assert "the cache has 64" in str(e.value)
    assert not llm.engine.has_unfinished_requests()
