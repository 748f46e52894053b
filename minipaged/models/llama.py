"""The Llama family, written once: Llama, Mistral, Qwen2/Qwen2.5 and Qwen3.

Lesson 00 compares it with Hugging Face's implementation; the parity tests prove they agree
token for token. Unlike HF, every tensor here is *flat*: a step is `num_tokens` tokens from many
sequences packed end to end, with no batch or padding dimension. Where each token sits and which
cache slots it reads is in the `AttentionMetadata` passed explicitly down from the model runner.

The switches that separate the family members:
    Llama / Mistral   none
    Qwen2 / Qwen2.5   bias on the q, k and v projections      (ModelConfig.attention_bias)
    Qwen3             per-head RMSNorm on q and k before RoPE  (ModelConfig.qk_norm)

Like vLLM, q/k/v are one matmul (`qkv_proj`) and gate/up another (`gate_up_proj`); the loader
stacks HF's separate weights into them. Also like vLLM, the residual stream is threaded through
the layers beside the hidden states: a layer returns `(hidden, residual)` and the next norm adds
them (`RMSNorm.forward(x, residual)`), so that on the GPU the add fuses into the norm.

`fused_ops=True` (the default on CUDA with the Triton backend, see `loader.load_model`) swaps the
element-wise torch ops between the matrix multiplies for the Triton kernels of `triton_ops.py`:
a residual add + RMSNorm, SiLU-and-multiply, and q/k norm + RoPE + K/V store each become one
kernel. With `fused_ops=False` every op is plain torch, the path the CPU and the parity tests run.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.attention import AttentionBackend, AttentionMetadata
from minipaged.models.config import ModelConfig

triton_ops = None  # minipaged.models.triton_ops, imported by the first model built with fused_ops


def _import_triton_ops() -> None:
    """Import the fused kernels only when asked for: they need `triton`, and on the CPU their
    definition must wait until TRITON_INTERPRET=1 is set, so `import minipaged` never loads them."""
    global triton_ops
    from minipaged.models import triton_ops as ops
    triton_ops = ops


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 exactly as HF does.

    `forward(x, residual)` first adds the residual stream (x + residual, in x's dtype like HF) and
    returns `(normed, new_residual)`; `forward(x)` returns `normed`.
    """

    def __init__(self, dim: int, eps: float, fused_ops: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused_ops = fused_ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused_ops:
            # one kernel replaces the residual add and the norm's own kernels
            if residual is None:
                return triton_ops.rms_norm(x, self.weight, self.eps)
            return triton_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual  # the residual stream after this layer's sublayer
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64) or x.is_cuda:
            # One fused op. In fp32/fp64 it is bit-identical to the lines below; in bf16/fp16 it
            # keeps the normalised value in fp32 until after the weight (HF rounds it first), a
            # rounding-level difference that saves five kernels per norm on the GPU.
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
        """cos and sign-folded sin for the step's tokens, looked up once per step for all layers."""
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


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, fused_ops: bool = False):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.backend = backend
        self.fused_ops = fused_ops

    def forward(self, rope, hidden, kv_cache, attn_metadata: AttentionMetadata):
        n = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # (num_tokens, (heads + 2 * kv_heads) * head_dim)
        if self.fused_ops:
            # One kernel replaces the split and views below, the q/k norms and their cat, RoPE's
            # roll / multiplies / add and store_kv: it writes K/V into the cache itself, so the
            # backend only attends. rope = (positions, cos table, sin table), looked up in the kernel.
            positions, cos, sin = rope
            q_norm = self.q_norm.weight if self.qk_norm else None
            k_norm = self.k_norm.weight if self.qk_norm else None
            eps = self.q_norm.eps if self.qk_norm else 0.0
            q = triton_ops.qkv_rope_store(qkv, positions, cos, sin, q_norm, k_norm, eps,
                                          kv_cache[0], kv_cache[1], attn_metadata.slot_mapping,
                                          self.num_heads, self.num_kv_heads, self.head_dim)
            out = self.backend.attend(q, kv_cache[0], kv_cache[1], attn_metadata, self.scale)
        else:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim)  # q heads, then k heads
            v = v.view(n, self.num_kv_heads, self.head_dim)  # (num_tokens, kv_heads, head_dim)
            if self.qk_norm:  # Qwen3: RMSNorm over each head's vector, before RoPE
                qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), 1)
            qk = apply_rope(qk, *rope)  # q and k rotate by the same angles: one pass for both
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], attn_metadata, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))  # (num_tokens, hidden)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, fused_ops: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused_ops = fused_ops

    def forward(self, x):
        gate_up = self.gate_up_proj(x)  # (num_tokens, 2 * intermediate): [gate | up]
        if self.fused_ops:  # one kernel replaces chunk, silu and the multiply
            return self.down_proj(triton_ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # SwiGLU
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, fused_ops: bool = False):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend, fused_ops)
        self.mlp = LlamaMLP(cfg, fused_ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused_ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused_ops)

    def forward(self, rope, hidden, residual, kv_cache, attn_metadata):
        """hidden: the previous layer's MLP output (the embeddings for the first layer, where
        residual is None); returns this layer's MLP output and the residual stream before it."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:  # residual + previous MLP output, then the norm
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)  # residual += attention
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, fused_ops: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, fused_ops)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused_ops)


class LlamaForCausalLM(nn.Module):
    """Flat-token causal LM: `forward` returns hidden states, `compute_logits` the vocab scores.

    `fused_ops=True` runs the element-wise work through `triton_ops.py`'s kernels; it needs the
    Triton attention backend, whose `attend` reads the K/V that the fused kernel stores.
    """

    # HF checkpoint names that are stacked into one of our parameters: (ours, theirs, shard index)
    stacked_params = [("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 fused_ops: bool = False):
        super().__init__()
        backend_name = getattr(backend, "name", type(backend).__name__)
        if fused_ops and backend_name != "triton":
            raise ValueError(
                f"fused_ops=True needs attention_backend='triton' (the fused q/k/v kernel stores "
                f"K/V and the Triton backend's `attend` reads them), got {backend_name!r}. Use "
                f"attention_backend='triton' (on the CPU with TRITON_INTERPRET=1 set before "
                f"minipaged is imported), or fused_ops=False.")
        if fused_ops:
            _import_triton_ops()
        self.config = cfg
        self.fused_ops = fused_ops
        self.model = LlamaModel(cfg, backend, fused_ops)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (num_tokens,); kv_caches: (layers, 2, blocks, block_size, kv_heads, dim)."""
        hidden = self.model.embed_tokens(input_ids)  # (num_tokens, hidden)
        if self.fused_ops:  # the fused kernel looks cos/sin up itself, from the fp32 tables
            rope = (positions, self.rotary.cos, self.rotary.sin)
        else:
            rope = self.rotary(positions, hidden.dtype)  # (cos, sin), each (num_tokens, 1, head_dim)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.model.norm(hidden, residual)  # the last layer's MLP output joins the stream
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_rows, vocab) scores in the model's dtype; the sampler widens them where it must."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight)  # (num_rows, vocab)

    # --- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, stacking q/k/v and gate/up; complain about anything missing."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for ours, theirs, shard in self.stacked_params:
                if f".{theirs}." in name:
                    target = name.replace(f".{theirs}.", f".{ours}.")
                    param = params[target]
                    sizes = self._shard_sizes(ours, param.shape[0])
                    start = sum(sizes[:shard])
                    param.data[start:start + sizes[shard]].copy_(tensor)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                params[name].data.copy_(tensor)
                loaded.add(name)
        expected = set()
        for pname in params:
            stacked = [(o, s) for o, _, s in self.stacked_params if f".{o}." in pname]
            expected |= {f"{pname}#{s}" for _, s in stacked} if stacked else {pname}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")

    def _shard_sizes(self, ours: str, total: int) -> list[int]:
        cfg = self.config
        if ours == "qkv_proj":
            kv = cfg.num_key_value_heads * cfg.head_dim
            return [total - 2 * kv, kv, kv]
        return [total // 2, total // 2]

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of the right shapes, for throughput work ("dummy weights")."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
