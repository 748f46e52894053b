"""Finding and loading models: HF directories, hub ids, the built-in `stories260K`, dummy presets.

    LLM("stories260K")            the real tiny Llama of the lessons, found on a search path
    LLM("/path/to/hf_dir")        config.json + *.safetensors + tokenizer files
    LLM("Qwen/Qwen3-0.6B")        a hub id (downloaded when the machine is online)
    LLM("dummy:qwen3-0.6b")       a real architecture's shapes with random ("dummy") weights

stories260K is looked for in, in order: every directory in $MINIPAGED_MODEL_PATH (os.pathsep
separated), `../shared/models` beside the current directory and beside this checkout, and the
cache directory `~/.cache/minipaged/models` (or $MINIPAGED_CACHE). The error lists every place.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterator, Optional

import torch

from minipaged.models.config import ModelConfig

BUILTIN_MODELS = {"stories260k": "stories260K"}
DUMMY_PREFIX = "dummy:"


def dummy_presets() -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in resources.files("minipaged.models")
                  .joinpath("presets").iterdir() if p.name.endswith(".json"))


def model_search_path() -> list[Path]:
    """Directories searched for built-in models, in order."""
    paths = [Path(p) for p in os.environ.get("MINIPAGED_MODEL_PATH", "").split(os.pathsep) if p]
    repo_root = Path(__file__).resolve().parents[2]
    for base in (Path.cwd(), Path.cwd().parent, repo_root):
        paths.append(base.parent / "shared" / "models")
    cache = os.environ.get("MINIPAGED_CACHE") or Path.home() / ".cache" / "minipaged"
    paths.append(Path(cache) / "models")
    seen, unique = set(), []
    for p in paths:
        key = os.path.normpath(os.path.abspath(p))
        if key not in seen:
            seen.add(key)
            unique.append(Path(key))
    return unique


def resolve_builtin(name: str) -> Path:
    folder = BUILTIN_MODELS[name.lower()]
    looked = []
    for base in model_search_path():
        for candidate in (base / folder / "hf", base / folder):
            looked.append(str(candidate))
            if (candidate / "config.json").is_file():
                return candidate
    raise FileNotFoundError(
        f"built-in model {folder!r} not found. Looked for a folder with config.json in:\n  "
        + "\n  ".join(looked)
        + f"\nPut the HF-format files in one of these (e.g. ~/.cache/minipaged/models/{folder}/hf) "
        "or set MINIPAGED_MODEL_PATH to the folder that contains it.")


@dataclass
class ModelSource:
    """Where a model's config, weights and tokenizer come from."""

    name: str
    config: dict
    path: Optional[Path]  # HF-format directory (None for dummy presets)
    dummy: bool = False

    @property
    def has_tokenizer(self) -> bool:
        return self.path is not None and any((self.path / f).is_file() for f in
                                             ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def resolve_model(model: str | os.PathLike) -> ModelSource:
    model = str(model)
    if model.startswith(DUMMY_PREFIX):
        preset = model[len(DUMMY_PREFIX):].lower()
        if preset not in dummy_presets():
            raise ValueError(f"unknown dummy preset {preset!r}; presets: {dummy_presets()}")
        text = resources.files("minipaged.models").joinpath("presets", f"{preset}.json").read_text()
        return ModelSource(name=model, config=json.loads(text), path=None, dummy=True)
    if model.lower() in BUILTIN_MODELS:
        path = resolve_builtin(model)
    elif Path(model).is_dir():
        path = Path(model)
    else:
        path = _download(model)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face model folder")
    return ModelSource(name=model, config=json.loads(config_file.read_text()), path=path)


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                               "*.txt", "*.jinja"]))
    except Exception as e:  # offline, unknown id, gated repo ...
        raise FileNotFoundError(
            f"{repo_id!r} is not a local folder, and fetching it from the Hugging Face hub failed "
            f"({type(e).__name__}: {e}). Pass a folder with config.json + *.safetensors, "
            f"'stories260K', or one of the dummy presets {[DUMMY_PREFIX + p for p in dummy_presets()]}"
        ) from e


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device, backend,
               max_positions: int, seed: int = 0, fused_ops: bool = False):
    """Build `LlamaForCausalLM` on `device` in `dtype` and fill its weights.

    `fused_ops`: build it from the fused Triton layers (models/fused_layers.py) instead of the
    torch ones (the engine decides, in `EngineConfig.resolve`).
    """
    from minipaged.models.layers import get_layers
    from minipaged.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_dict(source.config)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, max_positions, get_layers(fused_ops))
    model = model.to_empty(device=device).to(dtype)  # parameters allocated, not yet filled
    model.rotary.init_table(device)
    if source.dummy:
        model.init_dummy_weights(seed)
    else:
        model.load_weights(iter_safetensors(source.path))
    return model.eval(), cfg


def load_tokenizer(source: ModelSource, tokenizer: Optional[str] = None):
    """A `transformers` fast tokenizer, or None for dummy presets (then prompts must be token ids)."""
    from transformers import AutoTokenizer
    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer)
    if not source.has_tokenizer:
        return None
    return AutoTokenizer.from_pretrained(str(source.path))
