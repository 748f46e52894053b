"""The LoRA flags of `serve`, `generate` and `chat`: one parser for `--lora-modules` (lesson 11).

    minipaged serve stories260K --enable-lora --lora-modules sql=/adapters/sql \
        '{"name": "chat", "path": "/adapters/chat"}'          a request's `model` picks one
    minipaged generate stories260K --enable-lora --lora-modules sql=/adapters/sql --lora sql
    minipaged chat stories260K --enable-lora --lora-modules sql=/adapters/sql --lora sql

`--lora-modules` takes vLLM's two forms (name=path, or a JSON object with "name" and "path"),
needs `--enable-lora`, and its folders' adapter_config.json are checked before the model loads.
The adapters get the ids 1, 2, ... in the order given. `--lora NAME` (generate, chat) runs
every prompt with that adapter; without it they run on the base model.
"""
from __future__ import annotations

import argparse
import json

from minipaged.cli.errors import CLIError


def parse_lora_module(text: str) -> tuple[str, str]:
    """`--lora-modules`: name=path, or vLLM's JSON form '{"name": ..., "path": ...}'."""
    if text.strip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object ({e})") from None
        if not isinstance(spec, dict) or not all(isinstance(spec.get(k), str)
                                                 for k in ("name", "path")):
            raise argparse.ArgumentTypeError('a JSON object with string "name" and "path", '
                                             'e.g. \'{"name": "sql", "path": "/adapters/sql"}\'')
        return spec["name"], spec["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected name=path (or a JSON object)")
    return name, path


def add_lora_module_args(group, picks: str) -> None:
    """`--lora-modules` on an argument group; `picks` says what chooses the adapter."""
    group.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                       metavar="NAME=PATH",
                       help=f"LoRA adapters (PEFT folders) {picks}: name=path or JSON "
                            "'{\"name\": ..., \"path\": ...}'; needs --enable-lora")


def add_lora_pick_arg(group) -> None:
    """`--lora NAME` (generate, chat): the adapter every prompt runs with."""
    add_lora_module_args(group, "that --lora can pick")
    group.add_argument("--lora", default=None, metavar="NAME",
                       help="run every prompt with this --lora-modules adapter; default: the "
                            "base model")


def lora_requests_from_args(a, config, served_names: list[str]):
    """The `--lora-modules` adapters as LoRARequests (ids 1, 2, ...), their folders checked."""
    from minipaged.lora.adapter import read_adapter_config
    from minipaged.lora.request import LoRARequest
    modules = a.lora_modules or []
    if modules and not config.enable_lora:
        raise CLIError("--lora-modules needs --enable-lora (the engine builds its adapter slots "
                       "only then)")
    requests = []
    for i, (name, path) in enumerate(modules):
        if name in served_names or name in [r.lora_name for r in requests]:
            raise CLIError(f"--lora-modules: the name {name!r} is used twice (served model "
                           f"names: {', '.join(served_names)}); give each adapter its own name")
        try:
            read_adapter_config(path, name)
        except ValueError as e:
            raise CLIError(f"--lora-modules: {e}") from None
        requests.append(LoRARequest(name, i + 1, path))
    return requests


def picked_lora(a, config):
    """The LoRARequest `--lora` names among `--lora-modules` (None without `--lora`)."""
    requests = lora_requests_from_args(a, config, [a.model])
    if a.lora is None:
        return None
    by_name = {r.lora_name: r for r in requests}
    if a.lora not in by_name:
        known = ", ".join(by_name) if by_name else "none: give --lora-modules NAME=PATH"
        raise CLIError(f"--lora {a.lora!r} is not one of the --lora-modules adapters ({known})")
    return by_name[a.lora]


__all__ = ["add_lora_module_args", "add_lora_pick_arg", "lora_requests_from_args",
           "parse_lora_module", "picked_lora"]
