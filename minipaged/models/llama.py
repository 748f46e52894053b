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

The element-wise and linear layers come from a `Layers` set (layers.py: torch, or fused Triton
kernels), chosen once when the model is built; nothing below depends on which.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.attention import AttentionBackend, AttentionMetadata
from minipaged.models.config import ModelConfig
from minipaged.models.layers import TORCH_LAYERS, Layers, RMSNorm
from minipaged.models.weights import CheckpointWeights


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layers: Layers):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        kv_size = cfg.num_key_value_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = layers.linear(cfg.hidden_size, self.q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = layers.linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qkv_rope_store = layers.qkv_rope_store(cfg, backend)
        self.backend = backend

    def forward(self, rope, hidden, kv_cache, attn_metadata: AttentionMetadata):
        qkv = self.qkv_proj(hidden)  # (num_tokens, (heads + 2 * kv_heads) * head_dim)
        # q/k norm, RoPE, and this step's K/V written into the cache; q comes back
        q = self.qkv_rope_store(qkv, rope, self.q_norm, self.k_norm, kv_cache, attn_metadata)
        # attention over the cache, which now holds this step's keys too
        out = self.backend.attend(q, kv_cache[0], kv_cache[1], attn_metadata, self.scale)
        return self.o_proj(out.flatten(1))  # (num_tokens, heads * head_dim) -> (num_tokens, hidden)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: Layers):
        super().__init__()
        self.gate_up_proj = layers.linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = layers.linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = layers.silu_and_mul()  # SwiGLU

    def forward(self, x):
        gate_up = self.gate_up_proj(x)  # (num_tokens, 2 * intermediate): [gate | up]
        return self.down_proj(self.act_fn(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layers: Layers):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend, layers)
        self.mlp = LlamaMLP(cfg, layers)
        self.input_layernorm = layers.rms_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = layers.rms_norm(cfg.hidden_size, cfg.rms_norm_eps)

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
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layers: Layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, layers)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = layers.rms_norm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CheckpointWeights, nn.Module):
    """Flat-token causal LM: `forward` returns hidden states, `compute_logits` the vocab scores;
    `load_weights` / `init_dummy_weights` fill it (weights.py)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 layers: Layers = TORCH_LAYERS):
        super().__init__()
        self.config = cfg
        self.layer_set = layers  # which implementation of the element-wise layers (layers.py)
        self.model = LlamaModel(cfg, backend, layers)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = layers.rotary_embedding(cfg, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (num_tokens,); kv_caches: (layers, 2, blocks, block_size, kv_heads, dim)."""
        hidden = self.model.embed_tokens(input_ids)  # (num_tokens, hidden)
        rope = self.rotary(positions, hidden.dtype)  # this step's rotation, shared by all layers
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self.model.norm(hidden, residual)  # the last layer's MLP output joins the stream
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_rows, vocab) scores in the model's dtype; the sampler widens them where it must."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight)  # (num_rows, vocab)
