"""`POST /v1/completions`: prompt(s) in, text out, whole or streamed. Lesson 07 explains it;
the shared steps (checks, SamplingParams, events) are in serving_engine.py.

`echo: true` returns the prompt before the completion, as vLLM does: in each choice's `text`
(a token-id prompt is decoded), and, with `logprobs`, its tokens' log-probabilities first (the
first token's is null: nothing comes before it), which is how an evaluation harness scores a
continuation (lm-evaluation-harness's `local-completions`; docs/guides/evaluation.md). The
engine computes them as prompt logprobs (`SamplingParams.prompt_logprobs`, minipaged/
prompt_logprobs/). `max_tokens: 0` with echo returns the prompt alone: the engine samples one
token, which is dropped. vLLM's `prompt_logprobs` field returns them in vLLM's format too.
"""
from __future__ import annotations

import time
from typing import AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minipaged.engine.sequence import Sequence
from minipaged.sampling import Logprob
from minipaged.server.request_stream import RequestState, RequestStream
from minipaged.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                       CompletionResponse, PromptLogprob, random_id)
from minipaged.server.serving_engine import (OpenAIError, OpenAIServing, SSEResponse, check_text,
                                             finish_fields, run_unless_disconnected, stop_hold,
                                             text_delta)

Entries = list[Optional[dict[int, Logprob]]]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.model_name(req.model)
        if req.suffix:
            raise OpenAIError("suffix is not supported by minipaged", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("best_of must equal n (minipaged returns every sample)",
                              param="best_of")
        if req.max_tokens == 0 and not req.echo:
            raise OpenAIError("max_tokens must be at least 1; 0 is allowed only with echo "
                              "(the prompt alone), got 0", param="max_tokens")
        if req.echo and self.tokenizer is None:
            raise OpenAIError("echo needs the model's tokenizer to write the prompt as text, and "
                              "this model has none (dummy weights?); use prompt_logprobs",
                              param="echo")
        check_text(req.prompt, "prompt")
        prompts = normalize_prompt(req.prompt)
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and req.echo:
            prompt_logprobs = req.logprobs  # the prompt's tokens are in `logprobs` too
        params = self.sampling_params(req, max_tokens=1 if req.max_tokens == 0 else req.max_tokens,
                                      logprobs=req.logprobs, logprobs_field="logprobs",
                                      prompt_logprobs=prompt_logprobs)
        request_id = random_id("cmpl")
        stream = await self.submit(prompts, params, request_id, stream=req.stream, model=model,
                                   priority=req.priority)
        echo = (dict(zip((s.request_id for s in stream.states),
                         (self.prompt_text(p, req.skip_special_tokens) for p in prompts)))
                if req.echo else {})
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._events(stream, req, model, request_id, stop_hold(params),
                                            include_usage, echo))
        return await run_unless_disconnected(raw, self._full(stream, req, model, request_id,
                                                             echo))

    def prompt_text(self, prompt, skip_special_tokens: bool) -> str:
        """The text echo puts first: a text prompt as sent, token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)

    async def _full(self, stream: RequestStream, req: CompletionRequest, model: str,
                    request_id: str, echo: dict[str, str]) -> Response:
        await self.collect(stream)
        states = {s.request_id: s for s in stream.states}
        choices = []
        for ch in self.choices(stream):
            seq, state = ch.seq, states[ch.seq.request_id]
            reason, stop_reason = finish_fields(seq)
            text, ids, entries = completion_part(seq, req.max_tokens == 0)
            lp = None
            if req.logprobs is not None:
                lp = CompletionLogprobs()
                offset = prompt_part(state, lp, 0, self.llm.token_text) if req.echo else 0
                completion_logprobs(ids, entries, offset, self.llm.token_text, lp)
            choices.append(CompletionChoice(
                index=ch.index, text=echo.get(seq.request_id, "") + text, logprobs=lp,
                finish_reason=reason, stop_reason=stop_reason,
                prompt_logprobs=vllm_prompt_logprobs(state) if req.prompt_logprobs is not None
                else None))
        resp = CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=self.usage(stream, prompt_only=req.max_tokens == 0))
        return JSONResponse(resp.model_dump(exclude_none=True))

    def _events(self, stream: RequestStream, req: CompletionRequest, model: str,
                request_id: str, hold: int, include_usage: bool,
                echo: dict[str, str]) -> AsyncIterator[str]:
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": model}
        states = {s.request_id: s for s in stream.states}
        return self.stream_events(
            stream, head, self.choices(stream),
            lambda ch: self._chunk(ch, req, hold, states[ch.seq.request_id],
                                   echo.get(ch.seq.request_id)), include_usage,
            prompt_only=req.max_tokens == 0)

    def _chunk(self, ch, req: CompletionRequest, hold: int, state: RequestState,
               echo: Optional[str]):
        """The choice's news since its last chunk; its first chunk with echo starts with the
        prompt (and its tokens' logprobs)."""
        seq: Sequence = ch.seq
        if ch.done or (seq.num_output_tokens == ch.tokens and not seq.is_finished):
            return None
        finished = seq.is_finished
        prompt_only = req.max_tokens == 0
        if prompt_only and not finished:
            return None  # the one token sampled is dropped: all is sent when it finishes
        delta = "" if prompt_only else text_delta(ch.text, seq.output_text, finished, hold)
        first = echo is not None and ch.tokens == 0 and not ch.text
        reason, stop_reason = finish_fields(seq)
        chunk = {"index": ch.index, "text": (echo if first else "") + delta, "logprobs": None,
                 "finish_reason": reason, "stop_reason": stop_reason}
        if req.logprobs is not None:
            lp = CompletionLogprobs()
            if first:
                ch.offset = prompt_part(state, lp, ch.offset, self.llm.token_text)
            if not prompt_only:
                ch.offset = completion_logprobs(seq.output_token_ids[ch.tokens:],
                                                (seq.logprobs or [])[ch.tokens:], ch.offset,
                                                self.llm.token_text, lp)
            chunk["logprobs"] = lp.model_dump()
        ch.text += delta
        ch.tokens = seq.num_output_tokens
        ch.done = finished
        return chunk


def normalize_prompt(prompt) -> list:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]  # one prompt of token ids
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise OpenAIError("the prompt is empty; give at least one token", param="prompt")
    return prompts


