"""The command line's parser and the engine flags, generated from `EngineConfig`.

One declaration for every command: each field of `EngineConfig` (config.py, `_knob(default,
help, ...)`) becomes a flag with vLLM's spelling (`--max-model-len`; the underscore spelling
`--max_model_len` works too, as in vLLM, so a course note's command line works as it is); the
field's help, choices and default come along. Booleans become `--flag` / `--no-flag` pairs
(`--no-enable-prefix-caching`); a field whose default is `None` is decided for the device by
`EngineConfig.resolve` and shows "(default: auto)" (`--max-model-len auto` asks for it
explicitly). The model is positional, as in `vllm serve MODEL` (`--model` works too).

`FlexibleArgumentParser` (vLLM's name) adds three things to argparse: a refused flag raises
`CLIError` (one `error:` line, errors.py) instead of printing the usage; every flag also takes its
underscore spelling (`--max_tokens`); and `--config FILE.yaml` reads flags from a YAML file in
vLLM's format (keys are flag names without the dashes):

    # serve.yaml                                    minipaged serve --config serve.yaml --port 9000
    model: stories260K
    max-model-len: 256
    enable-prefix-caching: false                    # booleans: true / false
    served-model-name: [tiny, stories]              # several values: a list

Flags on the command line override the file's.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
from pathlib import Path
from typing import Optional

from minipaged.cli.errors import CLIError, one_line
from minipaged.config import EngineConfig, engine_fields



def _json_object(text: str) -> dict:
    """A flag that takes a JSON object, as vLLM's `--speculative-config '{"method": ...}'`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"method\": "
                                         f"\"ngram\", \"num_speculative_tokens\": 4}}', got "
                                         f"{text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {text!r}")
    return value


_json_object.__name__ = "JSON"
_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "dict": _json_object}

# Where a model comes from (vLLM's names). `--download-dir` and `--revision` go to the loader's
# `resolve_model`, which fetches the model before the engine starts (engine_config_from_args).
MODEL_SOURCE_FLAGS = {
    "download_dir": "where fetched models are kept (built-in models: DIR/<name>/hf, looked for "
                    "there first; hub ids: the Hugging Face cache layout); default: "
                    "$MINIPAGED_CACHE/models or ~/.cache/minipaged/models, the HF cache for hub ids",
    "revision": "the hub revision (branch, tag or commit) of a model fetched from the hub",
}


# --- the parser -------------------------------------------------------------------------------
class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, each flag's default after its help (unless it is None)."""

    def _get_help_string(self, action):
        if action.default is None or not action.help:
            return action.help
        return super()._get_help_string(action)


class FlexibleArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors and `--config FILE.yaml` (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise CLIError(f"{message} (see `{self.prog} --help`)")

    def parse_args(self, args=None, namespace=None):
        args = [self._dashed(a) for a in (sys.argv[1:] if args is None else args)]
        path = _config_path(args)
        if path is not None and namespace is None:
            namespace = self.namespace_from_config(path)  # parsed first: the command line wins
        return super().parse_args(args, namespace)

    def _dashed(self, arg: str) -> str:
        """`--max_tokens=8` -> `--max-tokens=8` when only the dashed flag exists (as vLLM does)."""
        name, eq, value = arg.partition("=")
        dashed = name.replace("_", "-")
        if (name.startswith("--") and name not in self._option_string_actions
                and dashed in self._option_string_actions):
            return dashed + eq + value
        return arg

    def namespace_from_config(self, path: str) -> argparse.Namespace:
        """The flags a YAML file sets, as a namespace holding only those."""
        import yaml
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"--config {path}: no such file")
        try:
            data = yaml.safe_load(file.read_text())
        except yaml.YAMLError as e:
            raise CLIError(f"--config {path} is not valid YAML: {one_line(str(e))}") from None
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise CLIError(f"--config {path}: expected `flag-name: value` lines, got a "
                           f"{type(data).__name__}")
        tokens, dests = [], []
        for key, value in data.items():
            try:
                action, flag = self._flag_for_key(str(key))
                tokens += _flag_tokens(flag, action, value)
            except CLIError as e:
                raise CLIError(f"--config {path}: {e}") from None
            dests.append(action.dest)
        try:
            parsed = super().parse_args(tokens)
        except CLIError as e:
            raise CLIError(f"--config {path}: {e}") from None
        return argparse.Namespace(**{dest: getattr(parsed, dest) for dest in dests})

    def _flag_for_key(self, key: str) -> tuple[argparse.Action, str]:
        if key == "config":
            raise CLIError("a config file cannot name another (`config:`)")
        for spelling in (key, key.replace("_", "-")):
            action = self._option_string_actions.get("--" + spelling)
            if action is not None and action.dest not in ("help", "config"):
                return action, "--" + spelling
        known = sorted({s[2:] for s in self._option_string_actions
                        if s.startswith("--") and s not in ("--help", "--config")})
        close = difflib.get_close_matches(key, known, n=2)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise CLIError(f"unknown key {key!r}{hint}; keys are the flags of `{self.prog}` without "
                       "the dashes, e.g. `max-model-len: 256`")


