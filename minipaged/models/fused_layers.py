"""The layers of `layers.py` as fused Triton kernels (`triton_ops.py`, `triton_gemv.py`): the
CUDA default.

Each class is its torch layer with `forward` replaced; weights, names and results are the same
(to rounding), so a checkpoint loads into either and the parity tests compare them. A decoder
layer then runs

    fused_add_rms_norm -> qkv GEMM -> qkv_rope_store -> backend.attend -> o_proj GEMM
    -> fused_add_rms_norm -> gate_up GEMM -> silu_and_mul -> down GEMM

where each GEMM is `FusedLinear`: `skinny_linear` (a GEMV kernel) for steps of at most
SKINNY_MAX_ROWS tokens, cuBLAS (`F.linear`) for larger ones.

`EngineConfig.resolve` turns them on for CUDA with the Triton backend (`fused_ops`); lesson 08
measures what they save.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import minipaged.models.triton_gemv as triton_gemv
import minipaged.models.triton_ops as triton_ops
from minipaged.attention import AttentionMetadata
from minipaged.models.layers import Layers, QKVRopeStore, RMSNorm, RotaryEmbedding, SiluAndMul


class FusedRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # one kernel replaces the residual add and the norm's own kernels
        if residual is None:
            return triton_ops.rms_norm(x, self.weight, self.eps)
        return triton_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class FusedRotaryEmbedding(RotaryEmbedding):
    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """The kernel looks cos/sin up itself, from the fp32 tables."""
        return positions, self.cos, self.sin


class FusedQKVRopeStore(QKVRopeStore):
    def forward(self, qkv, rope, q_norm, k_norm, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        # One kernel replaces the split and views, the q/k norms and their cat, RoPE's roll /
        # multiplies / add and store_kv. rope = (positions, cos table, sin table).
        positions, cos, sin = rope
        return triton_ops.qkv_rope_store(
            qkv, positions, cos, sin, q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0, kv_cache[0], kv_cache[1],
            attn_metadata.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)


class FusedSiluAndMul(SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return triton_ops.silu_and_mul(x)  # one kernel replaces chunk, silu and the multiply


class FusedLinear(nn.Linear):
    """nn.Linear whose product, for a step of at most SKINNY_MAX_ROWS tokens (one-stream and
    small-batch decode), is `skinny_linear`: cuBLAS picks tiles for 16 or more rows and reads a
    one-token layer's weight well below the memory bandwidth. The choice depends on shapes and
    dtypes only, so a CUDA graph captures one path per batch size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dim() == 2 and 0 < x.shape[0] <= triton_gemv.SKINNY_MAX_ROWS
                and x.dtype == self.weight.dtype and x.dtype in triton_gemv.SKINNY_DTYPES
                and self.weight.stride(1) == 1):
            return triton_gemv.skinny_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


FUSED_LAYERS = Layers("fused", FusedRMSNorm, FusedRotaryEmbedding, FusedQKVRopeStore,
                      FusedSiluAndMul, FusedLinear)
