"""A `minipaged serve` inside the lesson's own process, for lessons 07 and 12.

    with InProcessServer("stories260K", "--reasoning-parser", "deepseek_r1") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")

The arguments are `minipaged serve`'s flags (cli/serve.py); the app is the one the command
builds (`build_app_from_args`), with its engine core in a thread instead of a second process
(`in_process=True`) and uvicorn in a daemon thread, on a free port of 127.0.0.1. Nothing here is
on the server's path: it only starts and stops it.
"""
from __future__ import annotations

import socket
import threading
import time

import uvicorn

from minipaged.cli.serve import build_app_from_args, parse_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    def __init__(self, *argv: str, timeout: float = 60.0):
        self.port = free_port()
        self.app = build_app_from_args(parse_args([*argv, "--port", str(self.port)]),
                                       in_process=True)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)  # the app's lifespan stops the engine core

    def __enter__(self) -> "InProcessServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
