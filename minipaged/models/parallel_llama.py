"""The Llama family across N ranks: llama.py's model with its shard's shapes and the three
layers that communicate swapped in (lesson 09).

`LlamaForCausalLM` is built from `shard_config(cfg, N)`, so every parameter already has this
rank's shape (its query / KV heads, MLP columns, words) and the attention and element-wise
layers work on this rank's heads without knowing about the others. What changes is exactly:

    self_attn.o_proj, mlp.down_proj   -> RowParallelLinear       (an all-reduce each)
    model.embed_tokens                -> VocabParallelEmbedding  (masked ids, an all-reduce)
    compute_logits                    -> ParallelLMHead          (logits gathered to the driver)
    qkv_proj, gate_up_proj            -> ColumnParallelLinear    (no communication)

Weights: each rank reads only its slice of every checkpoint tensor (`read_shard`, safetensors'
`get_slice`) and hands the slices to llama.py's own `load_weights`, which stacks q/k/v and
gate/up as on one device. Dummy weights are the single-device dummy weights, cut the same way,
so a dummy preset gives the same tokens at any N.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import torch

from minipaged.distributed.parallel_state import TPGroup
from minipaged.models.config import ModelConfig
from minipaged.models.llama import LlamaForCausalLM
from minipaged.models.weights import stacked_sizes
from minipaged.models.parallel_layers import (ColumnParallelLinear, ParallelLMHead,
                                              RowParallelLinear, VocabParallelEmbedding,
                                              read_shard, shard_config, shard_dim, shard_of)


def _swap(old: torch.nn.Linear, cls, tp: TPGroup):
    """The same shapes (already this rank's), as the parallel class."""
    return cls(old.in_features, old.out_features, old.bias is not None, tp)


class TensorParallelLlamaForCausalLM(LlamaForCausalLM):
    """One rank's shard of the model. `forward` returns the full hidden states on every rank
    (the all-reduces make them whole); `compute_logits` returns (num_rows, vocab) on the driver
    and None on the workers."""

    def __init__(self, cfg: ModelConfig, backend, max_positions: int, layers, tp: TPGroup):
        super().__init__(shard_config(cfg, tp.world_size), backend, max_positions, layers)
        self.full_config, self.tp = cfg, tp
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = _swap(attn.qkv_proj, ColumnParallelLinear, tp)
            attn.o_proj = _swap(attn.o_proj, RowParallelLinear, tp)
            mlp.gate_up_proj = _swap(mlp.gate_up_proj, ColumnParallelLinear, tp)
            mlp.down_proj = _swap(mlp.down_proj, RowParallelLinear, tp)
        self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.lm_head_parallel = ParallelLMHead(tp)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        weight = (self.model.embed_tokens.weight if self.config.tie_word_embeddings
                  else self.lm_head.weight)  # this rank's V/N rows
        return self.lm_head_parallel(hidden, weight)  # (num_rows, vocab) on the driver

    # --- weights ----------------------------------------------------------------------------
    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """The single-device dummy weights (same generator, same order), each cut to this
        rank's share; stacked q/k/v and gate/up are cut part by part."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        rank, n = self.tp.rank, self.tp.world_size
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            # our names are HF's but for the stacked qkv_proj / gate_up_proj (split by rows)
            stacked = next((o for o in ("qkv_proj", "gate_up_proj") if f".{o}." in name), None)
            dim = 0 if stacked else shard_dim(name)
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= n  # the full tensor's shape
            values = torch.randn(shape, generator=gen) * 0.02
            if stacked:  # [q | k | v] or [gate | up]: this rank's rows of each part
                parts = values.split(stacked_sizes(self.full_config, stacked, shape[0]), dim=0)
                values = torch.cat([shard_of(x, 0, rank, n) for x in parts], dim=0)
            else:
                values = shard_of(values, dim, rank, n)
            p.copy_(values.to(p.dtype))

    def load_shards(self, path: Path) -> None:
        """Read this rank's slice of every tensor from path/*.safetensors and load it."""
        self.load_weights(iter_safetensor_shards(path, self.tp.rank, self.tp.world_size))


def iter_safetensor_shards(path: Path, rank: int, world_size: int
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, read_shard(sf, name, rank, world_size)


def load_tensor_parallel_model(source, cfg: ModelConfig, dtype, device, backend,
                               max_positions: int, seed: int, layers, tp: TPGroup):
    """`loader.load_model` for one rank: build on the meta device, allocate, fill its shard."""
    with torch.device("meta"):
        model = TensorParallelLlamaForCausalLM(cfg, backend, max_positions, layers, tp)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.init_table(device)
    if source.dummy:
        model.init_dummy_weights(seed)
    elif source.gguf is not None:  # whole tensors dequantized, then this rank's slice kept
        from minipaged.models.gguf_loader import iter_gguf_weights
        model.load_weights((name, shard_of(w, shard_dim(name), tp.rank, tp.world_size))
                           for name, w in iter_gguf_weights(source.gguf))
    else:
        model.load_shards(source.path)
    return model.eval()
