"""minipaged's OpenAI-compatible server (`minipaged serve`). Lesson 07 explains it.

Read it in this order:

    cli.py           `minipaged serve MODEL --flags`: vLLM's command line, builds everything below
    api_server.py    the FastAPI app: routes, API key, errors in OpenAI's shape, /health, /metrics
    serving.py       OpenAI request -> SamplingParams + prompt -> engine; outputs -> JSON or SSE
    protocol.py      the request/response bodies (pydantic), which also make the /docs page
    async_engine.py  one thread steps the LLMEngine; each HTTP request reads its own asyncio.Queue
    reasoning.py     <think>...</think> -> reasoning_content / content, streaming too
    metrics.py       Prometheus gauges, counters and latency histograms
"""
from minipaged.server.api_server import build_app
from minipaged.server.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream, TextPrompt
from minipaged.server.metrics import Metrics, parse_metrics
from minipaged.server.reasoning import (REASONING_PARSERS, get_reasoning_parser,
                                        register_reasoning_parser)

__all__ = ["build_app", "AsyncLLMEngine", "EngineDeadError", "RequestStream", "TextPrompt",
           "Metrics", "parse_metrics", "REASONING_PARSERS", "get_reasoning_parser",
           "register_reasoning_parser"]
