"""What every OpenAI endpoint shares: checks, SamplingParams, errors and server-sent events.
Lesson 07 explains it. `serving_completion.py` and `serving_chat.py` build on `OpenAIServing`.

For every HTTP request an endpoint:

1. checks the model name, the fields minipaged cannot honour and every text field (a lone
   surrogate such as "\\ud800" is not text: 400, naming the field);
2. turns the body into one `SamplingParams` whose `n` the engine serves as n samples of one
   prefill sharing its blocks (sample i draws from `seed + i`, so a response is reproducible);
3. submits the prompts to `AsyncLLM` (async_llm.py), which tokenizes them off the event loop;
4. collects the final outputs into one JSON response, or streams server-sent events:
   `data: {chunk}\\n\\n` whenever a choice has new text, then `data: [DONE]`.

Streaming sends the *new* text of each choice. Two things are held back until they are certain:
a trailing "\\ufffd" (half of a multi-byte character) and, when `stop` strings are set, the last
`len(longest stop) - 1` characters (they might be the start of a stop string, which must never
reach the client). Stream chunks are written with `json.dumps` from plain dicts: building and
dumping a pydantic model per chunk was half of the server's time under load.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Callable, Iterable, Optional, Sequence as Seq

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minipaged.engine.llm_engine import RequestError
from minipaged.engine.sequence import Sequence
from minipaged.lora.request import LoRARequest
from minipaged.sampling import SamplingParams
from minipaged.server.async_llm import AsyncLLM, EngineDeadError
from minipaged.server.request_stream import RequestState, RequestStream
from minipaged.server.protocol import ErrorInfo, ErrorResponse, SamplingFields, UsageInfo
from minipaged.server.reasoning import ThinkTagReasoningParser
from minipaged.server.structured_outputs import request_structured_outputs


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


def error_event(message: str, type: str = "server_error", code: Optional[int] = None) -> str:
    return sse({"error": {"message": message, "type": type, "param": None, "code": code}})


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


class RequestFailed(Exception):
    """Something raised inside the engine while this request was stepped (it ended alone)."""


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


def stop_hold(params: SamplingParams) -> int:
    if params.stop and not params.include_stop_str_in_output:
        return max(len(s) for s in params.stop) - 1
    return 0


def check_text(value, param: str) -> None:
    """Strings from JSON may hold lone surrogates ("\\ud800"), which are not text: no tokenizer
    can encode them. Refuse them by name instead of failing somewhere inside."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise OpenAIError(
                f"{param} holds U+{ord(value[e.start]):04X} at character {e.start}: a lone "
                f"UTF-16 surrogate, which is not valid Unicode "
                "text. Send proper UTF-8 text.", param=param) from None
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_text(v, param)
    elif isinstance(value, dict):
        for v in value.values():
            check_text(v, param)


