"""CUDA graphs for speculative verify steps: every sequence a query of q = k + 1 tokens.

A verify step's shapes are almost fixed: each speculating sequence runs its newest token and k
proposals. `VerifyGraphRunner` records the target's forward once per batch size with exactly q
query tokens per sequence (worker/cuda_graphs.py does the same for decodes, q = 1) and replays
it for any step whose queries are 2..q tokens long: a sequence with fewer tokens (fewer
proposals, a plain decode beside speculating ones, a short prefill chunk) is padded at the
FRONT of its q rows. The attention kernel places query row i at position
`context_len - q + i`, so real rows keep their causal offsets; pad rows store nothing (slot -1)
and their outputs are dropped. Rows of padding sequences have context length 0, as in the
decode graphs.

The step loop registers it in the GPU runner's graph registry as "verify"
(worker/cuda_graphs.py); `GPUModelRunner.forward` replays it when `can_run` says the step
fits; everything else (longer prefill chunks, more sequences than captured) runs eagerly.
`capture=False` keeps the same padded static buffers but runs them eagerly: what the CPU tests
check under the Triton interpreter.
"""
from __future__ import annotations

import torch

from minipaged.attention import AttentionMetadata
from minipaged.attention.metadata import BLOCK_TABLE_WIDTH_MULTIPLE
from minipaged.utils import cdiv, to_device
from minipaged.worker.cuda_graphs import capture_sizes

MAX_VERIFY_SEQS = 32  # verify graphs for batches up to this size; bigger batches run eagerly


class VerifyGraphRunner:
    def __init__(self, model, kv_cache: torch.Tensor, backend, *, query_len: int,
                 max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device):
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.q = query_len
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(min(max_num_seqs, MAX_VERIFY_SEQS))
        self.max_bs = n = self.sizes[-1]
        m = BLOCK_TABLE_WIDTH_MULTIPLE
        self.max_blocks = cdiv(max_model_len, m * block_size) * m
        t = n * query_len
        # Static inputs, (max_bs * q,) tokens and (max_bs,) sequences; replays read these.
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(0, t + 1, query_len, dtype=torch.int32, device=device)
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metadata: dict[int, AttentionMetadata] = {}
        self.pool = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        q, t = self.q, bs * self.q
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            query_lens=[q] * bs, context_lens_host=[self.max_model_len] * bs, max_query_len=q,
            max_context_len=self.max_model_len, block_size=self.block_size)

    def _forward(self, bs: int) -> torch.Tensor:
        t = bs * self.q
        return self.model(self.input_ids[:t], self.positions[:t], self.kv_cache,
                          self.metadata[bs])  # (bs * q, hidden)

    @torch.inference_mode()
    def capture(self, graphs: bool = True) -> None:
        """Record one graph per batch size, largest first (smaller ones reuse its pool).
        `graphs=False`: only build the static metadata (eager replays, for tests)."""
        for bs in reversed(self.sizes):
            self.metadata[bs] = meta = self._metadata(bs)
            self.backend.prepare(meta)
            if not graphs:
                continue
            self._forward(bs)  # warm-up: compiles the kernels, builds the plan's launches
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs], self.outputs[bs] = graph, out
        if graphs:
            torch.cuda.synchronize(self.device)

    def has_logits(self, num_seqs: int) -> bool:
        """Verify graphs end at the hidden states: the runner computes the sampled rows' logits
        (a sequence's k + 1 rows, not every padded one)."""
        return False

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """A step of at most max_bs sequences with queries of 2..q tokens (1 is a decode
        graph's)."""
        return 1 < metadata.max_query_len <= self.q and metadata.num_seqs <= self.max_bs

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states (num_tokens, hidden) in the step's own token order."""
        b, q = metadata.num_seqs, self.q
        bs = next(s for s in self.sizes if s >= b)
        t = bs * q
        if all(n == q for n in metadata.query_lens):  # every query full: no padding rows
            rows = None
            self.input_ids[:b * q].copy_(input_ids)
            self.positions[:b * q].copy_(positions)
            self.slot_mapping[:b * q].copy_(metadata.slot_mapping)
            self.slot_mapping[b * q:t].fill_(-1)  # padding sequences store nothing
        else:
            # Padded row of each real token: sequence r's n tokens end its q rows.
            rows = to_device([(r + 1) * q - n + i for r, n in enumerate(metadata.query_lens)
                              for i in range(n)], self.device, torch.int64)  # (num_tokens,)
            self.input_ids[:t].zero_()
            self.positions[:t].zero_()
            self.slot_mapping[:t].fill_(-1)
            self.input_ids.index_copy_(0, rows, input_ids)
            self.positions.index_copy_(0, rows, positions)
            self.slot_mapping.index_copy_(0, rows, metadata.slot_mapping)
        self.context_lens[:b].copy_(metadata.context_lens, non_blocking=True)
        self.context_lens[b:bs].fill_(0)
        width = metadata.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(metadata.block_tables, non_blocking=True)
        if bs in self.graphs:
            self.graphs[bs].replay()
            hidden = self.outputs[bs]
        else:  # not captured (tests on the CPU): the same static buffers, eagerly
            hidden = self._forward(bs)
        return hidden[:b * q] if rows is None else hidden[rows]
