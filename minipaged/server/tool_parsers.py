"""Tool calling in chat completions (lesson 12): `tools`, `tool_choice`, and the parser that finds
the calls in the model's text.

    tool_choice "none"        the tools are shown to the chat template; the reply is text
    tool_choice "auto"        the model may call tools; `--enable-auto-tool-choice
                              --tool-call-parser hermes` finds `<tool_call>{"name": ...,
                              "arguments": {...}}</tool_call>` in its text (Hermes / Qwen's format)
    tool_choice "required"    the output is forced, with a JSON-schema grammar, to be a list of
                              one or more calls of the declared tools, each with valid arguments
    {"type": "function", "function": {"name": NAME}}
                              the output is forced to be NAME's arguments (its parameters schema)

Forced calls always parse: the grammar allows nothing else. A named tool that is not in `tools`
is a 400. `HermesToolParser.extract` parses a whole reply; `StreamingToolCalls` turns streamed
text into content deltas and one tool-call delta per completed call (name and arguments).
"""
from __future__ import annotations

import json
import re
from typing import Optional

from minipaged.server.protocol import random_id
from minipaged.structured_output import StructuredOutputsParams

TOOL_PARSERS = ("hermes",)


def tool_call(name: str, arguments, index: Optional[int] = None) -> dict:
    """One OpenAI tool call; `arguments` as the JSON text OpenAI sends."""
    call = {"id": random_id("chatcmpl-tool"), "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments, ensure_ascii=False)}}
    if index is not None:
        call["index"] = index
    return call


def tool_names(tools: list[dict], error) -> dict[str, dict]:
    """name -> the tool's parameters schema; checks each tool's shape."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function"
                and isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise error(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                        f'"parameters": {{...}}}}}}', param="tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise error(f"tools[{i}].function.parameters must be a JSON schema object",
                        param="tools")
        out[fn["name"]] = params
    return out


def resolve_tool_choice(tools: Optional[list[dict]], tool_choice, auto_enabled: bool,
                        error) -> tuple[str, Optional[str], dict[str, dict]]:
    """(mode "none" | "auto" | "required" | "named", the named tool, name -> parameters)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise error("tool_choice needs tools", param="tool_choice")
        return "none", None, {}
    names = tool_names(tools, error)
    if tool_choice is None:
        tool_choice = "auto" if auto_enabled else "none"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise error('tool_choice must be "none", "auto", "required" or {"type": "function", '
                        '"function": {"name": ...}}', param="tool_choice")
        if name not in names:
            raise error(f"tool_choice names the function {name!r}, which is not in tools "
                        f"({', '.join(names)})", param="tool_choice")
        return "named", name, names
    if tool_choice == "auto" and not auto_enabled:
        raise error('"auto" tool choice needs the server started with --enable-auto-tool-choice '
                    "and --tool-call-parser", param="tool_choice")
    if tool_choice not in ("none", "auto", "required"):
        raise error(f'tool_choice must be "none", "auto", "required" or a named function, got '
                    f"{tool_choice!r:.80}", param="tool_choice")
    return tool_choice, None, names


def forced_constraint(mode: str, named: Optional[str], names: dict[str, dict],
                      parallel: bool = True) -> Optional[StructuredOutputsParams]:
    """The grammar that makes "required" and named tool choices always parse
    (`parallel=False`: OpenAI's parallel_tool_calls=false, one call at most)."""
    # compact JSON (no free whitespace): arguments read the same whole and streamed
    if mode == "named":
        return StructuredOutputsParams(json=names[named], disable_any_whitespace=True)
    if mode == "required":  # vLLM's shape: [{"name": ..., "parameters": {...}}, ...]
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "parameters"],
                  "properties": {"name": {"enum": [name]}, "parameters": params}}
                 for name, params in names.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array, disable_any_whitespace=True)
    return None


def forced_calls(mode: str, named: Optional[str], text: str) -> list[dict]:
    """The tool calls of a forced reply (its grammar guarantees the JSON, when it finished)."""
    try:
        value = json.loads(text)
    except ValueError:  # cut short by max_tokens
        return []
    if mode == "named":  # the arguments as written (what the stream sent)
        return [tool_call(named, text.strip())]
    return [tool_call(c["name"], c.get("parameters", {})) for c in value]


class HermesToolParser:
    """`<tool_call>{"name": "f", "arguments": {...}}</tool_call>` (Hermes 2 Pro, Qwen 2.5/3)."""

    start, end = "<tool_call>", "</tool_call>"
    _call = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> tuple[Optional[str], list[dict]]:
        """(content before the first call, or None if empty; the calls). Text whose calls do not
        parse is returned as content, with no calls (vLLM's rule)."""
        if self.start not in text:
            return text, []
        calls = []
        try:
            for i, m in enumerate(self._call.finditer(text)):
                body = json.loads((m.group(1) or m.group(2) or "").strip())
                calls.append(tool_call(body["name"], body.get("arguments", {})))
        except (ValueError, KeyError, TypeError):
            return text, []
        content = text[:text.index(self.start)]
        return (content if content.strip() else None), calls


