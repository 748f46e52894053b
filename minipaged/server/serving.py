"""OpenAI requests in, engine requests out, and back: `/v1/completions` and `/v1/chat/completions`.
Lesson 07 explains it.

For every HTTP request `OpenAIServing`:

1. checks the model name and the fields minipaged cannot honour (400/404 in OpenAI's error shape);
2. turns the body into `SamplingParams`, one per choice: `n` > 1 becomes n independent engine
   requests, the i-th with `seed + i` when a seed is given (so the n choices differ but the whole
   response is reproducible); prefix caching shares the prompt's KV blocks between them;
3. for chat, renders the messages with the chat template into one prompt string;
4. submits to the `AsyncLLMEngine` and either collects the final outputs into one JSON response,
   or streams server-sent events: `data: {chunk}\\n\\n` per engine step, then `data: [DONE]`.

Streaming sends the *new* text of each step. Two things are held back until they are certain:
a trailing "\\ufffd" (half of a multi-byte character whose other bytes come in the next token) and,
when `stop` strings are set, the last `len(longest stop) - 1` characters (they might be the start
of a stop string, which must never reach the client).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minipaged.engine.llm_engine import RequestError
from minipaged.engine.output import RequestOutput
from minipaged.sampling import SamplingParams
from minipaged.server.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream, TextPrompt
from minipaged.server.protocol import (
    ChatChoice, ChatChoiceLogprobs, ChatCompletionRequest, ChatCompletionResponse,
    ChatCompletionStreamResponse, ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob,
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
    CompletionStreamChoice, CompletionStreamResponse, DeltaMessage, ErrorInfo, ErrorResponse,
    SamplingFields, TopLogprob, UsageInfo, random_id)
from minipaged.server.reasoning import ThinkTagReasoningParser


class OpenAIError(Exception):
    """Becomes `{"error": {"message", "type", "param", "code"}}` with this HTTP status."""

    def __init__(self, message: str, status: int = 400, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str | int] = None):
        super().__init__(message)
        self.message, self.status, self.type = message, status, type
        self.param, self.code = param, code

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status)


def error_event(message: str, type: str = "server_error") -> str:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type))
    return f"data: {body.model_dump_json()}\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events. Closes the body generator however the response ends, so its `finally`
    (which aborts unfinished engine requests) runs at once when a client disconnects."""

    media_type = "text/event-stream"

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


async def run_unless_disconnected(request: Request, coro) -> Response:
    """Run a non-streaming handler, but cancel it (and so abort its engine requests) if the
    client hangs up first: ASGI signals that with an `http.disconnect` message."""
    task = asyncio.ensure_future(coro)

    async def wait_for_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    return Response(status_code=499)  # nobody is listening; 499 is nginx's "client closed"


def text_delta(sent: str, text: str, finished: bool, hold: int) -> str:
    """The part of `text` (the output so far) not yet sent, minus what must be held back."""
    if not finished:
        end = max(len(text) - hold, 0)
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        text = text[:end]
    return text[len(sent):] if text.startswith(sent) and len(text) > len(sent) else ""


