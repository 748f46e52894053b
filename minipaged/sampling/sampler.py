"""The batched `Sampler`: one next token per logits row, each row with its own `SamplingParams`.

Lesson 04 plots every stage on real stories260K logits. One step's logits go through, in order:

    raw logits ──▶ logprobs (if asked, logprobs.py: vLLM returns the *raw* log-probabilities)
               ──▶ penalties, min_tokens (penalties.py: repetition, frequency, presence; bans)
               ──▶ / temperature ──▶ top-k ──▶ top-p ──▶ min-p ──▶ softmax ──▶ sample

All rows are processed together even when each request asks for different parameters. Sampling
uses the "exponential race": argmax(p / E) with E ~ Exp(1) draws from p. A request with a `seed`
draws its E from its own generator, so its tokens do not depend on what else is in the batch;
with `n > 1` sample i uses `seed + i` (vLLM's rule), so the samples differ but replay exactly.
Greedy rows (temperature 0) take argmax of the processed logits. On CUDA the engine builds a
`KernelSampler` instead (kernel_sampler.py): plain temperature rows drawn by fused Triton kernels.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence as Seq

import torch

from minipaged.sampling.logprobs import gather_logprobs
from minipaged.sampling.params import SamplerOutput, SamplingParams, TokenMask
from minipaged.sampling.penalties import penalize
from minipaged.utils import to_device


class SamplingRow(Protocol):
    """What the sampler reads of one row (the engine passes its `Sequence`s and the sampler
    knows nothing else of them; vLLM passes the same as `SamplingMetadata`)."""

    sampling_params: SamplingParams
    token_ids: list[int]  # prompt + output
    output_token_ids: list[int]
    index: int  # which of a request's n samples (its seed is `seed + index`)
    generator: Optional[torch.Generator]  # made on the row's first seeded draw, kept by it

    @property
    def num_output_tokens(self) -> int: ...


Rows = Seq[SamplingRow]


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's top-k / top-p / min-p support.

    logits: (rows, vocab), already divided by temperature. top_k: (rows,) int, 0 = off;
    top_p, min_p: (rows,) float. top-p keeps the smallest set of most likely tokens whose
    probability reaches top_p; min-p keeps tokens with p >= min_p * p_max.
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (rows, vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    remove = ranks >= k  # top-k
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    # top-p (the first token is always kept); top_p = 1 is off: fp32 cumsums reach 1.0 early.
    remove |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    remove |= probs < (min_p[:, None] * probs[:, :1])  # min-p, relative to the top token
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Turns one step's last-token logits into next tokens for every sampled sequence."""

    def __init__(self, seed: int = 0, eos_token_ids: Seq[int] = ()):
        self.generator: Optional[torch.Generator] = None
        self.seed = seed
        self.eos_token_ids = list(eos_token_ids)

    def engine_generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: Rows) -> SamplerOutput:
        """logits: (num_seqs, vocab), one row per sequence in `seqs`, in the model's dtype
        (fp32 where it matters: logprobs and the torch path widen them first)."""
        params = [s.sampling_params for s in seqs]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = logits.float().log_softmax(dim=-1) if any(want_logprobs) else None
        tokens = self.sample(logits, seqs)
        token_list = tokens.tolist()  # the step's one host sync
        out = SamplerOutput(token_ids=token_list)
        if raw_logprobs is not None:
            gather_logprobs(raw_logprobs, tokens, params, out)  # (logprobs.py)
        return out

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, seqs: Rows) -> torch.Tensor:
        """The next token of every row, as a tensor on the logits' device. Never waits for the
        GPU (async scheduling reads the tokens a step later); logprobs need `__call__`."""
        logits = self.penalize(logits.float(), seqs)  # the torch path computes in fp32
        if all(s.sampling_params.greedy for s in seqs):
            return logits.max(dim=-1).indices  # argmax's first index; faster than argmax on CPU
        return self._sample(logits, seqs)

    def penalize(self, logits: torch.Tensor, seqs: Rows) -> torch.Tensor:
        """Penalties and min_tokens' bans (penalties.py): a copy if any row has one."""
        return penalize(logits, seqs, self.eos_token_ids)

    def sample_masked(self, logits: torch.Tensor, seqs: Rows, mask: TokenMask) -> None:
        """Masks applied inside sampling kernels: only `KernelSampler` does that; None here
        (the caller applies the masks to the logits, then calls `sample`)."""
        return None

    def _sample(self, logits: torch.Tensor, seqs: Rows) -> torch.Tensor:
        device = logits.device
        params = [s.sampling_params for s in seqs]
        any_greedy = any(p.greedy for p in params)
        temps = [1.0 if p.greedy else p.temperature for p in params]
        if len(set(temps)) == 1:  # one temperature for the whole batch: no per-row tensor
            scaled = logits / temps[0]
        else:
            scaled = logits / to_device(temps, device, torch.float32)[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            vocab = logits.shape[1]  # a top_k above the vocabulary keeps every token
            scaled = apply_top_k_top_p_min_p(
                scaled,
                to_device([min(p.top_k, vocab) for p in params], device, torch.int64),
                to_device([p.top_p for p in params], device, torch.float32),
                to_device([p.min_p for p in params], device, torch.float32))
        probs = scaled.softmax(dim=-1)
        # Exponential race: argmax(p / E), E ~ Exp(1), is a draw from p.
        unseeded = [i for i, p in enumerate(params) if p.seed is None and not p.greedy]
        if len(unseeded) == len(params):  # the common case: one draw for the whole batch
            noise = torch.empty_like(probs).exponential_(generator=self.engine_generator(device))
            return (probs / noise).argmax(dim=-1)
        noise = torch.empty_like(probs)
        if unseeded:
            idx = to_device(unseeded, device, torch.int64)
            noise[idx] = torch.empty((len(unseeded), probs.shape[1]), device=device).exponential_(
                generator=self.engine_generator(device))
        for i, (seq, p) in enumerate(zip(seqs, params)):
            if p.seed is not None and not p.greedy:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=device).manual_seed(p.seed + seq.index)
                noise[i].exponential_(generator=seq.generator)
            elif p.greedy:
                noise[i] = 1.0
        sampled = (probs / noise).argmax(dim=-1)
        if not any_greedy:
            return sampled
        greedy = to_device([p.greedy for p in params], device, torch.bool)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)
