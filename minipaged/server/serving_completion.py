"""`POST /v1/completions`: prompt(s) in, text out, whole or streamed. Lesson 07 explains it;
the shared steps (checks, SamplingParams, events) are in serving_engine.py."""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minipaged.engine.sequence import Sequence
from minipaged.server.request_stream import RequestStream
from minipaged.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                       CompletionResponse, random_id)
from minipaged.server.serving_engine import (OpenAIError, OpenAIServing, SSEResponse, check_text,
                                             finish_fields, run_unless_disconnected, stop_hold,
                                             text_delta)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.model_name(req.model)
        if req.echo:
            raise OpenAIError("echo is not supported by minipaged", param="echo")
        if req.suffix:
            raise OpenAIError("suffix is not supported by minipaged", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("best_of must equal n (minipaged returns every sample)",
                              param="best_of")
        check_text(req.prompt, "prompt")
        prompts = normalize_prompt(req.prompt)
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                                      logprobs_field="logprobs")
        request_id = random_id("cmpl")
        stream = await self.submit(prompts, params, request_id, stream=req.stream, model=model,
                                   priority=req.priority)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._events(stream, req, model, request_id, stop_hold(params),
                                            include_usage))
        return await run_unless_disconnected(raw, self._full(stream, req, model, request_id))

    async def _full(self, stream: RequestStream, req: CompletionRequest, model: str,
                    request_id: str) -> Response:
        await self.collect(stream)
        choices = []
        for ch in self.choices(stream):
            seq = ch.seq
            reason, stop_reason = finish_fields(seq)
            lp = (completion_logprobs(seq, 0, 0) if req.logprobs is not None else None)
            choices.append(CompletionChoice(index=ch.index, text=seq.output_text, logprobs=lp,
                                            finish_reason=reason, stop_reason=stop_reason))
        resp = CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=self.usage(stream))
        return JSONResponse(resp.model_dump(exclude_none=True))

    def _events(self, stream: RequestStream, req: CompletionRequest, model: str,
                request_id: str, hold: int, include_usage: bool) -> AsyncIterator[str]:
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": model}
        return self.stream_events(stream, head, self.choices(stream),
                                  lambda ch: self._chunk(ch, req, hold), include_usage)

    @staticmethod
    def _chunk(ch, req: CompletionRequest, hold: int):
        seq: Sequence = ch.seq
        if ch.done or (seq.num_output_tokens == ch.tokens and not seq.is_finished):
            return None
        finished = seq.is_finished
        delta = text_delta(ch.text, seq.output_text, finished, hold)
        reason, stop_reason = finish_fields(seq)
        chunk = {"index": ch.index, "text": delta, "logprobs": None,
                 "finish_reason": reason, "stop_reason": stop_reason}
        if req.logprobs is not None:
            lp = completion_logprobs(seq, ch.tokens, ch.offset)
            ch.offset += sum(len(t) for t in lp.tokens)
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


def completion_logprobs(seq: Sequence, start: int, offset: int) -> CompletionLogprobs:
    """OpenAI's legacy completions format for tokens[start:]; text offsets continue `offset`."""
    out = CompletionLogprobs()
    for tid, entry in zip(seq.output_token_ids[start:], (seq.logprobs or [])[start:]):
        text = entry[tid].decoded_token or ""
        out.tokens.append(text)
        out.token_logprobs.append(entry[tid].logprob)
        out.top_logprobs.append({lp.decoded_token or "": lp.logprob
                                 for _, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)})
        out.text_offset.append(offset)
        offset += len(text)
    return out
