"""minipaged's OpenAI-compatible server (`minipaged serve`). Lesson 07 explains it.

Two processes, as in vLLM V1. Read it in this order:

    ../cli/serve.py          `minipaged serve MODEL --flags`: vLLM's command line, builds the rest
    api_server.py            the FastAPI app: routes, API key, body limit, errors, graceful drain
    serving_engine.py        what the endpoints share: checks, SamplingParams, server-sent events
    serving_completion.py    /v1/completions
    serving_chat.py          /v1/chat/completions (chat template off the event loop)
    serving_tokenization.py  /tokenize, /detokenize
    protocol.py              the request/response bodies (pydantic), which also make /docs
    async_llm.py             the API server's half: tokenize, detokenize, stop strings
    request_stream.py        one HTTP request's engine requests, woken once per step
    engine_core.py           the engine core process: an LLMEngine stepped in a loop
    messages.py              what the two processes send each other (msgpack, never pickle)
    reasoning.py             <think>...</think> -> reasoning_content / content, streaming too
    metrics.py               Prometheus gauges, counters and latency histograms (vLLM's names)
"""
from minipaged.server.api_server import build_app
from minipaged.server.async_llm import AsyncLLM, EngineDeadError
from minipaged.server.request_stream import RequestStream, TextPrompt
from minipaged.server.metrics import Metrics, parse_metrics
from minipaged.server.reasoning import (REASONING_PARSERS, get_reasoning_parser,
                                        register_reasoning_parser)

__all__ = ["build_app", "AsyncLLM", "EngineDeadError", "RequestStream", "TextPrompt",
           "Metrics", "parse_metrics", "REASONING_PARSERS", "get_reasoning_parser",
           "register_reasoning_parser"]
