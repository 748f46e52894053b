"""The layers of `layers.py` as fused Triton kernels (`triton_ops.py`): the CUDA default.

Each class is its torch layer with `forward` replaced; weights, names and results are the same
(to rounding), so a checkpoint loads into either and the parity tests compare them. A decoder
layer then runs

    fused_add_rms_norm -> qkv GEMM -> qkv_rope_store -> backend.attend -> o_proj GEMM
    -> fused_add_rms_norm -> gate_up GEMM -> silu_and_mul -> down GEMM

`EngineConfig.resolve` turns them on for CUDA with the Triton backend (`fused_ops`); lesson 08
measures what they save.
"""
from __future__ import annotations

import torch

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


FUSED_LAYERS = Layers("fused", FusedRMSNorm, FusedRotaryEmbedding, FusedQKVRopeStore,
                      FusedSiluAndMul)
