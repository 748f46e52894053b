"""`minipaged serve MODEL [flags]`: vLLM's `vllm serve` command line for minipaged. Lesson 07
explains it.

    minipaged serve stories260K --port 8000 --chat-template chat.jinja
    minipaged serve stories260K --served-model-name tiny --api-key secret --host 0.0.0.0
    minipaged serve dummy:qwen3-0.6b --max-model-len 4096 --gpu-memory-utilization 0.9

The flags are vLLM's names; where vLLM also accepts the underscore spelling (`--api_key`,
`--max_model_len`, ...) so does minipaged, so a course note's `vllm serve` line works as it is.

`--host` defaults to 127.0.0.1: only this machine can connect. `--host 0.0.0.0` listens on every
network interface, which is what a cloud box or a container needs for others to reach it (open the
port in the firewall, and set an --api-key: anyone who can reach the port can use the model).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Optional

from minipaged.cli.args import HelpFormatter, add_engine_args, engine_config_from_args, flag_names

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024  # (api_server.py's default too)

DESCRIPTION = __doc__.split("\n\n")[0].replace("\n", " ")


def _flag(p, name: str, *aliases: str, **kw):
    """Add `--some-flag`, its vLLM spelling `--some_flag`, and any other aliases."""
    return p.add_argument(*flag_names(name[2:].replace("-", "_")), *aliases, **kw)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minipaged serve", description=DESCRIPTION,
                                formatter_class=HelpFormatter)
    s = p.add_argument_group("server")
    _flag(s, "--served-model-name", nargs="+", default=None,
          help="name(s) clients use in `model`; default: MODEL")
    _flag(s, "--api-key", default=None,
          help="require `Authorization: Bearer KEY` on /v1 routes (or set $MINIPAGED_API_KEY)")
    s.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on; 0.0.0.0 = every interface (reachable from "
                        "other machines)")
    s.add_argument("--port", type=int, default=8000)
    _flag(s, "--chat-template", default=None,
          help="a Jinja chat template: a file path, or the template itself")
    _flag(s, "--reasoning-parser", default=None,
          help="split <think>...</think> into reasoning_content (e.g. deepseek_r1, qwen3)")
    _flag(s, "--enable-reasoning", action="store_true",
          help="accepted for old vLLM commands; --reasoning-parser alone is enough")
    _flag(s, "--uvicorn-log-level", default="info",
          choices=["critical", "error", "warning", "info", "debug", "trace"])
    _flag(s, "--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
          help="refuse request bodies larger than this with a 413")
    _flag(s, "--shutdown-timeout", type=float, default=30.0,
          help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before they are "
               "ended with an error (new requests get 503 meanwhile)")
    add_engine_args(p)  # every EngineConfig field, as in `minipaged generate` and `bench`
    c = p.add_argument_group("accepted for vLLM compatibility")
    _flag(c, "--trust-remote-code", action="store_true",
          help="not needed: minipaged implements the Llama family itself and runs no model code")
    c.add_argument("-tp", dest="tensor_parallel_size", type=int, default=argparse.SUPPRESS,
                   help="vLLM's short form of --tensor-parallel-size")
    return p


def compat_notes(a) -> list[str]:
    notes = []
    if a.trust_remote_code:
        notes.append("--trust-remote-code: not needed here. vLLM passes it to transformers to run "
                     "Python code shipped with a model; minipaged implements the Llama family "
                     "(Llama, Mistral, Qwen2, Qwen3) itself and never runs code from a model "
                     "folder.")
    if a.enable_reasoning:
        notes.append("--enable-reasoning: not needed (newer vLLM dropped it too); "
                     "--reasoning-parser turns reasoning on.")
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


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    a = make_parser().parse_args(argv)
    a.model = a.model_arg or a.model
    a.api_key = a.api_key or os.environ.get("MINIPAGED_API_KEY") or None
    return a


def build_app_from_args(a: argparse.Namespace, in_process: bool = False):
    """Start the engine core (it loads the model), then build the AsyncLLM, metrics and app.
    `in_process=True` runs the core in a thread of this process (tests, notebooks)."""
    from minipaged.server.api_server import build_app
    from minipaged.server.async_llm import AsyncLLM
    from minipaged.server.metrics import Metrics
    from minipaged.server.reasoning import get_reasoning_parser

    parser = get_reasoning_parser(a.reasoning_parser) if a.reasoning_parser else None
    template = load_chat_template(a.chat_template)
    names = a.served_model_name or [a.model]
    config = engine_config_from_args(a)
    if config.max_trace_len is None:  # a server runs for days: keep the newest steps only
        config = dataclasses.replace(config, max_trace_len=10_000)
    llm = AsyncLLM(config, Metrics(names[0]), in_process=in_process)
    root = llm.info["model_path"] or a.model
    return build_app(llm, names, api_key=a.api_key, chat_template=template,
                     reasoning_parser=parser, model_root=root,
                     max_request_body_bytes=a.max_request_body_bytes)


def banner(a, app) -> str:
    llm = app.state.llm
    cfg, info = llm.config, llm.info
    url = f"http://{'127.0.0.1' if a.host in ('0.0.0.0', '::') else a.host}:{a.port}"
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
    if a.host in ("0.0.0.0", "::"):
        lines.append(f"  listening on every interface ({a.host}): other machines can connect "
                     "through this machine's address.")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    for note in compat_notes(a):
        print(f"note: {note}", file=sys.stderr)
    try:
        app = build_app_from_args(a)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:  # teaching errors
        print(f"error: {e}", file=sys.stderr)
        return 1
    import uvicorn
    from minipaged.server.api_server import GracefulServer
    print(banner(a, app), flush=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(app, host=a.host, port=a.port, log_level=a.uvicorn_log_level,
                            timeout_graceful_shutdown=a.shutdown_timeout + 5)
    GracefulServer(config, app.state.llm, a.shutdown_timeout).run()
    return 0



if __name__ == "__main__":
    sys.exit(main())
