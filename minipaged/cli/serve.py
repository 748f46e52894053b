"""`minipaged serve MODEL [flags]`: vLLM's `vllm serve` command line for minipaged. Lesson 07
explains it.

    minipaged serve stories260K --port 8000 --chat-template chat.jinja
    minipaged serve stories260K --served-model-name tiny --api-key secret --host 0.0.0.0
    minipaged serve dummy:qwen3-0.6b --max-model-len 4096 --gpu-memory-utilization 0.9
    minipaged serve --config serve.yaml --port 9000        flags from a YAML file, one overridden
    minipaged serve stories260K --enable-lora --lora-modules sql=/path/to/adapter   + adapters

The flags are vLLM's names (the underscore spellings work too: `--api_key`, `--max_model_len`),
so a course note's `vllm serve` line works as it is. vLLM flags that do not apply here are
accepted and explained in one `note:` line on stderr (`compat_notes`).

`--host` defaults to 127.0.0.1: only this machine can connect. `--host 0.0.0.0` listens on every
network interface, which is what a cloud box or a container needs for others to reach it (open the
port in the firewall, and set an --api-key: anyone who can reach the port can use the model).

Before the model loads, `serve` checks the serve extras, the device, the SSL files and the port
(serve_checks.py): each mistake is one `error:` line. While it serves it logs, as vLLM does, each
request (uvicorn's access log; `--disable-log-requests`) and every 10 s in which something ran a
line of throughput, queue and KV-cache use (`--disable-log-stats`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from minipaged.cli.args import (FlexibleArgumentParser, add_common_args, add_engine_args,
                                engine_config_from_args)
from minipaged.cli.errors import CLIError, run_command
from minipaged.cli.lora_args import add_lora_module_args, lora_requests_from_args
from minipaged.cli.serve_checks import bind_socket, check_serve_extras, check_ssl

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024  # (api_server.py's default too)
STATS_INTERVAL_S = 10.0

DESCRIPTION = __doc__.split("\n\n")[0].replace("\n", " ")
logger = logging.getLogger("minipaged.server")


def parse_origins(text: str) -> list[str]:
    """`--allowed-origins`: vLLM's JSON list ('["https://a.example"]') or comma-separated."""
    if text.strip().startswith("["):
        try:
            origins = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list of origins ({e})") from None
        if not all(isinstance(o, str) for o in origins):
            raise argparse.ArgumentTypeError("a JSON list of strings, e.g. '[\"*\"]'")
        return origins
    return [o.strip() for o in text.split(",") if o.strip()]


def make_parser() -> FlexibleArgumentParser:
    p = FlexibleArgumentParser(prog="minipaged serve", description=DESCRIPTION)
    s = p.add_argument_group("server")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in `model`; default: MODEL")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1 routes (or set "
                        "$MINIPAGED_API_KEY)")
    s.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on; 0.0.0.0 = every interface (reachable from "
                        "other machines)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one)")
    s.add_argument("--root-path", default="",
                   help="the path prefix a reverse proxy serves this under (e.g. /llm): links in "
                        "/docs and the schema carry it")
    s.add_argument("--ssl-keyfile", default=None, help="HTTPS: the private key (PEM)")
    s.add_argument("--ssl-certfile", default=None, help="HTTPS: the certificate (PEM)")
    s.add_argument("--allowed-origins", type=parse_origins, default=None,
                   help="CORS: web pages from these origins may call the API from a browser "
                        "(JSON list or comma-separated; '[\"*\"]': any). Default: none")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template: a file path, or the template itself")
    s.add_argument("--response-role", default="assistant",
                   help="the role of chat replies (only 'assistant' here)")
    s.add_argument("--reasoning-parser", default=None,
                   help="split <think>...</think> into reasoning_content (e.g. deepseek_r1, qwen3)")
    s.add_argument("--enable-reasoning", action="store_true",
                   help="accepted for old vLLM commands; --reasoning-parser alone is enough")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": parse tool calls out of the reply (needs '
                        '--tool-call-parser)')
    s.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="how tool calls look in the text: hermes = <tool_call>{...}</tool_call>")
    add_lora_module_args(s, "a request picks by its `model`")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="how much uvicorn logs")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per request (uvicorn's access log)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help=f"no periodic line of throughput, queue and KV-cache use (every "
                        f"{STATS_INTERVAL_S:.0f} s in which something ran)")
    s.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="refuse request bodies larger than this with a 413")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before they "
                        "are ended with an error (new requests get 503 meanwhile)")
    add_engine_args(p)  # every EngineConfig field, as in `minipaged generate` and `bench`
    p.set_defaults(usage_context="server")  # the server's defaults (EngineConfig.resolve)
    c = p.add_argument_group("accepted for vLLM compatibility")
    c.add_argument("--trust-remote-code", action="store_true",
                   help="not needed: minipaged implements the Llama family itself and runs no "
                        "model code")
    c.add_argument("--generation-config", default=None,
                   help="not read: a request's sampling defaults are SamplingParams' own")
    add_common_args(p)
    return p


