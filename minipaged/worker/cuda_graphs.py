"""CUDA graphs for decode steps: record the whole forward once per batch size, replay it after.

Lesson 08 explains why: a decode step of a 28-layer model launches hundreds of small kernels, and
on a fast GPU launching them from Python takes longer than running them. A CUDA graph records
the launches once; a replay sends them all with a single call.

A graph replays the *same* kernels on the *same* memory, so every input lives in a static buffer
sized for the largest batch, and a step of `b` sequences uses the smallest captured batch size
`>= b`; the rows beyond `b` are padding (slot -1: nothing stored; context length 0: nothing
read), computed and ignored. Prefill and mixed steps have shapes that change every step and run
eagerly. Only backends whose attention never reads device tensors back on the host (the Triton
backend) can be captured; the split-KV factor is fixed per captured batch size, chosen for
`max_model_len`, so every replay launches the same grid.

A set may also record the LM head for its smallest batch sizes (`logits_max_batch`): the replay
then returns the step's logits too, and the host launches nothing else for the forward. That is
where a step's host work sets the pace (one stream: lesson 08's profile). Larger batches keep
the LM head outside, where the (rows, vocab) outputs of every captured size would otherwise stay
allocated side by side.

`CUDAGraphs` is a runner's registry of graph sets, keyed by what varies between them: the
variant (what was captured), the query length per sequence (1 for a decode set, k + 1 for a
verify set) and, inside each set, the batch size. `find` is the one dispatch: the GPU runner's
`forward` (gpu_model_runner.py) asks it on every step, on one device and on every
tensor-parallel rank (tp_worker.py).
"""
from __future__ import annotations

import torch

from minipaged.attention import AttentionMetadata
from minipaged.attention.metadata import BLOCK_TABLE_WIDTH_MULTIPLE
from minipaged.utils import cdiv


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch-size ladder: 1, 2, 4, 8, then every multiple of 16 (vLLM uses a similar one)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CUDAGraphRunner:
    def __init__(self, model, kv_cache: torch.Tensor, backend, *, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device,
                 logits_max_batch: int = 0):
        self.model = model
        self.logits_max_batch = logits_max_batch  # sizes up to this record the LM head too
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        m = BLOCK_TABLE_WIDTH_MULTIPLE  # the model runner pads block tables to this
        self.max_blocks = cdiv(max_model_len, m * block_size) * m
        self.max_model_len = max_model_len
        dev = device
        n = self.max_bs
        # Static inputs: replays read these, so a step copies its inputs in before replaying.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)  # 1 token each
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.logits: dict[int, torch.Tensor] = {}  # (bs, vocab), sizes <= logits_max_batch
        self.metadata: dict[int, AttentionMetadata] = {}
        self.pool = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            query_lens=[1] * bs, context_lens_host=[self.max_model_len] * bs, max_query_len=1,
            max_context_len=self.max_model_len, block_size=self.block_size, num_decode_tokens=bs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per batch size, largest first so smaller ones reuse its memory pool."""
        for bs in reversed(self.sizes):
            meta = self._metadata(bs)
            self.backend.prepare(meta)
            args = (self.input_ids[:bs], self.positions[:bs], self.kv_cache, meta)
            with_logits = bs <= self.logits_max_batch
            hidden = self.model(*args)  # warm-up: compiles the kernels, builds the plan's launches
            if with_logits:
                self.model.compute_logits(hidden)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model(*args)
                if with_logits:
                    self.logits[bs] = self.model.compute_logits(out)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs], self.outputs[bs], self.metadata[bs] = graph, out, meta
        torch.cuda.synchronize(self.device)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """A decode step (one token per sequence) of at most max_bs sequences."""
        return metadata.max_query_len == 1 and metadata.num_seqs <= self.max_bs

    def padded_size(self, num_seqs: int) -> int:
        """The captured batch size that replays `num_seqs` sequences: the smallest >= it."""
        return next(s for s in self.sizes if s >= num_seqs)

    def has_logits(self, num_seqs: int) -> bool:
        """Does the graph that replays `num_seqs` sequences compute the logits too?"""
        return num_seqs <= self.logits_max_batch

    @torch.inference_mode()
    def run_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   metadata: AttentionMetadata) -> torch.Tensor:
        """`run`, for a size that `has_logits`: the step's (num_seqs, vocab) logits."""
        b = metadata.num_seqs
        self.run(input_ids, positions, metadata)
        return self.logits[self.padded_size(b)][:b]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor:
        """Replay the decode step for `metadata.num_seqs` sequences; returns (num_seqs, hidden)."""
        b = metadata.num_seqs
        bs = self.padded_size(b)
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(metadata.slot_mapping, non_blocking=True)
        self.context_lens[:b].copy_(metadata.context_lens, non_blocking=True)
        if bs > b:  # padding rows: nothing stored, nothing read (each fill is a launch)
            self.slot_mapping[b:bs].fill_(-1)
            self.context_lens[b:bs].fill_(0)
        width = metadata.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(metadata.block_tables, non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]


DECODE = "decode"  # the runner's decode set (gpu_model_runner.py), with whatever the model holds
VERIFY = "verify"  # queries of up to k + 1 tokens each (spec_decode/cuda_graphs.py)
LORA_BASE = "lora-base"  # decode captured without the LoRA kernels (lora/runner.py)


class CUDAGraphs:
    """A runner's graph sets by variant; each set replays the batch sizes it captured."""

    def __init__(self):
        self.sets: dict = {}  # variant -> CUDAGraphRunner (q = 1) or VerifyGraphRunner (k + 1)

    def register(self, variant: str, graphs) -> None:
        """Add a captured set (`can_run(metadata)`, `run(input_ids, positions, metadata)`,
        `has_logits(num_seqs)` and, where that is true, `run_logits(...)`)."""
        self.sets[variant] = graphs

    def get(self, variant: str):
        """The set registered as `variant`, or None."""
        return self.sets.get(variant)

    def find(self, metadata: AttentionMetadata, decode_variant: str = DECODE):
        """The set that replays this step, or None (it runs eagerly): one token per sequence
        replays `decode_variant`'s set, 2..k + 1 tokens each the verify set, each only up to its
        largest captured batch."""
        graphs = self.sets.get(decode_variant if metadata.max_query_len == 1 else VERIFY)
        return graphs if graphs is not None and graphs.can_run(metadata) else None
