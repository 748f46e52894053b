"""Finding models: HF directories, hub ids, the built-in `stories260K`, dummy presets, GGUF files
(lessons 06, 08 and 11 read model configs through it; lesson 11 reads a GGUF file).

    LLM("stories260K")            the real tiny Llama of the lessons: found locally, else fetched
    LLM("/path/to/hf_dir")        config.json + *.safetensors + tokenizer files
    LLM("Qwen/Qwen3-0.6B")        a hub id (downloaded when the machine is online)
    LLM("dummy:qwen3-0.6b")       a real architecture's shapes with random ("dummy") weights
    LLM("/path/to/model.gguf")    a llama.cpp GGUF file, read directly (gguf_loader.py)

stories260K is looked for, in order, in `download_dir` when one is given, every directory in
$MINIPAGED_MODEL_PATH (os.pathsep separated), `../shared/models` beside the current directory and
beside this checkout (the course's layout), and the models cache `~/.cache/minipaged/models` (or
$MINIPAGED_CACHE/models): in each, a folder `stories260K/hf/` or `stories260K/` with config.json.
Then a `stories260K/stories260K.gguf` placed in one of them by hand is checked and converted into
the cache. Then, when the machine is online, ggml-org's GGUF is fetched from the Hugging Face hub,
checked against its SHA-256 and converted (`hub.py`; `minipaged download stories260K` does the
same up front). Offline, the error names the files, their URLs and where to put them.

`resolve_model` returns a `ModelSource`: the config.json dict and where the weights are; it
builds nothing, so the engine's config reads a model's shapes (a draft model's, too) without
the model code. loader.py builds the model from a source.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

import minipaged.models.gguf_loader as gguf_loader
import minipaged.models.hub as hub

BUILTIN_MODELS = {key: model.name for key, model in hub.HUB_MODELS.items()}  # "stories260k" -> folder
DUMMY_PREFIX = "dummy:"
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def dummy_presets() -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in resources.files("minipaged.models")
                  .joinpath("presets").iterdir() if p.name.endswith(".json"))


def shared_model_dirs() -> list[Path]:
    """The course's layout: `../shared/models` beside the working directory, its parent, the checkout."""
    repo_root = Path(__file__).resolve().parents[2]
    return [base.parent / "shared" / "models" for base in (Path.cwd(), Path.cwd().parent, repo_root)]


def model_search_path() -> list[Path]:
    """Directories searched for built-in models, in order (`download_dir` goes before them all)."""
    paths = [Path(p) for p in os.environ.get("MINIPAGED_MODEL_PATH", "").split(os.pathsep) if p]
    paths += shared_model_dirs()
    paths.append(hub.models_dir())
    seen, unique = set(), []
    for p in paths:
        key = os.path.normpath(os.path.abspath(p))
        if key not in seen:
            seen.add(key)
            unique.append(Path(key))
    return unique


def resolve_builtin(name: str, download_dir: Optional[str | os.PathLike] = None,
                    revision: Optional[str] = None) -> Path:
    """The HF folder of built-in model `name`: found on the search path, else fetched (see above)."""
    model = hub.HUB_MODELS[name.lower()]
    bases = ([hub.models_dir(download_dir)] if download_dir is not None else []) + model_search_path()
    looked = []
    for base in bases:
        for candidate in (base / model.name / "hf", base / model.name):
            looked.append(candidate)
            if (candidate / "config.json").is_file():
                return candidate
    for base in bases:
        if (base / model.name / model.gguf_name).is_file():  # the offline fix: a GGUF put in place
            return hub.install_gguf(model, base / model.name / model.gguf_name, download_dir)
    try:
        return hub.download_gguf_model(model, download_dir, revision)
    except hub.HubUnavailableError as e:
        raise FileNotFoundError(builtin_not_found_message(model, looked, e, download_dir)) from e


