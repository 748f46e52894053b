"""What the API server keeps of one HTTP request while the engine core steps it (lesson 07).

`RequestState` is one engine request as `AsyncLLM` (async_llm.py) follows it: its samples as
`Sequence`s, their text and finish status. `RequestStream` holds the engine requests of one HTTP
request (several prompts, each with its n samples) and wakes its reader once per step with
whatever is new, however many tokens that is: a slow client gets them merged, the engine never
waits for it.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from minipaged.engine.sequence import Sequence
from minipaged.sampling import Logprob


@dataclass
class TextPrompt:
    """Text to tokenize. Chat prompts come out of the chat template with their special tokens
    already in place, so they use `add_special_tokens=False`."""

    text: str
    add_special_tokens: bool = True


PromptInput = Union[str, list[int], TextPrompt]


@dataclass(eq=False)
class RequestState:
    """One engine request as the API server follows it: its samples as `Sequence`s (token ids,
    text, finish status), and the stream to wake when something is new."""

    request_id: str
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    stream: "RequestStream"
    arrival: float
    incremental: bool  # decode text as tokens arrive (streaming or stop strings)
    error: Optional[str] = None
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token {token id: Logprob}, None first
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    finished: bool = False
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    accepted: Optional[asyncio.Future] = field(default=None, repr=False)

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.seqs)


class RequestStream:
    """The engine requests of one HTTP request (several prompts, each with its n samples).
    `async for state in stream` yields a `RequestState` each time it has something new; it ends
    when all have finished. `abort()` cancels what has not finished (idempotent)."""

    def __init__(self, abort: Callable[[list[str]], None]):
        self._abort = abort  # AsyncLLM.abort: ends requests in the engine core
        self.states: list[RequestState] = []
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pending: set[int] = set()  # states already queued (woken once, read everything)

    def notify(self, state: RequestState) -> None:
        if id(state) not in self._pending:
            self._pending.add(id(state))
            self._queue.put_nowait(state)

    def fail(self, error: BaseException) -> None:
        self._queue.put_nowait(error)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestState:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            for s in self.states:
                s.finished = True
            raise item
        self._pending.discard(id(item))
        return item

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.states)

    def abort(self) -> None:
        live = [s.request_id for s in self.states if not s.finished]
        for s in self.states:
            s.finished = True
        if live:
            self._abort(live)
