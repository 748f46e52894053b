"""The engine flags, generated from `EngineConfig`: one declaration for generate, bench and serve.

Every field of `EngineConfig` (config.py) becomes a flag with vLLM's spelling (`--max-model-len`)
and its underscore twin (`--max_model_len`, which vLLM accepts too, so a course note's command line
works as it is); the field's `help` and `choices` come along. Booleans become `--flag` /
`--no-flag` pairs (`--no-enable-prefix-caching`, `--no-async-scheduling`); a boolean whose default
is `None` ("decide for the device") stays `None` unless one of the pair is given. The model is also
accepted positionally, as in `vllm serve MODEL`.
"""
from __future__ import annotations

import argparse
import dataclasses

from minipaged.config import EngineConfig, engine_fields

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _base_type(annotation: str):
    """'Optional[int]' -> int, 'bool' -> bool (the annotations are strings: `from __future__`)."""
    name = annotation.removeprefix("Optional[").removesuffix("]")
    return _TYPES[name]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, each flag's default after its help (unless it is None)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def flag_names(name: str) -> list[str]:
    """`max_model_len` -> ["--max-model-len", "--max_model_len"] (vLLM accepts both)."""
    dashed = "--" + name.replace("_", "-")
    return [dashed] if "_" not in name else [dashed, "--" + name]


def add_engine_args(parser: argparse.ArgumentParser, model_default: str = "stories260K") -> None:
    """Add one flag per `EngineConfig` field (in an "engine" group) and the positional MODEL."""
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                        help=f"the model (same as --model; default {model_default})")
    group = parser.add_argument_group("engine (EngineConfig)")
    for f in engine_fields():
        kind = _base_type(f.type)
        meta = dict(f.metadata)
        help_text = meta.pop("help", "")
        default = model_default if f.name == "model" else f.default
        if kind is bool:
            group.add_argument(*flag_names(f.name), dest=f.name, default=default,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(*flag_names(f.name), dest=f.name, type=kind, default=default,
                               help=help_text, **meta)


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The `EngineConfig` a parsed command line asks for (`overrides` win)."""
    values = {f.name: getattr(args, f.name) for f in engine_fields()}
    if getattr(args, "model_arg", None):
        values["model"] = args.model_arg
    values.update(overrides)
    return EngineConfig(**values)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The same as keyword arguments of `LLM(...)`."""
    return dataclasses.asdict(engine_config_from_args(args))


__all__ = ["HelpFormatter", "add_engine_args", "engine_config_from_args", "engine_kwargs",
           "flag_names"]
