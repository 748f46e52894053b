"""`POST /v1/chat/completions`: messages through the chat template, a reply whole or streamed,
reasoning split out by the --reasoning-parser. Lesson 07 explains it; the shared steps are in
serving_engine.py.

The template is rendered in a worker thread with a time bound (`AsyncLLM.run_off_loop`): a
heavy per-request template must not hold the event loop, which answers /health and streams.
"""
from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minipaged.engine.llm_engine import RequestError
from minipaged.engine.sequence import Sequence
from minipaged.server.request_stream import RequestStream, TextPrompt
from minipaged.server.protocol import (ChatChoice, ChatChoiceLogprobs, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatResponseMessage,
                                       ChatTokenLogprob, TopLogprob, random_id)
from minipaged.server.serving_engine import (OpenAIError, OpenAIServing, SSEResponse,
                                             check_text, finish_fields, run_unless_disconnected,
                                             stop_hold, text_delta)
from minipaged.server.tool_parsers import ToolChoice


class OpenAIServingChat(OpenAIServing):
    def template(self, req: ChatCompletionRequest) -> str:
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
        return template

    async def render_chat(self, req: ChatCompletionRequest) -> str:
        tok, template = self.tokenizer, self.template(req)
        messages = []
        for m in req.messages:
            msg = {"role": m.role, "content": message_text(m.content)}
            if m.name:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = m.tool_calls
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            messages.append(msg)
        check_text(messages, "messages")
        check_text(req.chat_template, "chat_template")
        check_text(req.tools, "tools")
        tools = {"tools": req.tools} if req.tools else {}

        def render() -> str:
            return tok.apply_chat_template(messages, tokenize=False, chat_template=template,
                                           add_generation_prompt=req.add_generation_prompt,
                                           **tools, **(req.chat_template_kwargs or {}))
        try:
            return await self.llm.run_off_loop(render, "rendering the chat template")
        except RequestError as e:
            raise OpenAIError(str(e), param="chat_template") from None
        except Exception as e:  # a Jinja error in a user-supplied template
            raise OpenAIError(f"the chat template failed to render: {e}",
                              param="chat_template") from None

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.model_name(req.model)
        tools = ToolChoice(req, self.tool_parser)  # tools / tool_choice checked (tool_parsers.py)
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        params = self.sampling_params(req, max_tokens=max_tokens,
                                      logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                      logprobs_field="top_logprobs",
                                      structured_outputs=tools.constraint)
        prompt = TextPrompt(await self.render_chat(req), add_special_tokens=False)
        request_id = random_id("chatcmpl")
        stream = await self.submit([prompt], params, request_id, stream=req.stream, model=model,
                                   priority=req.priority)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._events(stream, req, model, request_id, stop_hold(params),
                                            include_usage, tools))
        return await run_unless_disconnected(raw, self._full(stream, req, model, request_id,
                                                             tools))

    async def _full(self, stream: RequestStream, req: ChatCompletionRequest, model: str,
                    request_id: str, tools: "ToolChoice") -> Response:
        await self.collect(stream)
        choices = []
        for ch in self.choices(stream):
            seq = ch.seq
            reasoning, content = None, seq.output_text
            if self.reasoning_parser is not None:
                reasoning, content = self.reasoning_parser().extract(seq.output_text)
            lp = chat_logprobs(seq, 0, req.top_logprobs or 0) if req.logprobs else None
            reason, stop_reason = finish_fields(seq)
            content, calls = tools.extract(content)
            reason = tools.finish_reason(reason, calls)
            choices.append(ChatChoice(
                index=ch.index, message=ChatResponseMessage(content=content,
                                                            reasoning_content=reasoning,
                                                            tool_calls=calls or None),
                logprobs=lp, finish_reason=reason, stop_reason=stop_reason))
        resp = ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=self.usage(stream))
        body = resp.model_dump(exclude_none=True)
        for choice in body["choices"]:  # OpenAI always sends "content", null when empty
            choice["message"].setdefault("content", None)
        return JSONResponse(body)

    def _events(self, stream: RequestStream, req: ChatCompletionRequest, model: str,
                request_id: str, hold: int, include_usage: bool,
                tools: "ToolChoice") -> AsyncIterator[str]:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model}
        choices = self.choices(stream)
        parsers = {ch.index: self.reasoning_parser() if self.reasoning_parser else None
                   for ch in choices}
        streamers = {ch.index: tools.streamer() for ch in choices}
        # OpenAI's first chunk per choice carries the role
        first = [{"index": ch.index, "logprobs": None, "finish_reason": None,
                  "delta": {"role": "assistant", "content": ""}} for ch in choices]
        return self.stream_events(
            stream, head, choices,
            lambda ch: self._chunk(ch, req, hold, parsers[ch.index], streamers[ch.index]),
            include_usage, first)

    @staticmethod
    def _chunk(ch, req: ChatCompletionRequest, hold: int, parser, tools) -> Optional[dict]:
        seq: Sequence = ch.seq
        if ch.done or (seq.num_output_tokens == ch.tokens and not seq.is_finished):
            return None
        finished = seq.is_finished
        delta = text_delta(ch.text, seq.output_text, finished, hold)
        ch.text += delta
        message: dict = {"content": delta}
        if parser is not None:
            reasoning, content = parser.feed(delta)
            if finished:
                r2, c2 = parser.flush()
                reasoning, content = reasoning + r2, content + c2
            message = {"content": content or (None if reasoning else "")}
            if reasoning:
                message["reasoning_content"] = reasoning
        if tools is not None:  # tool calls: content until a call starts, then call deltas
            message = tools.delta(message, finished)
        reason, stop_reason = finish_fields(seq)
        if tools is not None:
            reason = tools.finish_reason(reason)
        chunk = {"index": ch.index, "delta": message, "logprobs": None,
                 "finish_reason": reason, "stop_reason": stop_reason}
        if req.logprobs:
            chunk["logprobs"] = chat_logprobs(seq, ch.tokens, req.top_logprobs or 0).model_dump()
        ch.tokens = seq.num_output_tokens
        ch.done = finished
        return chunk


def message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise OpenAIError(f"message content of type {part.get('type')!r} is not supported: "
                              "minipaged is text-only", param="messages")
        parts.append(part.get("text", ""))
    return "\n".join(parts)


def chat_logprobs(seq: Sequence, start: int, top: int) -> ChatChoiceLogprobs:
    content = []
    for tid, entry in zip(seq.output_token_ids[start:], (seq.logprobs or [])[start:]):
        best = sorted((lp for t, lp in entry.items() if lp.rank <= top), key=lambda lp: lp.rank)
        text = entry[tid].decoded_token or ""
        content.append(ChatTokenLogprob(
            token=text, logprob=entry[tid].logprob, bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                                     bytes=list((lp.decoded_token or "").encode()))
                          for lp in best[:top]]))
    return ChatChoiceLogprobs(content=content)
