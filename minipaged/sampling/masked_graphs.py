"""CUDA graphs of a constrained greedy step's sampling (structured outputs on a GPU, lesson 12).

Under async scheduling a step with grammar rows is sampled after the main thread has waited for
the grammar worker (structured_output/background.py). Right after such a wait the few CUDA calls
of that sampling (the bitmask's copy to the GPU, the masked argmax, the tokens' copy back) take
the host several times as long as back to back (benchmarks/structured_wait_ways.py). A graph
replay is one call: this records the three once per batch size, over static buffers, and
replays them; only the logits are copied in first (one device-to-device copy).
"""
from __future__ import annotations

import torch

from minipaged.sampling.kernels import masked_argmax
from minipaged.sampling.params import TokenMask
from minipaged.worker.cuda_graphs import capture_sizes


class MaskedArgmaxGraphs:
    """Graphs of `masked_argmax` over the host bitmask's first rows, one per batch size of the
    ladder (`cuda_graphs.capture_sizes`), each recorded the first time it is needed. Rows beyond
    a step's own are padding: computed over stale buffers and ignored."""

    def __init__(self, max_num_seqs: int, device: torch.device):
        self.sizes = capture_sizes(max_num_seqs)
        self.device = device
        self.logits = None  # (max rows, vocab) in the logits' dtype
        # (bs, host buffers) -> (graph, out on device, out on host, the graph's other buffers):
        # a replay writes into every buffer it was recorded with, so each is kept with it
        self.graphs: dict = {}

    def can_run(self, logits: torch.Tensor, host_bitmask: torch.Tensor) -> bool:
        return logits.shape[0] <= self.sizes[-1] <= host_bitmask.shape[0]

    def run(self, logits: torch.Tensor, host_bitmask: torch.Tensor, host_masked: torch.Tensor,
            keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(2, rows) int64 on the device and its copy in pinned host memory (its copy queued):
        what `masked_argmax(logits, mask)` returns, for the mask of `host_bitmask`'s and
        `host_masked`'s first rows (pinned)."""
        b, vocab = logits.shape
        if self.logits is None or self.logits.dtype != logits.dtype or self.logits.shape[1] != vocab:
            self.logits = torch.zeros(self.sizes[-1], vocab, dtype=logits.dtype, device=self.device)
            self.graphs.clear()
        self.logits[:b].copy_(logits, non_blocking=True)
        bs = next(s for s in self.sizes if s >= b)
        key = (bs, host_bitmask.data_ptr(), host_masked.data_ptr(), keep.data_ptr())
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(bs, host_bitmask, host_masked, keep)
        graph, out, host_out, _ = entry
        graph.replay()
        return out[:, :b], host_out[:, :b]

    def _capture(self, bs, host_bitmask, host_masked, keep):
        bitmask = torch.empty((bs, host_bitmask.shape[1]), dtype=torch.int32, device=self.device)
        masked = torch.empty(bs, dtype=torch.int32, device=self.device)
        host_out = torch.empty((2, bs), dtype=torch.int64, pin_memory=True)

        def step():
            bitmask.copy_(host_bitmask[:bs], non_blocking=True)
            masked.copy_(host_masked[:bs], non_blocking=True)
            out = masked_argmax(self.logits[:bs], TokenMask(bitmask, masked, keep))
            host_out.copy_(out, non_blocking=True)
            return out
        step()  # compiles the kernel's variant outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        return graph, out, host_out, (bitmask, masked, keep, host_bitmask, host_masked)