def _stop_hold(params: SamplingParams) -> int:
    if params.stop and not params.include_stop_str_in_output:
        return max(len(s) for s in params.stop) - 1
    return 0


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 chat_template: Optional[str] = None,
                 reasoning_parser: Optional[type[ThinkTagReasoningParser]] = None,
                 max_logprobs: int = 20):
        self.engine = engine
        self.served_model_names = served_model_names
        self.chat_template = chat_template
        self.reasoning_parser = reasoning_parser
        self.max_logprobs = max_logprobs

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.config.max_model_len

    # --- shared checks ----------------------------------------------------------------------
    def model_name(self, requested: Optional[str]) -> str:
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise OpenAIError(f"The model `{requested}` does not exist. This server serves: "
                              f"{', '.join(self.served_model_names)} (see GET /v1/models).",
                              404, param="model", code="model_not_found")
        return requested

    def sampling_params(self, req: SamplingFields, *, max_tokens: Optional[int],
                        logprobs: Optional[int]) -> list[SamplingParams]:
        """One SamplingParams per choice (n of them), seeds derived as seed + i."""
        if req.logit_bias:
            raise OpenAIError("logit_bias is not supported by minipaged", param="logit_bias")
        if logprobs is not None and logprobs > self.max_logprobs:
            raise OpenAIError(f"at most {self.max_logprobs} logprobs per token, got {logprobs}",
                              param="logprobs")
        if req.stop and self.tokenizer is None:
            raise OpenAIError("stop strings need a tokenizer to detokenize the output, and this "
                              "model has none; use stop_token_ids", param="stop")
        params = []
        for i in range(req.n):
            try:
                params.append(SamplingParams(
                    n=1, temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=req.top_k or 0, min_p=req.min_p or 0.0,
                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                    repetition_penalty=(1.0 if req.repetition_penalty is None
                                        else req.repetition_penalty),
                    seed=None if req.seed is None else req.seed + i,
                    stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                    max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
                    skip_special_tokens=req.skip_special_tokens,
                    include_stop_str_in_output=req.include_stop_str_in_output))
            except ValueError as e:  # SamplingParams' own checks say what is wrong and why
                field = str(e).split(" ", 1)[0]
                raise OpenAIError(str(e), param=field if field in type(req).model_fields
                                  else None) from None
        return params

    async def submit(self, prompts, params, request_id: str) -> RequestStream:
        try:
            return await self.engine.submit(prompts, params, request_id)
        except RequestError as e:  # prompt too long, bad token ids, no tokenizer, ...
            raise OpenAIError(str(e), param="prompt" if "prompt" in str(e) else None) from None
        except EngineDeadError as e:
            raise OpenAIError(str(e), 503, type="server_error") from None

    # --- /v1/completions --------------------------------------------------------------------
    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.model_name(req.model)
        if req.echo:
            raise OpenAIError("echo is not supported by minipaged", param="echo")
        if req.suffix:
            raise OpenAIError("suffix is not supported by minipaged", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("best_of must equal n (minipaged returns every sample)",
                              param="best_of")
        prompts = _normalize_prompt(req.prompt)
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
        # choice index = prompt index * n + sample index, as OpenAI orders them
        request_id = random_id("cmpl")
        stream = await self.submit([p for p in prompts for _ in params], params * len(prompts),
                                   request_id)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._completion_events(stream, req, params, model, request_id,
                                                       include_usage))
        return await run_unless_disconnected(raw, self._completion_full(stream, req, model,
                                                                        request_id))

    async def _completion_full(self, stream: RequestStream, req: CompletionRequest, model: str,
                               request_id: str) -> Response:
        finals = await _collect(stream)
        choices = []
        for i, out in enumerate(finals):
            c = out.outputs[0]
            lp = (_completion_logprobs(c.token_ids, c.logprobs, 0, 0)
                  if req.logprobs is not None else None)
            choices.append(CompletionChoice(index=i, text=c.text, logprobs=lp,
                                            finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason))
        resp = CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=_usage(stream, finals, req.n))
        return JSONResponse(resp.model_dump(exclude_none=True))

    async def _completion_events(self, stream: RequestStream, req: CompletionRequest,
                                 params: list[SamplingParams], model: str, request_id: str,
                                 include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        num = len(stream.request_ids)
        sent_text, sent_tokens, offsets = [""] * num, [0] * num, [0] * num
        finals: list[Optional[RequestOutput]] = [None] * num
        hold = _stop_hold(params[0])
        try:
            async for i, out in stream:
                c = out.outputs[0]
                if len(c.token_ids) == sent_tokens[i] and not out.finished:
                    continue
                delta = text_delta(sent_text[i], c.text, out.finished, hold)
                lp = None
                if req.logprobs is not None:
                    lp = _completion_logprobs(c.token_ids, c.logprobs, sent_tokens[i], offsets[i])
                    offsets[i] += sum(len(t) for t in lp.tokens)
                sent_text[i] += delta
                sent_tokens[i] = len(c.token_ids)
                if out.finished:
                    finals[i] = out
                chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=model,
                    choices=[CompletionStreamChoice(index=i, text=delta, logprobs=lp,
                                                    finish_reason=c.finish_reason,
                                                    stop_reason=c.stop_reason)])
                yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
            if include_usage:
                chunk = CompletionStreamResponse(id=request_id, created=created, model=model,
                                                 choices=[], usage=_usage(stream, finals, req.n))
                yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        except Exception as e:  # the engine died mid-stream: tell the client in the stream
            yield error_event(str(e))
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"

    # --- /v1/chat/completions ---------------------------------------------------------------
    def render_chat(self, req: ChatCompletionRequest) -> str:
        tok = self.tokenizer
        if tok is None:
            raise OpenAIError("this model has no tokenizer (dummy weights?), so it cannot chat; "
                              "use /v1/completions with token-id prompts", param="messages")
        template = req.chat_template or self.chat_template or getattr(tok, "chat_template", None)
        if template is None:
            raise OpenAIError(
                f"The model `{self.served_model_names[0]}` has no chat template: its tokenizer "
                "defines none (it is a base model, not a chat model), so there is no way to turn "
                "messages into a prompt. Use /v1/completions with a plain prompt, or start the "
                "server with --chat-template FILE_OR_JINJA_STRING (or send chat_template in the "
                "request).", param="messages", code="no_chat_template")
        messages = []
        for m in req.messages:
            msg = {"role": m.role, "content": _message_text(m.content)}
            if m.name:
                msg["name"] = m.name
            messages.append(msg)
        try:
            return tok.apply_chat_template(messages, tokenize=False, chat_template=template,
                                           add_generation_prompt=req.add_generation_prompt,
                                           **(req.chat_template_kwargs or {}))
        except Exception as e:  # a Jinja error in a user-supplied template
            raise OpenAIError(f"the chat template failed to render: {e}", param="chat_template")

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.model_name(req.model)
        if req.tools:
            raise OpenAIError("tool calling is not supported by minipaged", param="tools")
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        prompt = TextPrompt(self.render_chat(req), add_special_tokens=False)
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        params = self.sampling_params(req, max_tokens=max_tokens,
                                      logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        request_id = random_id("chatcmpl")
        stream = await self.submit([prompt] * req.n, params, request_id)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._chat_events(stream, req, params, model, request_id,
                                                 include_usage))
        return await run_unless_disconnected(raw, self._chat_full(stream, req, model, request_id))

    async def _chat_full(self, stream: RequestStream, req: ChatCompletionRequest, model: str,
                         request_id: str) -> Response:
        finals = await _collect(stream)
        choices = []
        for i, out in enumerate(finals):
            c = out.outputs[0]
            reasoning, content = None, c.text
            if self.reasoning_parser is not None:
                reasoning, content = self.reasoning_parser().extract(c.text)
            lp = (_chat_logprobs(c.token_ids, c.logprobs, 0, req.top_logprobs or 0)
                  if req.logprobs else None)
            choices.append(ChatChoice(
                index=i, message=ChatResponseMessage(content=content, reasoning_content=reasoning),
                logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        resp = ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=_usage(stream, finals, req.n))
        body = resp.model_dump(exclude_none=True)
        for choice in body["choices"]:  # OpenAI always sends "content", null when empty
            choice["message"].setdefault("content", None)
        return JSONResponse(body)

    async def _chat_events(self, stream: RequestStream, req: ChatCompletionRequest,
                           params: list[SamplingParams], model: str, request_id: str,
                           include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        num = len(stream.request_ids)
        sent_text, sent_tokens = [""] * num, [0] * num
        finals: list[Optional[RequestOutput]] = [None] * num
        parsers = [self.reasoning_parser() if self.reasoning_parser else None for _ in range(num)]
        hold = _stop_hold(params[0])

        def event(choice: ChatStreamChoice, usage=None) -> str:
            chunk = ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                 choices=[choice] if choice else [], usage=usage)
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

        try:
            for i in range(num):  # OpenAI's first chunk per choice carries the role
                yield event(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                         content="")))
            async for i, out in stream:
                c = out.outputs[0]
                if len(c.token_ids) == sent_tokens[i] and not out.finished:
                    continue
                delta = text_delta(sent_text[i], c.text, out.finished, hold)
                sent_text[i] += delta
                reasoning, content = None, delta
                if parsers[i] is not None:
                    reasoning, content = parsers[i].feed(delta)
                    if out.finished:
                        r2, c2 = parsers[i].flush()
                        reasoning, content = reasoning + r2, content + c2
                    reasoning = reasoning or None
                    content = content or (None if reasoning else "")
                lp = (_chat_logprobs(c.token_ids, c.logprobs, sent_tokens[i], req.top_logprobs or 0)
                      if req.logprobs else None)
                sent_tokens[i] = len(c.token_ids)
                if out.finished:
                    finals[i] = out
                yield event(ChatStreamChoice(
                    index=i, delta=DeltaMessage(content=content, reasoning_content=reasoning),
                    logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            if include_usage:
                yield event(None, usage=_usage(stream, finals, req.n))
        except Exception as e:  # the engine died mid-stream: tell the client in the stream
            yield error_event(str(e))
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"


# --- helpers ---------------------------------------------------------------------------------
async def _collect(stream: RequestStream) -> list[RequestOutput]:
    finals: list[Optional[RequestOutput]] = [None] * len(stream.request_ids)
    try:
        async for i, out in stream:
            if out.finished:
                finals[i] = out
    except EngineDeadError as e:
        raise OpenAIError(str(e), 503, type="server_error") from None
    finally:
        stream.abort()  # no-op when all finished; on cancellation it frees the blocks
    return finals


def _usage(stream: RequestStream, finals, n: int) -> UsageInfo:
    # each prompt counts once even when it is sampled n times (as OpenAI counts it)
    prompt = sum(len(ids) for ids in stream.prompt_token_ids[::n])
    completion = sum(len(o.outputs[0].token_ids) for o in finals if o is not None)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)


def _normalize_prompt(prompt) -> list:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]  # one prompt of token ids
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise OpenAIError("the prompt is empty; give at least one token", param="prompt")
    return prompts


def _message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise OpenAIError(f"message content of type {part.get('type')!r} is not supported: "
                              "minipaged is text-only", param="messages")
        parts.append(part.get("text", ""))
    return "\n".join(parts)


def _completion_logprobs(token_ids, logprobs, start: int, offset: int) -> CompletionLogprobs:
    """OpenAI's legacy completions format for tokens[start:]; text offsets continue `offset`."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids[start:], (logprobs or [])[start:]):
        text = entry[tid].decoded_token or ""
        out.tokens.append(text)
        out.token_logprobs.append(entry[tid].logprob)
        out.top_logprobs.append({lp.decoded_token or "": lp.logprob
                                 for _, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _chat_logprobs(token_ids, logprobs, start: int, top: int) -> ChatChoiceLogprobs:
    content = []
    for tid, entry in zip(token_ids[start:], (logprobs or [])[start:]):
        best = sorted((lp for t, lp in entry.items() if lp.rank <= top), key=lambda lp: lp.rank)
        text = entry[tid].decoded_token or ""
        content.append(ChatTokenLogprob(
            token=text, logprob=entry[tid].logprob, bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                                     bytes=list((lp.decoded_token or "").encode()))
                          for lp in best[:top]]))
    return ChatChoiceLogprobs(content=content)
