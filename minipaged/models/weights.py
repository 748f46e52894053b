"""HF checkpoint tensors into the model's parameters, or random ones of the right shapes.

Like vLLM, the model keeps q/k/v as one matmul (`qkv_proj`) and gate/up as another
(`gate_up_proj`); a checkpoint stores them apart (`q_proj`, `k_proj`, ...), so `load_weights`
copies each into its rows of the stacked parameter (`stacked_sizes` says where they are), and
complains about any tensor without a place or any parameter left unfilled. Safetensors, GGUF
(gguf_loader.py) and the tensor-parallel shards (parallel_llama.py) all arrive here with HF's
names.
"""
from __future__ import annotations

from typing import Iterable

import torch

from minipaged.models.config import ModelConfig


def stacked_sizes(cfg: ModelConfig, stacked: str, total: int) -> list[int]:
    """The rows of each part of a stacked weight of `total` rows: q, k, v of `qkv_proj`, or
    gate, up of `gate_up_proj` (the loaders and the tensor-parallel shards cut along them)."""
    if stacked == "qkv_proj":
        kv = cfg.num_key_value_heads * cfg.head_dim
        return [total - 2 * kv, kv, kv]
    return [total // 2, total // 2]


class CheckpointWeights:
    """`load_weights` and `init_dummy_weights` for `LlamaForCausalLM` (its `config`)."""

    # HF checkpoint names that are stacked into one of our parameters: (ours, theirs, shard index)
    stacked_params = [("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

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
                    sizes = stacked_sizes(self.config, ours, param.shape[0])
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

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of the right shapes, for throughput work ("dummy weights")."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