def compat_notes(a) -> list[str]:
    """One line for each vLLM flag given that minipaged accepts but does not act on."""
    notes = []
    if a.trust_remote_code:
        notes.append("--trust-remote-code: not needed here. vLLM passes it to transformers to run "
                     "Python code shipped with a model; minipaged implements the Llama family "
                     "(Llama, Mistral, Qwen2, Qwen3) itself and never runs code from a model "
                     "folder.")
    if a.enable_reasoning:
        notes.append("--enable-reasoning: not needed (newer vLLM dropped it too); "
                     "--reasoning-parser turns reasoning on.")
    if a.generation_config is not None:
        notes.append(f"--generation-config {a.generation_config}: not read. vLLM takes default "
                     "temperature / top_p / top_k from the model's generation_config.json; here "
                     "a request's defaults are SamplingParams' (temperature 1.0): send them per "
                     "request.")
    if a.response_role != "assistant":
        notes.append(f"--response-role {a.response_role}: ignored, chat replies keep the role "
                     "'assistant'.")
    return notes


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """A file path or a literal Jinja template (vLLM's rule); a missing file is an error."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(ch in value for ch in "{}\n"):
        return value  # looks like a template, not a path
    raise ValueError(f"--chat-template {value!r}: no such file, and it does not look like a "
                     "Jinja template (no '{{', '{%'). Give a path to a .jinja file or the "
                     "template text.")


def check_tool_flags(a) -> None:
    if a.enable_auto_tool_choice and a.tool_call_parser is None:
        raise CLIError("--enable-auto-tool-choice needs --tool-call-parser (hermes): the parser "
                       "says how the model writes a tool call")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    a = make_parser().parse_args(argv)
    a.model = a.model_arg or a.model
    a.api_key = a.api_key or os.environ.get("MINIPAGED_API_KEY") or None
    return a


def build_app_from_args(a: argparse.Namespace, in_process: bool = False, config=None):
    """Start the engine core (it loads the model), then build the AsyncLLM, metrics and app.
    `in_process=True` runs the core in a thread of this process (tests, notebooks); `config`:
    the EngineConfig already made from `a` (default: made here)."""
    from minipaged.server.api_server import build_app
    from minipaged.server.async_llm import AsyncLLM
    from minipaged.server.metrics import Metrics
    from minipaged.server.reasoning import get_reasoning_parser

    parser = get_reasoning_parser(a.reasoning_parser) if a.reasoning_parser else None
    tools = None
    if a.enable_auto_tool_choice:  # server/tool_parsers.py
        from minipaged.server.tool_parsers import get_tool_parser
        check_tool_flags(a)
        tools = get_tool_parser(a.tool_call_parser)
    template = load_chat_template(a.chat_template)
    names = a.served_model_name or [a.model]
    config = config or engine_config_from_args(a)
    loras = lora_requests_from_args(a, config, names)
    if config.max_trace_len is None:  # a server runs for days: keep the newest steps only
        config = dataclasses.replace(config, max_trace_len=10_000)
    try:
        llm = AsyncLLM(config, Metrics(names[0]), in_process=in_process)
    except RuntimeError as e:  # the core died while it started: its log says why
        raise CLIError(f"the engine core did not start: {e}") from e
    root = llm.info["model_path"] or a.model
    app = build_app(llm, names, api_key=a.api_key, chat_template=template,
                    reasoning_parser=parser, model_root=root,
                    max_request_body_bytes=a.max_request_body_bytes, tool_parser=tools,
                    lora_requests=loras)
    if a.allowed_origins:  # outermost, so browsers' preflight OPTIONS need no API key
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=a.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])
    return app


def banner(a, app, port: Optional[int] = None) -> str:
    llm = app.state.llm
    cfg, info = llm.config, llm.info
    scheme = "https" if a.ssl_certfile else "http"
    host = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
    url = f"{scheme}://{host}:{a.port if port is None else port}"
    has_template = bool(app.state.chat.chat_template or
                        getattr(llm.tokenizer, "chat_template", None))
    names = ", ".join(repr(n) for n in app.state.chat.served_model_names)
    key = "required on /v1 routes" if a.api_key else "none (anyone who reaches the port can use it)"
    template = "yes" if has_template else "none (chat returns 400; completions work)"
    lines = [
        f"minipaged serve: {a.model} as {names} on {info['device']} ({info['dtype']}, "
        f"{info['attention_backend']}; engine core in its own process)",
        f"  KV cache: {info['num_blocks']} blocks x {cfg.block_size} tokens = "
        f"{info['num_blocks'] * cfg.block_size} token slots; max_model_len {cfg.max_model_len}, "
        f"max_num_seqs {cfg.max_num_seqs}, max_num_batched_tokens {cfg.max_num_batched_tokens}",
        f"  OpenAI API: {url}/v1   Swagger UI: {url}/docs   metrics: {url}/metrics",
        f"  API key: {key};  chat template: {template}",
    ]
    loras = app.state.chat.lora_requests
    if loras:
        lines.append(f"  LoRA adapters (request `model`): {', '.join(loras)}; {cfg.max_loras} on "
                     f"the device at once, rank <= {cfg.max_lora_rank}, {cfg.max_cpu_loras} "
                     "kept in CPU memory")
    if a.root_path:
        lines.append(f"  behind a proxy at {a.root_path}: clients use <proxy>{a.root_path}/v1")
    if a.allowed_origins:
        lines.append(f"  CORS: browsers may call it from {', '.join(a.allowed_origins)}")
    if a.host in ("0.0.0.0", "::"):
        lines.append(f"  listening on every interface ({a.host}): other machines can connect "
                     "through this machine's address.")
    return "\n".join(lines)


class StatsLogger:
    """vLLM's periodic engine line, read from the server's own metrics (what /metrics shows):
    prompt and generation tokens per second, running and waiting requests, KV-cache use. Said
    only for intervals in which something ran; `--disable-log-stats` turns it off."""

    def __init__(self, metrics, interval: float = STATS_INTERVAL_S):
        self.metrics, self.interval = metrics, interval
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="minipaged-stats", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        from minipaged.server.metrics import parse_metrics
        before, t0 = {}, time.monotonic()
        while not self.stopped.wait(self.interval):
            now, t1 = parse_metrics(self.metrics.render().decode()), time.monotonic()
            line = self.line(before, now, t1 - t0)
            if line:
                logger.info(line)
            before, t0 = now, t1

    @staticmethod
    def line(before: dict, now: dict, seconds: float) -> Optional[str]:
        """The line for one interval between two `parse_metrics` readings (None: idle)."""
        def get(values, name):
            return values.get("minipaged:" + name, 0.0)
        prompt = get(now, "prompt_tokens_total") - get(before, "prompt_tokens_total")
        generated = get(now, "generation_tokens_total") - get(before, "generation_tokens_total")
        running, waiting = get(now, "num_requests_running"), get(now, "num_requests_waiting")
        if not (prompt or generated or running or waiting):
            return None
        return (f"engine: prompt {prompt / seconds:,.1f} tok/s, generation "
                f"{generated / seconds:,.1f} tok/s, running {running:.0f} reqs, waiting "
                f"{waiting:.0f} reqs, KV cache {100 * get(now, 'kv_cache_usage_perc'):.1f}% used")


def serve(argv: list[str]) -> int:
    a = parse_args(argv)
    for note in compat_notes(a):
        print(f"note: {note}", file=sys.stderr)
    check_serve_extras()
    check_ssl(a.ssl_keyfile, a.ssl_certfile)
    check_tool_flags(a)
    load_chat_template(a.chat_template)  # a missing template file, before the load too
    config = engine_config_from_args(a)  # values and device checked; the model is not loaded
    lora_requests_from_args(a, config, a.served_model_name or [a.model])  # adapter folders too
    with bind_socket(a.host, a.port) as sock:  # a busy port fails here, before the load
        app = build_app_from_args(a, config=config)
        import uvicorn
        from minipaged.server.api_server import GracefulServer
        print(banner(a, app, port=sock.getsockname()[1]), flush=True)
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        server_config = uvicorn.Config(
            app, host=a.host, port=a.port, log_level=a.uvicorn_log_level,
            access_log=not a.disable_log_requests, root_path=a.root_path,
            ssl_keyfile=a.ssl_keyfile, ssl_certfile=a.ssl_certfile,
            timeout_graceful_shutdown=a.shutdown_timeout + 5)
        stats = None if a.disable_log_stats else StatsLogger(app.state.metrics)
        if stats is not None:
            stats.start()
        try:
            GracefulServer(server_config, app.state.llm, a.shutdown_timeout).run(sockets=[sock])
        finally:
            if stats is not None:
                stats.stop()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(serve, argv)


if __name__ == "__main__":
    sys.exit(main())
