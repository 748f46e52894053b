"""The layers a decoder layer is built from, in plain torch (its projections: `nn.Linear`):

    RMSNorm              y = x / sqrt(mean(x^2) + eps) * weight; with a residual, adds it first
    RotaryEmbedding      the fp32 cos/sin table, and the step's rows of it
    QKVRopeStore         qkv -> q, with Qwen3's per-head q/k norm, RoPE, and K/V into the cache
    SiluAndMul           SwiGLU's element-wise half: silu(gate) * up

`llama.py` builds its layers from a `Layers` set and never asks which one it got. This file is
the torch set (`TORCH_LAYERS`), the definition lessons 00 and 05 read and the parity tests run;
`fused_layers.py` the same layers as fused Triton kernels (vLLM's CustomOp idea), and
`get_layers` (loader.py) picks one when the model is built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.attention import AttentionBackend, AttentionMetadata
from minipaged.models.config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 exactly as HF does.

    `forward(x, residual)` first adds the residual stream (x + residual, in x's dtype like HF) and
    returns `(normed, new_residual)`; `forward(x)` returns `normed`.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual  # the residual stream after this layer's sublayer
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64) or x.is_cuda:
            # One fused op: bit-identical to the lines below in fp32/fp64; in bf16/fp16 it rounds
            # after the weight (HF before), which saves five kernels per norm on the GPU.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, including the `llama3` and `linear` scalings."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":  # Llama 3.1/3.2: stretch low frequencies, keep high ones
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """HF-style ("rotate_half") RoPE with a precomputed fp32 cos/sin table per position."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg, self.max_positions = cfg, max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def init_table(self, device: torch.device) -> None:
        """Fill the fp32 cos/sin table (kept fp32 whatever the model dtype, like HF)."""
        inv_freq = rope_inv_freq(self.cfg)
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (max_positions, head_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, head_dim)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)
        half = self.cfg.head_dim // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """The step's rotation, looked up once per step for all layers: cos and sign-folded sin."""
        cos = self.cos[positions].to(dtype)[:, None, :]  # (num_tokens, 1, head_dim)
        sin = self.sin_signed[positions].to(dtype)[:, None, :]
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin`, rotating each (i, i + head_dim/2) pair.

    rotate_half(x) = cat(-x2, x1); here the minus sign lives in `sin_signed` = cat(-sin1, sin2)
    and cat(x2, x1) is one `roll`, which gives bit-identical results with fewer ops.
    x: (num_tokens, heads, head_dim)
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class QKVRopeStore(nn.Module):
    """Everything between the qkv matmul and attention: split the heads, Qwen3's per-head
    RMSNorm on q and k, RoPE, and K/V into their cache slots (`backend.store_kv`). Returns q."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.backend = backend

    def forward(self, qkv: torch.Tensor, rope, q_norm: RMSNorm | None, k_norm: RMSNorm | None,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        n, h, kvh, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = qkv.split([(h + kvh) * d, kvh * d], dim=-1)
        qk = qk.view(n, h + kvh, d)  # (num_tokens, q heads then k heads, head_dim)
        v = v.view(n, kvh, d)  # (num_tokens, kv_heads, head_dim)
        if q_norm is not None:  # Qwen3: RMSNorm over each head's vector, before RoPE
            qk = torch.cat((q_norm(qk[:, :h]), k_norm(qk[:, h:])), 1)
        qk = apply_rope(qk, *rope)  # q and k rotate by the same angles: one pass for both
        q, k = qk.split([h, kvh], dim=1)
        self.backend.store_kv(k, v, kv_cache[0], kv_cache[1], attn_metadata)
        return q  # (num_tokens, heads, head_dim)


class SiluAndMul(nn.Module):
    """x = [gate | up] (num_tokens, 2 * intermediate) -> silu(gate) * up (num_tokens, intermediate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


@dataclass(frozen=True)
class Layers:
    """The layer classes a model is built from: one implementation of each."""

    name: str
    rms_norm: type
    rotary_embedding: type
    qkv_rope_store: type
    silu_and_mul: type
    linear: type  # qkv_proj, o_proj, gate_up_proj, down_proj (not the LM head)


TORCH_LAYERS = Layers("torch", RMSNorm, RotaryEmbedding, QKVRopeStore, SiluAndMul, nn.Linear)

