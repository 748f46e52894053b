"""What the KV cache stores: `EngineConfig.kv_cache_dtype` as a torch dtype, and the float8 rules
(lesson 11 measures an fp8 KV cache; lesson 00 counts its bytes per element).

With kv_cache_dtype="fp8" the cache holds float8 e4m3: new K/V are clamped to +-448 (an
out-of-range value would become NaN) and cast, unscaled; block copies and slot writes move the
bytes through a uint8 view, since torch lacks float8 indexing ops. The attention backends, the
fused K/V store and the cache's own copies all read these helpers, so this module is a leaf: it
imports nothing of the package.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0  # the largest float8 e4m3 value


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """`EngineConfig.kv_cache_dtype` as a torch dtype ("auto": the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New K/V in the cache's dtype; float8 clamps first (an out-of-range value would be NaN)."""
    if x.dtype == cache_dtype:
        return x
    if is_fp8(cache_dtype):
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(cache_dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes when the dtype is float8, whose indexing ops torch lacks; block
    copies and slot writes move bytes, so they go through this view."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
