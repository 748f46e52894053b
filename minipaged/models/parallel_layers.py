"""Megatron-style tensor-parallel layers, written for this codebase (lesson 09).

With N ranks, each matrix multiply of a decoder layer is split so that a layer needs only two
all-reduces (Megatron-LM, as vLLM and nano-vllm do it):

    qkv_proj, gate_up_proj   column-parallel: each rank holds 1/N of the output rows (its
                             query and KV heads, its MLP columns) and computes its part alone
    o_proj, down_proj        row-parallel: each rank holds the matching 1/N of the input columns,
                             multiplies its part and the N partial sums are added: one all-reduce
    embed_tokens             vocab-parallel: each rank holds V/N rows; an id outside its rows
                             reads zeros, and an all-reduce adds the N lookups
    lm_head                  vocab-parallel too: each rank scores its V/N words; the logits are
                             gathered to the driver, which samples

Attention needs no communication: a head only ever reads its own q, k, v, so the heads a rank
holds attend on their own, over the KV heads it holds (its KV cache is 1/N of the full one).
Norms and the rotary table are small and replicated.

Every parameter keeps its single-device name and gets its rank's shape, so llama.py builds the
model unchanged from a per-rank ModelConfig (`shard_config`) and parallel_llama.py swaps in the
three classes below whose forward communicates. How each Hugging Face tensor splits is one table
(`SHARD_DIMS`); `shard_of` cuts a full tensor and `read_shard` reads only a rank's slice from a
safetensors file, so no rank ever holds a whole weight.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.distributed.parallel_state import TPGroup, all_reduce, gather_to_driver
from minipaged.models.config import ModelConfig

# Hugging Face tensor name (a part of it) -> the dimension split N ways; absent: replicated.
# nn.Linear stores weight as (out_features, in_features): column-parallel splits dim 0,
# row-parallel dim 1. Biases (Qwen2's q/k/v) split with their rows.
SHARD_DIMS = {
    "q_proj": 0, "k_proj": 0, "v_proj": 0,   # column-parallel: heads
    "gate_proj": 0, "up_proj": 0,            # column-parallel: MLP columns
    "o_proj": 1, "down_proj": 1,             # row-parallel: their inputs
    "embed_tokens": 0, "lm_head": 0,         # vocab-parallel: words
}


def shard_dim(name: str) -> Optional[int]:
    """The dimension tensor `name` splits along, or None when every rank holds all of it."""
    for part, dim in SHARD_DIMS.items():
        if f"{part}." in name:
            if name.endswith(".bias") and dim == 1:  # a row-parallel bias is added once, whole
                return None
            return dim
    return None


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's equal share of `size` (checked divisible in config.resolve)."""
    per = size // world_size
    return rank * per, (rank + 1) * per


def shard_of(full: torch.Tensor, dim: Optional[int], rank: int, world_size: int) -> torch.Tensor:
    """Rank's slice of a full tensor (tests, dummy weights)."""
    if dim is None:
        return full
    start, stop = shard_range(full.shape[dim], rank, world_size)
    return full.narrow(dim, start, stop - start)


def read_shard(safe_file, name: str, rank: int, world_size: int) -> torch.Tensor:
    """Only rank's slice of tensor `name`, read from an open safetensors file (`get_slice`
    reads just those bytes)."""
    dim = shard_dim(name)
    if dim is None:
        return safe_file.get_tensor(name)
    sl = safe_file.get_slice(name)
    start, stop = shard_range(sl.get_shape()[dim], rank, world_size)
    return sl[start:stop] if dim == 0 else sl[:, start:stop]


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The ModelConfig of one rank's shard: its query and KV heads, MLP columns and words. A
    model built from it has exactly the shapes of one rank's parameters."""
    return replace(cfg, num_attention_heads=cfg.num_attention_heads // world_size,
                   num_key_value_heads=cfg.num_key_value_heads // world_size,
                   intermediate_size=cfg.intermediate_size // world_size,
                   vocab_size=cfg.vocab_size // world_size)


class ColumnParallelLinear(nn.Linear):
    """y_r = x @ W_r^T: rank r's rows of the output (its heads / MLP columns), no communication.

    in_features is full, out_features is this rank's share; q/k/v (and gate/up) are stacked
    along the rows as on one device, each part cut first (parallel_llama.py loads them).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp


class RowParallelLinear(nn.Linear):
    """y = sum_r x_r @ W_r^T: each rank multiplies its share of the inputs (the heads or MLP
    columns the column-parallel layer before it produced), one all-reduce adds the N parts."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight), self.tp)  # (num_tokens, out_features)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rank r holds the rows of words [r * V/N, (r + 1) * V/N). Each rank looks up the ids in
    its range (the others read row 0 and are zeroed), and an all-reduce adds the N lookups:
    every id is found by exactly one rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__(vocab_size // tp.world_size, hidden_size)
        self.tp = tp
        self.vocab_start, self.vocab_end = shard_range(vocab_size, tp.rank, tp.world_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # (num_tokens,)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight)  # (num_tokens, hidden)
        out = out.masked_fill(~mine[:, None], 0)
        return all_reduce(out, self.tp)


class ParallelLMHead(nn.Module):
    """Rank r scores the words it holds, x @ W_r^T (num_rows, V/N); the driver gathers the N
    parts in rank order into (num_rows, V) and samples. `weight`: this rank's rows of the LM
    head, or of the embedding when the model ties them."""

    def __init__(self, tp: TPGroup):
        super().__init__()
        self.tp = tp

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
        return gather_to_driver(F.linear(hidden, weight), self.tp, dim=-1)
