"""The LoRA variant of the model's linear layers: the base layer plus the step's adapters.

With `enable_lora` the manager (manager.py) swaps each decoder layer's `qkv_proj`, `o_proj`,
`gate_up_proj` and `down_proj` for a `LoRALinear` around it, once, when the engine is built
(as vLLM's LoRA model manager does); models/llama.py is unchanged and never asks. A
`LoRALinear` holds `max_loras` weight slots:

    lora_a  (max_loras, slices * max_lora_rank, in)    slice s: rows s*R : s*R + r  = A_s
    lora_b  (max_loras, out, slices * max_lora_rank)   slice s: its output rows, columns
                                                       s*R : s*R + r = B_s (zeros elsewhere)

`qkv_proj` has three slices (q, k, v: each HF module's own A and B) and `gate_up_proj` two, so a
stacked layer adds exactly what PEFT adds to each of its HF modules. An adapter with a smaller
rank, or without some module, leaves zeros, which add nothing.
"""
from __future__ import annotations

import torch
from torch import nn

from minipaged.lora.punica import PunicaWrapper


class LoRALinear(nn.Module):
    def __init__(self, base_layer: nn.Module, slice_sizes: list[int], in_features: int,
                 max_loras: int, max_lora_rank: int, punica: PunicaWrapper,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base_layer = base_layer
        self.slice_sizes = slice_sizes  # output rows of each HF module, in stacking order
        self.max_lora_rank = max_lora_rank
        self.punica = punica
        n = len(slice_sizes) * max_lora_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, n, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, sum(slice_sizes), n, dtype=dtype,
                                                   device=device), persistent=False)

    @torch.no_grad()
    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's (A, B) per slice into `slot` (None: that module is not adapted)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        R, row = self.max_lora_rank, 0
        for s, (size, ab) in enumerate(zip(self.slice_sizes, weights)):
            if ab is not None:
                a, b = ab  # (r, in), (size, r)
                r = a.shape[0]
                self.lora_a[slot, s * R:s * R + r].copy_(a)
                self.lora_b[slot, row:row + size, s * R:s * R + r].copy_(b)
            row += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)  # (num_tokens, out): the base model's output
        return self.punica.add_lora(y, x, self.lora_a, self.lora_b)  # + each token's adapter