def completion_part(seq: Sequence, prompt_only: bool) -> tuple[str, list[int], Entries]:
    """(text, token ids, logprob entries) of a choice's completion; nothing with max_tokens 0
    (echo: the prompt alone)."""
    if prompt_only:
        return "", [], []
    return seq.output_text, seq.output_token_ids, seq.logprobs or []


def prompt_part(state: RequestState, out: CompletionLogprobs, offset: int,
                token_text: Callable[[int], str]) -> int:
    """Echo: the prompt's tokens into `out` (the first's logprob null); returns the text offset
    after them."""
    entries = state.prompt_logprobs or [None] * len(state.prompt_token_ids)
    return completion_logprobs(state.prompt_token_ids, entries, offset, token_text, out)


def completion_logprobs(token_ids: list[int], entries: Entries, offset: int,
                        token_text: Callable[[int], str], out: CompletionLogprobs) -> int:
    """Append `token_ids` to `out` in OpenAI's legacy completions format, each with its
    {token id: Logprob} entry (None: nothing predicts it, a prompt's first token); text offsets
    continue `offset`. Returns the offset after them."""
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            text = token_text(tid)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            text = entry[tid].decoded_token or ""
            out.token_logprobs.append(entry[tid].logprob)
            out.top_logprobs.append({lp.decoded_token or "": lp.logprob
                                     for _, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)})
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
    return offset


def vllm_prompt_logprobs(state: RequestState) -> list:
    """vLLM's `prompt_logprobs` field: per prompt token {token id: Logprob}, None first."""
    return [None if e is None else {tid: PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                       decoded_token=lp.decoded_token)
                                    for tid, lp in e.items()}
            for e in (state.prompt_logprobs or [])]
