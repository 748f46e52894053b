"""Quantized weights: `EngineConfig.quantization` (lesson 11).

    fp8.py    float8 e4m3 weights with per-output-channel scales, activations quantized per
              token at run time; `torch._scaled_mm` on CUDA, a dequantizing torch path elsewhere
    fp8_triton.py  the activations' per-token quantization as one Triton kernel (CUDA)
    fp8_format.py  e4m3's dtype, largest value and scale floor, which both read

A model is built and loaded in its float dtype as always; `quantize_model` then replaces the
linear layers of every decoder layer with their quantized variant (vLLM's
`process_weights_after_loading` for online quantization does the same), so `llama.py` and the
loaders never learn that quantization exists.
"""
from __future__ import annotations

from torch import nn

QUANTIZATION_METHODS = ("fp8",)


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Swap the decoder layers' linear layers for their `method` variant, in place."""
    if method == "fp8":
        from minipaged.models.quantization.fp8 import quantize_model_fp8
        return quantize_model_fp8(model)
    raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got {method!r}")