def builtin_not_found_message(model: hub.GGUFModel, looked: list[Path], cause: Exception,
                              download_dir=None) -> str:
    """What an offline machine is told: where it looked, which files, from where, to where."""
    target = hub.models_dir(download_dir) / model.name
    primary, *mirrors = model.urls()
    mirror = f" (mirror: {', '.join(mirrors)})" if mirrors else ""
    return (
        f"built-in model {model.name!r} is not on this machine, and fetching it from the Hugging "
        f"Face hub failed ({cause}).\n"
        "Looked for a folder with config.json in:\n  " + "\n  ".join(map(str, looked)) + "\n"
        "To fix it, do one of these:\n"
        f"  - where the machine is online, run `minipaged download {model.name}`: it fetches the "
        f"GGUF, checks its SHA-256 and converts it into {target / 'hf'}\n"
        f"  - download {primary}{mirror}, {model.size:,} bytes, SHA-256 {model.sha256}, and put it "
        f"at {target / model.gguf_name}: it is checked and converted on first use\n"
        f"  - copy an HF-format folder of it ({', '.join(HF_FILES)}; the course's "
        f"shared/models/{model.name}/hf is one) to {target / 'hf'}, or to "
        f"DIR/{model.name}/hf and set MINIPAGED_MODEL_PATH=DIR")


def download_model(model: str, download_dir: Optional[str | os.PathLike] = None,
                   revision: Optional[str] = None) -> Path:
    """Fetch `model` (a built-in name or a hub id) now, into the cache or `download_dir`; its folder.

    `minipaged download` calls this. A built-in model goes to `<models dir>/<name>/hf` (nothing
    is fetched when it is already there); a hub id goes to the Hugging Face cache layout.
    """
    if model.lower() in hub.HUB_MODELS:
        return hub.download_gguf_model(hub.HUB_MODELS[model.lower()], download_dir, revision)
    return _download(model, download_dir, revision)


@dataclass
class ModelSource:
    """Where a model's config, weights and tokenizer come from."""

    name: str
    config: dict
    path: Optional[Path]  # HF-format directory (None for dummy presets and GGUF files)
    dummy: bool = False
    gguf: Optional[Path] = None  # a GGUF file: config, weights and tokenizer read from it

    @property
    def has_tokenizer(self) -> bool:
        return self.path is not None and any((self.path / f).is_file() for f in
                                             ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def resolve_model(model: str | os.PathLike, download_dir: Optional[str | os.PathLike] = None,
                  revision: Optional[str] = None) -> ModelSource:
    """Where `model`'s files are. `download_dir` and `revision` (vLLM's names) apply to what is
    fetched from the hub: built-in models and hub ids."""
    model = str(model)
    if model.startswith(DUMMY_PREFIX):
        preset = model[len(DUMMY_PREFIX):].lower()
        if preset not in dummy_presets():
            raise ValueError(f"unknown dummy preset {preset!r}; presets: {dummy_presets()}")
        text = resources.files("minipaged.models").joinpath("presets", f"{preset}.json").read_text()
        return ModelSource(name=model, config=json.loads(text), path=None, dummy=True)
    if gguf_loader.is_gguf(model):
        return ModelSource(name=model, config=gguf_loader.gguf_config(model), path=None,
                           gguf=Path(model))
    if model.lower() in BUILTIN_MODELS:
        path = resolve_builtin(model, download_dir, revision)
    elif Path(model).is_dir():
        path = Path(model)
    else:
        path = _download(model, download_dir, revision)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face model folder")
    return ModelSource(name=model, config=json.loads(config_file.read_text()), path=path)


def _download(repo_id: str, download_dir=None, revision: Optional[str] = None) -> Path:
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                      allow_patterns=["*.json", "*.safetensors", "*.model",
                                                      "*.txt", "*.jinja"]))
    except Exception as e:  # offline, unknown id, gated repo ...
        raise FileNotFoundError(
            f"{repo_id!r} is not a local folder, and fetching it from the Hugging Face hub failed "
            f"({type(e).__name__}: {e}). Pass a folder with config.json + *.safetensors, "
            f"'stories260K', or one of the dummy presets {[DUMMY_PREFIX + p for p in dummy_presets()]}"
        ) from e
