"""`KernelSampler`: the `Sampler` with plain temperature rows drawn by Triton kernels (lesson 08).

The engine builds it instead of `Sampler` on CUDA (`EngineConfig.sampler_kernel`); on the CPU
the kernels run only under TRITON_INTERPRET=1 (the tests). Rows that ask for nothing but a
temperature (no seed, top-k / top-p / min-p off) are drawn by the fused
two-stage Gumbel kernel of kernels.py, reading bf16 logits as they are (a (256, 151,936) fp32
copy would cost more than the whole kernel); every other batch takes `Sampler`'s torch path.
Async scheduling's grammar-constrained steps apply their masks inside the same kernels
(`sample_masked`).
"""
from __future__ import annotations

import torch

from minipaged.sampling.params import SamplingParams, TokenMask
from minipaged.sampling.sampler import Rows, Sampler
from minipaged.utils import to_device


def inv_temperature(params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    """(rows,) fp32 on `device`: 1 / T per row, 0 for greedy rows (the kernels' argument)."""
    return to_device([0.0 if p.greedy else 1.0 / p.temperature for p in params], device,
                     torch.float32)


def kernel_applies(params: list[SamplingParams]) -> bool:
    """Plain temperature (or greedy) rows without a seed: the Triton kernels' two-stage draw."""
    return all(p.greedy or (p.seed is None and p.top_k == 0 and p.top_p == 1.0
                            and p.min_p == 0.0) for p in params)


class KernelSampler(Sampler):
    def __init__(self, seed: int = 0, eos_token_ids=()):
        super().__init__(seed, eos_token_ids)
        self.host_generator = torch.Generator().manual_seed(seed)  # the kernel's per-step seeds
        self.last_rows = None  # `rows_plan`: (its last rows, kernels apply?, their 1 / T)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, seqs: Rows) -> torch.Tensor:
        # the common case is planned once while the rows stay the same sequences (`rows_plan`)
        kernel, inv_t = self.rows_plan(logits, seqs)
        if not kernel:  # penalties or min_tokens bans: each step applies them to its logits
            params = [s.sampling_params for s in seqs]
            if not kernel_applies(params):
                return super().sample(logits, seqs)
            if any(p.has_penalties for p in params):  # penalties are computed in fp32
                logits = logits.float()
            logits = self.penalize(logits, seqs)  # (-inf, min_tokens' bans, never wins the draw)
            if not all(p.greedy for p in params):
                inv_t = inv_temperature(params, logits.device)
        if inv_t is None:  # all greedy
            return logits.max(dim=-1).indices
        from minipaged.sampling.kernels import gumbel_sample
        return gumbel_sample(logits, inv_t, self.next_seed())

    @torch.no_grad()
    def sample_masked(self, logits: torch.Tensor, seqs: Rows, mask: TokenMask):
        """`sample` with grammar masks applied inside the kernels (kernels.py), for async
        scheduling's constrained steps on the GPU: (2, rows) int64, the tokens and, per row, 1
        where its mask allows stop tokens only. None where the kernels do not apply (the caller
        applies the masks to the logits and calls `sample`). Such steps have no penalties,
        logprobs or min_tokens bans (async scheduling samples those at once), and from one step
        to the next their rows are mostly the same sequences: what the rows ask for is worked
        out once per batch (`rows_plan`)."""
        kernel, inv_t = self.rows_plan(logits, seqs)
        if not kernel:
            return None
        from minipaged.sampling.kernels import gumbel_sample, masked_argmax
        if inv_t is None:  # all greedy: one launch, and no draw (as `sample` takes none)
            return masked_argmax(logits, mask)
        return gumbel_sample(logits, inv_t, self.next_seed(), mask=mask)

    def next_seed(self) -> int:
        """The next draw's seed, from the sampler's own generator (seeded once)."""
        return int(torch.randint(2**31 - 1, (1,), generator=self.host_generator))

    def rows_plan(self, logits: torch.Tensor, seqs: Rows):
        """(do the kernels apply, the rows' 1 / T on the device or None if all are greedy),
        kept while the rows are the same objects (the engine's `Sequence`s compare by
        identity)."""
        last = self.last_rows
        if last is not None and last[0] == seqs:
            return last[1], last[2]
        params = [s.sampling_params for s in seqs]
        kernel = (kernel_applies(params) and not any(p.has_penalties for p in params)
                  and not any(s.num_output_tokens < s.sampling_params.min_tokens for s in seqs))
        inv_t = None
        if kernel and not all(p.greedy for p in params):
            inv_t = inv_temperature(params, logits.device)
        self.last_rows = (list(seqs), kernel, inv_t)
        return kernel, inv_t
