"""Random LoRA adapters written in PEFT's format, without `peft`: for benchmarks and GPU tests.

`save_random_adapter` writes the two files PEFT's `save_pretrained` writes (adapter_config.json
and adapter_model.safetensors, with PEFT's tensor names), so what the engine reads is exactly
what it reads from a trained adapter; tests/test_lora.py checks that PEFT loads the same folder
and agrees with minipaged token for token.
"""
from __future__ import annotations

import json
import os

import torch

from minipaged.lora.adapter import module_shapes
from minipaged.models.config import ModelConfig

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def save_random_adapter(path: str, model_config: ModelConfig, *, rank: int = 16,
                        lora_alpha: float = 32, target_modules=("q_proj", "k_proj", "v_proj",
                                                                "o_proj", "gate_proj", "up_proj",
                                                                "down_proj"),
                        use_rslora: bool = False, seed: int = 0, std: float = 0.05,
                        dtype: torch.dtype = torch.float32) -> str:
    """A rank-`rank` adapter with random A and B (both non-zero) for every layer's targets."""
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(model_config)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for module in target_modules:
            fan_in, fan_out = shapes[module]
            part = "self_attn" if module in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen)
                                               * std).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen)
                                               * std).to(dtype)
    os.makedirs(path, exist_ok=True)
    from safetensors.torch import save_file
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": lora_alpha,
              "lora_dropout": 0.0, "use_rslora": use_rslora, "bias": "none",
              "target_modules": list(target_modules), "fan_in_fan_out": False,
              "init_lora_weights": False, "base_model_name_or_path": None}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path
