"""Many adapters in one batch: the per-token gathered shrink/expand, in plain torch (lesson 11).

A LoRA layer adds `(x @ A.T) @ B.T * scaling` to the base layer's output. When the tokens of
one step belong to different adapters (and some to none), each token needs *its* adapter's A
and B. Punica's idea (SGMV / BGMV) is to keep every loaded adapter in a stacked slot tensor and
give each token a slot index, so one batched "shrink" (x -> rank r) and one "expand" (r -> out)
serve the whole mixed batch instead of one small matmul per adapter:

    x            (num_tokens, in)
    lora_a       (max_loras, n, in)      n = slices * max_lora_rank (zero-padded)
    lora_b       (max_loras, out, n)
    token_lora   (num_tokens,)           the token's slot, -1 = base model only
    shrink       t[i] = x[i] @ lora_a[token_lora[i]].T                      (num_tokens, n)
    expand       y[i] += t[i] @ lora_b[token_lora[i]].T * scaling[token_lora[i]]

This file is the readable definition and the oracle: it gathers each token's A and B and runs
a batched matmul. `triton_punica.py` computes the same sums on CUDA without materialising the
gathered weights (tokens sorted by slot, one tile of a slot's weights read per tile of tokens);
tests/test_lora.py checks one against the other. `PunicaWrapper` holds the step's token-to-slot
mapping that the model runner sets before each forward (layers.py reads it); its CUDA variant,
`TritonPunicaWrapper`, is in triton_punica.py beside the kernels it calls.
"""
from __future__ import annotations

import torch



def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_lora: torch.Tensor) -> torch.Tensor:
    """t[i] = x[i] @ lora_a[token_lora[i]].T for the tokens with an adapter; 0 for the others."""
    rows = (token_lora >= 0).nonzero().squeeze(1)  # tokens that have an adapter
    t = x.new_zeros(x.shape[0], lora_a.shape[1])  # (num_tokens, n)
    a = lora_a[token_lora[rows]]  # (rows, n, in): each token's own A, gathered
    t[rows] = torch.bmm(a, x[rows].unsqueeze(2)).squeeze(2)  # (rows, n)
    return t


def lora_expand(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
                token_lora: torch.Tensor) -> torch.Tensor:
    """y[i] += t[i] @ lora_b[token_lora[i]].T * scaling[token_lora[i]], in place; returns y."""
    rows = (token_lora >= 0).nonzero().squeeze(1)
    idx = token_lora[rows]
    b = lora_b[idx]  # (rows, out, n): each token's own B, gathered
    delta = torch.bmm(b, t[rows].unsqueeze(2)).squeeze(2)  # (rows, out)
    y.index_add_(0, rows, delta * scaling[idx].to(delta.dtype)[:, None])
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scaling: torch.Tensor, token_lora: torch.Tensor) -> torch.Tensor:
    """y += each token's LoRA delta (shrink, then expand); returns y."""
    return lora_expand(y, lora_shrink(x, lora_a, token_lora), lora_b, scaling, token_lora)


TILE_TOKENS = 16  # tokens per tile of the Triton kernels (tl.dot needs >= 16 on a GPU)


class PunicaWrapper:
    """One step's token -> slot mapping, shared by every LoRA layer (vLLM's PunicaWrapper).

    The buffers are allocated once and refilled by `update` before each forward, so a CUDA
    graph captured over them replays with the new step's mapping. Besides `token_lora` (what the
    torch reference reads) it keeps the tokens sorted by slot (`sorted_token_ids`) cut into
    tiles of at most TILE_TOKENS tokens of one slot: tile j is `tile_len[j]` tokens starting at
    `tile_start[j]` of the sorted list, all of slot `tile_slot[j]` (-1: an unused tile). That
    is what the Triton kernels walk. `scaling[slot]` is the adapter's lora_alpha / r (or
    / sqrt(r) with rsLoRA).
    """

    def __init__(self, max_loras: int, max_num_tokens: int, device: torch.device):
        self.max_loras = max_loras
        self.device = device
        # a slot with c tokens makes ceil(c / TILE) tiles: at most this many in all
        self.max_tiles = -(-max_num_tokens // TILE_TOKENS) + max_loras
        # One device buffer, refilled by one copy per step, viewed as the five mappings.
        self._sizes = [max_num_tokens, max_num_tokens] + [self.max_tiles] * 3
        self._buffer = torch.zeros(sum(self._sizes), dtype=torch.int64, device=device)
        (self.token_lora, self.sorted_token_ids, self.tile_slot, self.tile_start,
         self.tile_len) = self._buffer.split(self._sizes)
        self.token_lora.fill_(-1)
        self.tile_slot.fill_(-1)
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.num_tokens = 0
        self.any_lora = False

    def update(self, token_lora: list[int]) -> None:
        """The step's slot per token (-1: none), in the order of the runner's input_ids."""
        n = len(token_lora)
        if n > self.token_lora.shape[0]:
            raise ValueError(f"a step of {n} tokens is longer than the LoRA mapping's "
                             f"{self.token_lora.shape[0]}")
        ids = torch.tensor(token_lora, dtype=torch.int64)
        order = torch.sort(ids, stable=True).indices  # tokens grouped by slot, -1 first
        counts = torch.bincount(ids + 1, minlength=self.max_loras + 1).tolist()  # [none, 0, ..]
        slots, starts, lens = [], [], []
        start = counts[0]
        for slot, c in enumerate(counts[1:]):
            for first in range(0, c, TILE_TOKENS):
                slots.append(slot)
                starts.append(start + first)
                lens.append(min(TILE_TOKENS, c - first))
            start += c
        host = torch.zeros(self._buffer.shape[0], dtype=torch.int64)
        token_lora_h, sorted_h, slot_h, start_h, len_h = host.split(self._sizes)
        token_lora_h.fill_(-1)  # rows past n (a CUDA graph's padding): no adapter
        token_lora_h[:n] = ids
        sorted_h[:n] = order
        slot_h.fill_(-1)  # unused tiles
        m = len(slots)
        slot_h[:m], start_h[:m], len_h[:m] = (torch.tensor(v, dtype=torch.int64)
                                              for v in (slots, starts, lens))
        if self.device.type == "cuda":  # one copy, queued without waiting for the GPU
            host = host.pin_memory()
        self._buffer.copy_(host, non_blocking=True)
        self.num_tokens = n
        self.any_lora = counts[0] < n

    def forward(self, layer, x: torch.Tensor) -> torch.Tensor:
        """A LoRALinear's output: its base layer's plus each token's LoRA delta."""
        return self.add_lora(layer.base_layer(x), x, layer.lora_a, layer.lora_b)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                 lora_b: torch.Tensor) -> torch.Tensor:
        """y (num_tokens, out) += the LoRA deltas of x (num_tokens, in); returns y."""
        if not self.any_lora:  # (the CPU path only: a step of base-model tokens adds nothing)
            return y
        return add_lora(y, x, lora_a, lora_b, self.scaling, self.token_lora[:x.shape[0]])

