"""Building a model from a `ModelSource` (source.py finds it): `LlamaForCausalLM` in the
engine's dtype on its device, its weights from safetensors, a GGUF file or a dummy preset's
seeded init; then the optional weight quantization (lesson 11), and the tokenizer.

The finding half (HF folders, hub ids, stories260K, dummy presets) is `models/source.py`; its
names are imported here too, so `minipaged.models.loader.resolve_model` keeps working.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import torch

import minipaged.models.gguf_loader as gguf_loader
from minipaged.models.config import ModelConfig
from minipaged.models.source import (BUILTIN_MODELS, DUMMY_PREFIX, HF_FILES,  # noqa: F401
                                     ModelSource, builtin_not_found_message, download_model,
                                     dummy_presets, model_search_path, resolve_builtin,
                                     resolve_model, shared_model_dirs)


def get_layers(fused: bool):
    """The torch `Layers` (models/layers.py), or their fused Triton variants (imported only when
    asked for: they need `triton`, and on the CPU TRITON_INTERPRET=1 set before they are
    defined)."""
    if fused:
        from minipaged.models.fused_layers import FUSED_LAYERS
        return FUSED_LAYERS
    from minipaged.models.layers import TORCH_LAYERS
    return TORCH_LAYERS


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
               max_positions: int, seed: int = 0, fused_ops: bool = False, tp=None,
               quantization: Optional[str] = None):
    """Build `LlamaForCausalLM` on `device` in `dtype` and fill its weights.

    `fused_ops`: build it from the fused Triton layers (models/fused_layers.py) instead of the
    torch ones (the engine decides, in `EngineConfig.resolve`). `tp` (distributed.TPGroup):
    build this rank's shard of the model instead (models/parallel_llama.py). `quantization`
    ("fp8"): once the float weights are in, replace the linear layers by their quantized
    variant (models/quantization/).
    """
    from minipaged.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_dict(source.config)
    if tp is not None:
        from minipaged.models.parallel_llama import load_tensor_parallel_model
        model = load_tensor_parallel_model(source, cfg, dtype, device, backend, max_positions,
                                           seed, get_layers(fused_ops), tp)
        return _quantize(model, quantization), cfg
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, max_positions, get_layers(fused_ops))
    model = model.to_empty(device=device).to(dtype)  # parameters allocated, not yet filled
    model.rotary.init_table(device)
    if source.dummy:
        model.init_dummy_weights(seed)
    elif source.gguf is not None:
        model.load_weights(gguf_loader.iter_gguf_weights(source.gguf))
    else:
        model.load_weights(iter_safetensors(source.path))
    return _quantize(model.eval(), quantization), cfg


def _quantize(model, quantization: Optional[str]):
    if quantization is None:
        return model
    from minipaged.models.quantization import quantize_model
    return quantize_model(model, quantization)


def load_tokenizer(source: ModelSource, tokenizer: Optional[str] = None):
    """A `transformers` fast tokenizer, or None for dummy presets (then prompts must be token ids)."""
    from transformers import AutoTokenizer
    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer)
    if source.gguf is not None:
        return gguf_loader.load_gguf_tokenizer(source.gguf, source.config["max_position_embeddings"])
    if not source.has_tokenizer:
        return None
    return AutoTokenizer.from_pretrained(str(source.path))
