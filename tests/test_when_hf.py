"""Lesson 08, section 4 (minipaged/lessons/when_hf.py): the measurements behind "when plain HF is
the better tool". Timings are not asserted (they belong to the lesson); what is: the single
request gives HF's tokens, and a forward hook sees one request by position in HF and the step's
flat batch in minipaged."""
import torch

from minipaged import LLM
from minipaged.lessons import when_hf
from minipaged.lessons.baseline import load_hf_model


def test_one_request_and_hook_captures():
    torch.set_num_threads(1)
    llm = LLM("stories260K", max_model_len=256)
    hf = load_hf_model(str(llm.engine.source.path))
    tok = llm.get_tokenizer()
    a, b = tok("Once upon a time").input_ids, tok("Tom liked to").input_ids
    one = when_hf.one_request_seconds(llm, hf, a, max_tokens=8, repeats=1)
    assert one.same_tokens and one.hf_s > 0 and one.minipaged_s > 0
    h, m = when_hf.hook_captures(llm, hf, [a, b], max_tokens=3)
    hidden = llm.engine.model_config.hidden_size
    assert h.shapes == [(1, len(a), hidden)] + [(1, 1, hidden)] * 2
    assert m.shapes == [(len(a) + len(b), hidden)] + [(2, hidden)] * 2
    st = when_hf.startup_seconds("stories260K", str(llm.engine.source.path), repeats=1,
                                 max_model_len=256)
    assert st.hf_s > 0 and st.minipaged_s > 0
