"""Reasoning parsers: split a reasoning model's `<think>…</think>` into `reasoning_content` and
`content`, for whole texts and for token-by-token streams. Lesson 07 explains it.

Reasoning models (DeepSeek-R1, QwQ, Qwen3 in thinking mode) write their chain of thought between
`<think>` and `</think>` and the answer after it. `vllm serve ... --reasoning-parser deepseek_r1`
returns the two parts in separate fields of the OpenAI response; `minipaged serve` does the same:

    message.reasoning_content  = the text inside <think>…</think>
    message.content            = the text after </think>

Streaming is the interesting part: a tag can arrive split across chunks (`"…</th"` then
`"ink>Answer"`), so the parser holds back any tail that could still become a tag and releases it
once the next chunk shows what it was. The whole-text parse is defined as "stream everything,
then flush", so both paths always agree.

Parsers live in a small registry; add one with

    @register_reasoning_parser("my_model")
    class MyParser(ThinkTagReasoningParser):
        start_in_reasoning = False
"""
from __future__ import annotations

from typing import Optional

REASONING_PARSERS: dict[str, type["ThinkTagReasoningParser"]] = {}


def register_reasoning_parser(name: str):
    def wrap(cls):
        REASONING_PARSERS[name] = cls
        return cls
    return wrap


def get_reasoning_parser(name: str) -> type["ThinkTagReasoningParser"]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; available: "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkTagReasoningParser:
    """Incremental `<think>…</think>` splitter. One instance per generated sequence.

    `feed(delta)` takes the next piece of generated text and returns `(reasoning, content)`
    deltas (either may be ""); `flush()` releases whatever was held back when the sequence ends.
    """

    start_tag = "<think>"
    end_tag = "</think>"
    # True: text before </think> is reasoning even without an opening <think> (DeepSeek-R1's chat
    # template puts <think> in the prompt, so the model's output often starts inside it).
    start_in_reasoning = True

    def __init__(self) -> None:
        self._state = "start"  # start -> reasoning -> content
        self._buf = ""  # text held back: may still turn into a tag

    # --- streaming --------------------------------------------------------------------------
    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning, content = [], []
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(self.start_tag):
                    self._buf = stripped[len(self.start_tag):]
                    self._state = "reasoning"
                    continue
                if self.start_tag.startswith(stripped) and stripped != "":
                    break  # "<thi" so far: wait for more
                if stripped == "" and self._buf:
                    break  # only whitespace yet
                if not self._buf:
                    break
                self._state = "reasoning" if self.start_in_reasoning else "content"
                continue
            if self._state == "reasoning":
                idx = self._buf.find(self.end_tag)
                if idx != -1:
                    reasoning.append(self._buf[:idx])
                    self._buf = self._buf[idx + len(self.end_tag):]
                    self._state = "content"
                    continue
                keep = _partial_tag_len(self._buf, self.end_tag)
                reasoning.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            # content: everything passes straight through
            content.append(self._buf)
            self._buf = ""
            break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """End of the sequence: a held-back partial tag was just text after all."""
        buf, self._buf = self._buf, ""
        if self._state == "content" or (self._state == "start" and not self.start_in_reasoning):
            return "", buf
        return buf, ""

    # --- whole text -------------------------------------------------------------------------
    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """(reasoning_content, content) of a finished generation; None where a part is empty."""
        r1, c1 = self.feed(text)
        r2, c2 = self.flush()
        reasoning, content = r1 + r2, c1 + c2
        return reasoning or None, content or None


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-R1 (and its distills, QwQ): the output is reasoning until `</think>`, whether or
    not it opened with `<think>`. A generation that never closes the tag is all reasoning (it ran
    out of tokens while thinking), as in vLLM's parser."""

    start_in_reasoning = True


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Qwen3: thinks only when the output opens with `<think>` (thinking mode can be switched
    off in the chat template); otherwise everything is content."""

    start_in_reasoning = False
