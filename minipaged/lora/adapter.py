"""Reading a PEFT LoRA adapter from disk and checking that it fits the model (lesson 11).

A PEFT adapter folder holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules,
...) and `adapter_model.safetensors`, whose tensors are named after the HF module they adapt:

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   (r, in_features)
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   (out_features, r)

and a LoRA layer computes `base(x) + (x @ A.T @ B.T) * scaling`, with scaling = lora_alpha / r
(rsLoRA: lora_alpha / sqrt(r)). minipaged stacks q/k/v into one `qkv_proj` and gate/up into one
`gate_up_proj` (models/llama.py); `MODULE_SLICES` says which HF module is which slice, and
layers.py gives each stacked layer one A/B pair per slice.

Everything that does not fit raises a `ValueError` naming the adapter and what is wrong: a
rank above `max_lora_rank`, a module minipaged cannot adapt, a shape that is not the model's,
a missing file, PEFT options minipaged does not run (DoRA, trained biases, modules_to_save).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from minipaged.models.config import ModelConfig

# minipaged's stacked layer -> the HF modules it holds, in the order of its output slices
MODULE_SLICES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
SUPPORTED_MODULES = tuple(m for slices in MODULE_SLICES.values() for m in slices)
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every HF module an adapter may target."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


@dataclass
class LoRAAdapter:
    """One adapter's weights on the CPU, checked against the model: weights maps
    (layer, HF module) -> (A, B)."""

    name: str
    lora_int_id: int
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def modules(self) -> list[str]:
        return sorted({m for _, m in self.weights}, key=SUPPORTED_MODULES.index)


def read_adapter_config(path: str, name: str = "") -> dict:
    """adapter_config.json of a PEFT folder, with the options minipaged cannot run refused."""
    who = f"LoRA adapter {name!r} ({path})" if name else f"LoRA adapter at {path}"
    if not os.path.isdir(path):
        raise ValueError(f"{who}: lora_path is not a folder")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{who}: adapter_config.json is missing (a PEFT adapter folder holds "
                         "adapter_config.json and adapter_model.safetensors)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{who}: peft_type is {cfg['peft_type']!r}; only LORA adapters run")
    refused = {"use_dora": False, "bias": "none", "modules_to_save": None, "fan_in_fan_out": False}
    for key, ok in refused.items():
        value = cfg.get(key, ok)
        if value not in (ok, [], {}):
            raise ValueError(f"{who}: {key}={value!r} is not supported (allowed: {ok!r})")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"{who}: {key} (a rank or alpha per module) is not supported; "
                             "every module must use r and lora_alpha")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = [t for t in targets if t not in SUPPORTED_MODULES]
        if bad:
            raise ValueError(f"{who}: target_modules {bad} cannot be adapted; minipaged adapts "
                             f"{', '.join(SUPPORTED_MODULES)}")
    return cfg


def load_adapter(name: str, lora_int_id: int, path: str, model_config: ModelConfig,
                 max_lora_rank: int) -> LoRAAdapter:
    """Read and check one PEFT adapter; its tensors stay on the CPU until a slot needs them."""
    from safetensors.torch import load_file

    who = f"LoRA adapter {name!r} ({path})"
    cfg = read_adapter_config(path, name)
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{who}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"{who}: rank r={rank} is larger than max_lora_rank={max_lora_rank}; "
                         f"start the engine with max_lora_rank >= {rank}")
    alpha = cfg.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora", False) else alpha / rank
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"{who}: adapter_model.safetensors is missing (adapter_model.bin, "
                         "pickled, is not read: save with safe_serialization=True)")
    shapes = module_shapes(model_config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(file).items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"{who}: tensor {key!r} is not a LoRA A/B weight of a decoder "
                             f"layer module ({', '.join(SUPPORTED_MODULES)})")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in SUPPORTED_MODULES:
            raise ValueError(f"{who}: module {module!r} (tensor {key!r}) cannot be adapted; "
                             f"minipaged adapts {', '.join(SUPPORTED_MODULES)}")
        if layer >= model_config.num_hidden_layers:
            raise ValueError(f"{who}: tensor {key!r} is for layer {layer}, but the model has "
                             f"{model_config.num_hidden_layers} layers")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if ab == "A" else (fan_out, rank)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{who}: {key} has shape {tuple(tensor.shape)}, but r={rank} and the "
                             f"model's {module} ({fan_in} -> {fan_out}) need {want}: was the "
                             "adapter trained for another base model?")
        pairs.setdefault((layer, module), {})[ab] = tensor
    if not pairs:
        raise ValueError(f"{who}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{who}: layer {layer} {module} has lora_{''.join(ab)} but not both "
                             "lora_A and lora_B")
        weights[(layer, module)] = (ab["A"], ab["B"])
    return LoRAAdapter(name, lora_int_id, path, rank, scaling, weights)