class StreamingToolCalls:
    """Streams content until a `<tool_call>` starts, then one delta per completed call.

    `feed(new_text)` returns (content delta, [tool-call deltas]); text that could be the start
    of `<tool_call>` is held back until it is certain. `finish()` flushes at the end.
    """

    def __init__(self, parser: HermesToolParser):
        self.parser = parser
        self.buffer = ""  # text not yet sent as content, or the calls' text
        self.in_calls = False
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buffer += delta
        start = self.parser.start
        if not self.in_calls:
            i = self.buffer.find(start)
            if i < 0:  # hold back a tail that may be the start of "<tool_call>"
                keep = next((k for k in range(min(len(start) - 1, len(self.buffer)), 0, -1)
                             if start.startswith(self.buffer[-k:])), 0)
                content, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[
                    len(self.buffer) - keep:]
                return content, []
            content, self.buffer, self.in_calls = self.buffer[:i], self.buffer[i:], True
            return content + "", self._calls(final=False)
        return "", self._calls(final=False)

    def _calls(self, final: bool) -> list[dict]:
        out = []
        end = self.parser.end
        while True:
            j = self.buffer.find(end)
            if j < 0:
                break
            piece, self.buffer = self.buffer[:j + len(end)], self.buffer[j + len(end):]
            _, calls = self.parser.extract(piece)
            for c in calls:
                out.append(c | {"index": self.num_calls})
                self.num_calls += 1
        if final and self.buffer.strip():
            _, calls = self.parser.extract(self.buffer)
            for c in calls:
                out.append(c | {"index": self.num_calls})
                self.num_calls += 1
            self.buffer = ""
        return out

    def finish(self) -> tuple[str, list[dict]]:
        if not self.in_calls:
            content, self.buffer = self.buffer, ""
            return content, []
        return "", self._calls(final=True)


def get_tool_parser(name: str) -> type[HermesToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got "
                         f"{name!r}")
    return HermesToolParser


class ToolChoice:
    """One chat request's tools: its mode, the constraint that forces a call, and how its reply
    becomes `content` and `tool_calls` (whole, or as stream deltas)."""

    def __init__(self, req, tool_parser: Optional[type[HermesToolParser]]):
        from minipaged.server.serving_engine import OpenAIError
        self.mode, self.named, self.names = resolve_tool_choice(
            req.tools, req.tool_choice, tool_parser is not None, OpenAIError)
        self.parser = tool_parser() if tool_parser is not None and self.mode == "auto" else None
        self.constraint = forced_constraint(self.mode, self.named, self.names,
                                            parallel=req.parallel_tool_calls is not False)
        if self.constraint is not None:
            from minipaged.server.structured_outputs import request_structured_outputs
            if request_structured_outputs(req, OpenAIError) is not None:
                raise OpenAIError(f"tool_choice {self.mode!r} forces the output's grammar, so "
                                  "the request cannot also ask for a structured output",
                                  param="tool_choice")

    def extract(self, content: Optional[str]) -> tuple[Optional[str], list[dict]]:
        """A whole reply: (content, tool calls)."""
        if self.constraint is not None:
            calls = forced_calls(self.mode, self.named, content or "")
            return (None, calls) if calls else (content, [])
        if self.parser is not None and content:
            return self.parser.extract(content)
        return content, []

    def finish_reason(self, reason: Optional[str], calls: Optional[list] = None) -> Optional[str]:
        """OpenAI's "tool_calls" when the model chose to call ("auto", "required")."""
        called = bool(calls) if calls is not None else getattr(self, "_called", False)
        if reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def streamer(self) -> Optional["ToolChoice._Stream"]:
        return None if self.mode == "none" or (self.mode == "auto" and self.parser is None) \
            else ToolChoice._Stream(self)

    class _Stream:
        """One streamed choice: named calls stream their arguments as they come; "required"
        sends its calls when the list is complete; "auto" streams content, then each call."""

        def __init__(self, owner: "ToolChoice"):
            self.owner = owner
            self.text = ""
            self.started = False
            self.called = False
            self.hermes = StreamingToolCalls(owner.parser) if owner.parser is not None else None

        def delta(self, message: dict, finished: bool) -> dict:
            new = message.get("content") or ""
            out = {k: v for k, v in message.items() if k != "content"}
            mode = self.owner.mode
            calls: list[dict] = []
            content = ""
            if mode == "named":
                if not self.started:
                    self.started = True
                    calls.append(tool_call(self.owner.named, "", index=0))
                if new:
                    calls.append({"index": 0, "function": {"arguments": new}})
                self.called = True
            elif mode == "required":
                self.text += new
                if finished:
                    calls = [c | {"index": i} for i, c in
                             enumerate(forced_calls(mode, None, self.text))]
                    if not calls:  # cut short (max_tokens): its text, as the whole reply has
                        content = self.text
            else:
                content, calls = self.hermes.feed(new)
                if finished:
                    c2, more = self.hermes.finish()
                    content, calls = content + c2, calls + more
            if calls:
                self.called = True
                out["tool_calls"] = calls
            out["content"] = content or (None if calls or "reasoning_content" in out else "")
            return out

        def finish_reason(self, reason: Optional[str]) -> Optional[str]:
            if reason == "stop" and self.called and self.owner.mode in ("auto", "required"):
                return "tool_calls"
            return reason
