"""`/v1/completions` with `echo` and prompt logprobs, through the official `openai` client.

What an evaluation harness sends to score a continuation (lm-evaluation-harness's
`local-completions`): `echo: true, logprobs: k, max_tokens: 0 or 1`. The prompt comes back
first in `text` and in `logprobs` (its first token's logprob null), with the same values as
the offline engine's `prompt_logprobs` (tests/test_prompt_logprobs.py checks those against HF).
"""
from __future__ import annotations

import openai
import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.lessons.server import InProcessServer
from minipaged.models.loader import load_tokenizer, resolve_model
from tests.helpers import make_tiny_hf_model
from tests.test_server import client, server  # noqa: F401 (the server's fixtures)

PROMPT = "Once upon a time, there was a little girl named Lily. She"


@pytest.fixture(scope="module")
def offline():
    """The prompt's logprobs (top 3) and ids from the offline engine."""
    llm = LLM("stories260K", device="cpu")
    out = llm.generate(PROMPT, SamplingParams(prompt_logprobs=3, max_tokens=1), use_tqdm=False)[0]
    return out.prompt_token_ids, out.prompt_logprobs


def complete(client, **kw):
    kw = {"model": "stories260K", "prompt": PROMPT, "temperature": 0} | kw
    return client.completions.create(**kw)


def test_echo_text_and_logprobs(client, offline):
    ids, prompt_lps = offline
    plain = complete(client, max_tokens=4, logprobs=3).choices[0]
    echo = complete(client, max_tokens=4, logprobs=3, echo=True).choices[0]
    assert echo.text == PROMPT + plain.text and plain.text
    lp = echo.logprobs
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(prompt_lps[i][ids[i]].logprob, abs=1e-5)
        assert len(lp.top_logprobs[i]) >= 3
        assert max(lp.top_logprobs[i].values()) == pytest.approx(
            max(e.logprob for e in prompt_lps[i].values()), abs=1e-5)
    # the completion's part is the one without echo, its offsets after the prompt's tokens
    assert lp.tokens[n:] == plain.logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))


def test_echo_max_tokens_zero_is_the_prompt_alone(client, offline):
    ids, _ = offline
    resp = complete(client, max_tokens=0, logprobs=1, echo=True)
    (choice,) = resp.choices
    assert choice.text == PROMPT
    assert len(choice.logprobs.token_logprobs) == len(ids)
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
    no_logprobs = complete(client, max_tokens=0, echo=True).choices[0]
    assert no_logprobs.text == PROMPT and no_logprobs.logprobs is None


def test_echo_token_id_prompts_and_n(client, offline):
    ids, _ = offline
    resp = complete(client, prompt=[ids[:8], ids], max_tokens=3, echo=True, n=2,
                    temperature=1.0, seed=3, logprobs=0)
    assert len(resp.choices) == 4
    tok = load_tokenizer(resolve_model("stories260K"), None)
    for c in resp.choices:
        prompt = ids[:8] if c.index < 2 else ids
        head = tok.decode(prompt, skip_special_tokens=True)
        assert c.text.startswith(head) and len(c.text) > len(head)
        assert len(c.logprobs.token_logprobs) == len(prompt) + 3
        assert c.logprobs.token_logprobs[0] is None
    assert resp.choices[0].text != resp.choices[1].text  # two samples of the same prompt


def test_echo_streamed_equals_whole(client):
    whole = complete(client, max_tokens=6, logprobs=2, echo=True).choices[0]
    chunks = list(complete(client, max_tokens=6, logprobs=2, echo=True, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.text
    tokens, offsets, lps = [], [], []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
            lps += c.choices[0].logprobs.token_logprobs
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert lps[0] is None and lps[1:] == pytest.approx(whole.logprobs.token_logprobs[1:],
                                                       abs=1e-6)
    zero = list(complete(client, max_tokens=0, logprobs=1, echo=True, stream=True,
                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in zero if c.choices) == PROMPT
    assert zero[-1].usage.completion_tokens == 0


def test_vllm_prompt_logprobs_field(client, offline):
    ids, prompt_lps = offline
    choice = complete(client, max_tokens=1, extra_body={"prompt_logprobs": 2}).choices[0]
    got = choice.model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry = got[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(prompt_lps[i][ids[i]].logprob, abs=1e-5)
        assert entry["rank"] == prompt_lps[i][ids[i]].rank and entry["decoded_token"]
    assert choice.logprobs is None  # echo's logprobs were not asked for


@pytest.mark.parametrize("kw, param", [
    ({"max_tokens": 0}, "max_tokens"),  # without echo
    ({"echo": True, "logprobs": 21}, "logprobs"),  # above --max-logprobs (20)
    ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
])
def test_bad_combinations_are_400s_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, **kw)
    assert e.value.body["param"] == param and param in e.value.body["message"]


def test_echo_needs_a_tokenizer(tmp_path):
    """A model without a tokenizer cannot write a token-id prompt as text: refused by name;
    its prompt logprobs are still there (vLLM's field)."""
    make_tiny_hf_model("llama", tmp_path / "m", dtype=torch.float32)  # no tokenizer saved
    with InProcessServer(str(tmp_path / "m"), "--device", "cpu", "--num-blocks", "64",
                         "--uvicorn-log-level", "warning") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=str(tmp_path / "m"), prompt=[1, 5, 6], echo=True,
                                 max_tokens=1)
        assert e.value.body["param"] == "echo"
        choice = c.completions.create(model=str(tmp_path / "m"), prompt=[1, 5, 6], max_tokens=1,
                                      extra_body={"prompt_logprobs": 0}).choices[0]
        got = choice.model_extra["prompt_logprobs"]
        assert got[0] is None and list(got[2]) == ["6"]
        assert got[2]["6"]["decoded_token"] == "token_id:6"
