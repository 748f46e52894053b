"""`ModelConfig`: the few numbers of a Hugging Face `config.json` that the engine needs.

Read from the dict directly (no `transformers` config classes), so one code path serves
Llama, Mistral, Qwen2/Qwen2.5 and Qwen3 and the dummy presets in `presets/`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]  # None for plain RoPE; else HF rope_parameters
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    torch_dtype: torch.dtype
    bos_token_id: Optional[int] = None
    eos_token_id: list[int] = field(default_factory=list)
    hidden_act: str = "silu"

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"minipaged implements {sorted(SUPPORTED_ARCHITECTURES)}; this config "
                             f"declares architectures={archs} (model_type={cfg.get('model_type')!r})")
        model_type = SUPPORTED_ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        # Rope: transformers 5 writes `rope_parameters`, transformers 4 `rope_theta`+`rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (Llama-family models use 'silu')")
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            torch_dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        return self.num_hidden_layers * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h