class Choice:
    """What one streamed choice has sent so far (text, tokens, logprob text offset)."""

    __slots__ = ("seq", "index", "text", "tokens", "offset", "done")

    def __init__(self, seq: Sequence, index: int):
        self.seq, self.index = seq, index
        self.text, self.tokens, self.offset, self.done = "", 0, 0, False


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_names: list[str],
                 chat_template: Optional[str] = None,
                 reasoning_parser: Optional[type[ThinkTagReasoningParser]] = None,
                 tool_parser=None, lora_requests: Iterable[LoRARequest] = ()):
        self.llm = llm
        self.served_model_names = served_model_names
        # --lora-modules: the adapters a request's `model` may name, besides the base model
        self.lora_requests = {r.lora_name: r for r in lora_requests}
        self.chat_template = chat_template
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser  # --tool-call-parser with --enable-auto-tool-choice

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.config.max_model_len

    @property
    def max_logprobs(self) -> int:
        return self.llm.config.max_logprobs

    def model_name(self, requested: Optional[str]) -> str:
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names and requested not in self.lora_requests:
            names = [*self.served_model_names, *self.lora_requests]
            raise OpenAIError(f"The model `{requested}` does not exist. This server serves: "
                              f"{', '.join(names)} (see GET /v1/models).",
                              404, param="model", code="model_not_found")
        return requested

    def lora_request(self, model: str) -> Optional[LoRARequest]:
        """The adapter a (checked) model name stands for; None for the base model."""
        return self.lora_requests.get(model)

    def sampling_params(self, req: SamplingFields, *, max_tokens: Optional[int],
                        logprobs: Optional[int], logprobs_field: str,
                        structured_outputs=None,
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        """`structured_outputs`: a constraint the endpoint sets (a forced tool call); else the
        request's own (response_format, structured_outputs, guided_*). `prompt_logprobs`: the
        completions endpoint's (its own field, or `logprobs` with `echo`)."""
        if structured_outputs is None:
            structured_outputs = request_structured_outputs(req, OpenAIError)
        if structured_outputs is not None and self.tokenizer is None:
            raise OpenAIError("structured outputs need the model's tokenizer, and this model has "
                              "none (dummy weights?)", param="structured_outputs")
        if req.logit_bias:
            raise OpenAIError("logit_bias is not supported by minipaged", param="logit_bias")
        for field, k in ((logprobs_field, logprobs), ("prompt_logprobs", prompt_logprobs)):
            if k is not None and 0 <= self.max_logprobs < k:
                raise OpenAIError(f"{field} must be at most {self.max_logprobs} (the server's "
                                  f"--max-logprobs), got {k}", param=field)
        if req.stop and self.tokenizer is None:
            raise OpenAIError("stop strings need a tokenizer to detokenize the output, and this "
                              "model has none; use stop_token_ids", param="stop")
        check_text(req.stop, "stop")
        try:
            return SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0, min_p=req.min_p or 0.0,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured_outputs=structured_outputs)
        except ValueError as e:  # SamplingParams' own checks say what is wrong and why
            field = str(e).split(" ", 1)[0]
            raise OpenAIError(str(e), param=field if field in type(req).model_fields
                              else None) from None

    async def submit(self, prompts, params: SamplingParams, request_id: str,
                     stream: bool, model: Optional[str] = None,
                     priority: int = 0) -> RequestStream:
        """Queue the prompts; `model` (a checked name) picks the LoRA adapter, if it is one."""
        try:
            return await self.llm.generate(prompts, params, request_id, stream=stream,
                                           lora_request=self.lora_request(model),
                                           priority=priority)
        except RequestError as e:  # prompt too long, bad token ids, tokenizing took too long
            first = str(e).split(" ", 1)[0].split("=", 1)[0]
            param = (first if first in ("structured_outputs", "priority")
                     else "prompt" if "prompt" in str(e) else None)
            raise OpenAIError(str(e), param=param) from None
        except EngineDeadError as e:
            raise OpenAIError(str(e), 503, type="server_error") from None

    @staticmethod
    def choices(stream: RequestStream) -> list[Choice]:
        """Choice index = prompt index * n + sample index, as OpenAI orders them."""
        return [Choice(seq, i * len(state.seqs) + seq.index)
                for i, state in enumerate(stream.states) for seq in state.seqs]

    @staticmethod
    async def collect(stream: RequestStream) -> list[RequestState]:
        """Wait for a full (non-streamed) response; an error in any request is the response's."""
        try:
            async for _ in stream:
                pass
        except EngineDeadError as e:
            raise OpenAIError(str(e), 503, type="server_error") from None
        finally:
            stream.abort()  # no-op when all finished; on cancellation it frees the blocks
        for state in stream.states:
            if state.error is not None:
                raise OpenAIError(f"the request failed while it was generated: {state.error}",
                                  500, type="server_error")
        return stream.states

    @staticmethod
    def usage(stream: RequestStream, prompt_only: bool = False) -> UsageInfo:
        """`prompt_only`: echo with max_tokens 0, whose one sampled token is not returned."""
        prompt = sum(len(s.prompt_token_ids) for s in stream.states)  # each prompt counts once
        completion = 0 if prompt_only else sum(s.num_output_tokens for s in stream.states)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion)

    async def stream_events(self, stream: RequestStream, head: dict, choices: list[Choice],
                            chunk: Callable[[Choice], Optional[dict]], include_usage: bool,
                            first: Seq[dict] = (), prompt_only: bool = False
                            ) -> AsyncIterator[str]:
        """The server-sent events of one streamed response, for both endpoints: the choice
        chunks `first` (chat's role chunks), then at every engine step that gave a request new
        tokens, `chunk(choice)` for each of its choices (None: nothing to send yet); the usage
        when asked for; an error event if the request failed, the engine died or the server is
        shutting down; and `data: [DONE]`. Each event is `head` (id, object, created, model)
        with its choices. Leaving early (a client gone) aborts what is unfinished."""
        by_request: dict[str, list[Choice]] = {}
        for ch in choices:
            by_request.setdefault(ch.seq.request_id, []).append(ch)
        try:
            for body in first:
                yield sse(head | {"choices": [body]})
            async for state in stream:
                if state.error is not None:
                    raise RequestFailed(state.error)
                for ch in by_request.get(state.request_id, ()):
                    body = chunk(ch)
                    if body is not None:
                        yield sse(head | {"choices": [body]})
            if include_usage:
                yield sse(head | {"choices": [], "usage": self.usage(stream, prompt_only)
                                  .model_dump()})
        except Exception as e:  # the engine died or the server is shutting down
            yield self.stream_error(e)
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"

    @staticmethod
    def stream_error(error: BaseException) -> str:
        if isinstance(error, EngineDeadError):
            return error_event(str(error), code=503)
        if isinstance(error, RequestFailed):
            return error_event(f"the request failed while it was generated: {error}", code=500)
        return error_event(f"internal error: {error!r}")


def finish_fields(seq: Sequence) -> tuple[Optional[str], Optional[int | str]]:
    if not seq.is_finished:
        return None, None
    return seq.status.value, seq.stop_reason