def _config_path(args: list[str]) -> Optional[str]:
    """The value of `--config FILE` / `--config=FILE` in `args` (None if absent)."""
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _flag_tokens(flag: str, action: argparse.Action, value) -> list[str]:
    """One YAML entry as command-line tokens: `max-model-len: 256` -> ["--max-model-len", "256"]."""
    if value is None:
        return []  # `key:` with no value: the default
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            raise CLIError(f"{flag[2:]}: expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []  # store_true: false is the default
    values = value if isinstance(value, list) else [value]
    if isinstance(action, argparse._AppendAction):  # --prompt a --prompt b
        return [token for v in values for token in (flag, str(v))]
    if action.nargs in ("+", "*"):
        return [flag, *map(str, values)]
    return [flag, json.dumps(value) if isinstance(value, (list, dict)) else str(value)]


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """`--config` and `--debug`, which every command takes."""
    group = parser.add_argument_group("command line")
    group.add_argument("--config", metavar="FILE.yaml", default=None,
                       help="read flags from a YAML file (keys: flag names without the dashes); "
                            "flags given here override it")
    group.add_argument("--debug", action="store_true",
                       help="on an error, show the full traceback instead of one `error:` line")


def int_at_least(lo: int):
    """An argparse type: an integer >= lo, refused with the number and the bound."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value
    return convert


# --- the engine flags ------------------------------------------------------------------------
def _base_type(annotation: str):
    """'Optional[int]' -> int, 'bool' -> bool (the annotations are strings: `from __future__`)."""
    name = annotation.removeprefix("Optional[").removesuffix("]")
    return _TYPES[name]


def _auto_or(kind, choices=None):
    """An argparse type for a field whose default is None: "auto" -> None, else `kind(text)`."""
    def convert(text: str):
        if text == "auto":
            return None
        value = kind(text)  # a ValueError reads "invalid int value: 'x'"
        if choices is not None and value not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from auto, {', '.join(choices)})")
        return value
    convert.__name__ = kind.__name__
    return convert


SHORT_FLAGS = {"tensor_parallel_size": ["-tp"]}  # vLLM's


def flag_names(name: str, twins: bool = True) -> list[str]:
    """`max_model_len` -> ["--max-model-len", "--max_model_len"] (vLLM accepts both; without
    `twins` only the first: a FlexibleArgumentParser takes every underscore spelling itself)."""
    dashed = "--" + name.replace("_", "-")
    names = [dashed] if "_" not in name or not twins else [dashed, "--" + name]
    return names + SHORT_FLAGS.get(name, [])


def add_engine_args(parser: argparse.ArgumentParser, model_default: str = "stories260K") -> None:
    """Add the positional MODEL and one flag per `EngineConfig` field, in an "engine" group."""
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                        help=f"the model, as --model (default: {model_default})")
    group = parser.add_argument_group("engine (EngineConfig)")
    twins = not isinstance(parser, FlexibleArgumentParser)  # a plain argparse parser needs them
    for f in engine_fields():
        kind = _base_type(f.type)
        meta = dict(f.metadata)
        help_text = meta.pop("help", "")
        default = model_default if f.name == "model" else f.default
        if default is None:  # decided by resolve; a JSON knob (speculative_config) is off
            help_text += " (default: off)" if kind is _json_object else " (default: auto)"
        if kind is bool:
            group.add_argument(*flag_names(f.name, twins), dest=f.name, default=default,
                               action=argparse.BooleanOptionalAction, help=help_text)
        elif default is None:  # decided by EngineConfig.resolve; "auto" asks for that
            choices = meta.pop("choices", None)
            metavar = "{" + ",".join(("auto", *choices)) + "}" if choices else None
            if kind is _json_object:
                metavar = "JSON"
            group.add_argument(*flag_names(f.name, twins), dest=f.name, default=None,
                               type=_auto_or(kind, choices), metavar=metavar, help=help_text,
                               **meta)
        else:
            group.add_argument(*flag_names(f.name, twins), dest=f.name, type=kind, default=default,
                               help=help_text, **meta)
    names = {f.name for f in engine_fields()}
    for name, help_text in MODEL_SOURCE_FLAGS.items():
        if name not in names:  # (unless EngineConfig declares them itself)
            group.add_argument(*flag_names(name, twins), dest=name, default=None, help=help_text)


def check_device(device: str) -> None:
    """`--device` against this torch, before anything is loaded (the rule of
    `EngineConfig.resolve`, which checks again)."""
    if device == "auto":
        return
    import torch
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a device torch knows: use auto, cpu, cuda "
                         "or cuda:N") from None
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = ("a CPU-only build: a GPU needs a CUDA build of torch" if torch.version.cuda is None
                 else f"built for CUDA {torch.version.cuda}, but no GPU or driver is visible")
        raise ValueError(f"device={device!r}, but this torch ({torch.__version__}, {build}) sees "
                         "no CUDA GPU. Use --device cpu (or auto).")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}, but this machine has {torch.cuda.device_count()} "
                         f"CUDA GPU(s): cuda:0 .. cuda:{torch.cuda.device_count() - 1}")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The `EngineConfig` a parsed command line asks for (`overrides` win), checked (values,
    device) before anything is loaded. With `--download-dir` / `--revision`, the model is
    fetched (or found) first and the config names its folder."""
    values = {f.name: getattr(args, f.name) for f in engine_fields()}
    if getattr(args, "model_arg", None):
        values["model"] = args.model_arg
    values.update(overrides)
    config = EngineConfig(**values)
    config.validate()
    check_device(config.device)
    source = {n: getattr(args, n, None) for n in MODEL_SOURCE_FLAGS if n not in values}
    if any(v is not None for v in source.values()):
        from minipaged.models.loader import resolve_model
        path = resolve_model(config.model, **source).path  # None for dummy presets
        if path is not None:
            config = dataclasses.replace(config, model=str(path))
    return config


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The same as keyword arguments of `LLM(...)`."""
    return dataclasses.asdict(engine_config_from_args(args))


__all__ = ["FlexibleArgumentParser", "HelpFormatter", "MODEL_SOURCE_FLAGS", "add_common_args",
           "add_engine_args", "check_device", "engine_config_from_args", "engine_kwargs",
           "flag_names", "int_at_least"]
