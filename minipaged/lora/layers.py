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

Around a plain `nn.Linear` (or the fused layers' `FusedLinear`, the same product) the slots' A
live in one tensor with the base weight (`w_cat`):

    w_cat   (out + max_loras * n, in)     rows :out = the base layer's weight (its parameter is
                                          a view of them), then lora_a's slots, one after another

so on CUDA one GEMM gives the base output and every slot's shrink at once, and only the expand
is left to a LoRA kernel (triton_punica.py's TritonPunicaWrapper.forward): a decode step
launches one small kernel per wrapped layer instead of two, for a GEMM a few percent wider.
That GEMM is `F.linear` whatever the base class; a step without adapter tokens calls the base
layer itself (a `FusedLinear`'s GEMV kernel for a few tokens). Other layers (fp8) keep their
own A tensor.
"""
from __future__ import annotations

import torch
from torch import nn

from minipaged.lora.punica import PunicaWrapper


def stackable(layer: nn.Module) -> bool:
    """Is `layer` x W^T + b and nothing more, so that W can be a view of `w_cat`? nn.Linear and
    FusedLinear (its GEMV kernel computes the same product) are; fp8 layers are not."""
    if type(layer) is nn.Linear:
        return True
    if not isinstance(layer, nn.Linear):
        return False
    from minipaged.models.fused_layers import FusedLinear  # imported already if the model has one
    return type(layer) is FusedLinear


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
        out = sum(slice_sizes)
        w_cat = b_cat = None
        weight = getattr(base_layer, "weight", None)
        if (stackable(base_layer) and weight.dtype == dtype
                and tuple(weight.shape) == (out, in_features)):
            w_cat = torch.zeros(out + max_loras * n, in_features, dtype=dtype, device=device)
            w_cat[:out].copy_(weight)
            base_layer.weight = nn.Parameter(w_cat[:out], requires_grad=False)
            lora_a = w_cat[out:].view(max_loras, n, in_features)  # the slots' A, in place
            if base_layer.bias is not None:
                b_cat = torch.zeros(out + max_loras * n, dtype=dtype, device=device)
                b_cat[:out].copy_(base_layer.bias)
                base_layer.bias = nn.Parameter(b_cat[:out], requires_grad=False)  # one copy
        else:
            lora_a = torch.zeros(max_loras, n, in_features, dtype=dtype, device=device)
        self.register_buffer("w_cat", w_cat, persistent=False)  # None: not stacked
        self.register_buffer("b_cat", b_cat, persistent=False)
        self.register_buffer("lora_a", lora_a, persistent=False)
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
        # (num_tokens, out): the base model's output + each token's adapter delta
        return self.punica.forward(self, x)
