"""Tests for `minipaged/sampling/kernels.py`: the Triton sampling kernels (the CUDA engine's
default; interpreted here, TRITON_INTERPRET=1) against the softmax, argmax and the torch
sampler, and with grammar masks (lesson 12) against draws from logits masked beforehand.
tests/test_gpu.py repeats the distribution checks with many more draws on the GPU."""
from __future__ import annotations

import pytest
import torch

from minipaged.sampling import Sampler
from minipaged.sampling.kernel_sampler import KernelSampler, kernel_applies
from tests.helpers import IGNORE_INTERPRETER_WARNINGS
from tests.test_sampler import EOS, chi_square, distinct_logits, make_seq


@IGNORE_INTERPRETER_WARNINGS
def test_kernel_temperature_sampling_matches_softmax():
    """The interpreter is slow (a few ms per row), so few draws here; tests/test_gpu.py repeats
    this with 60,000 draws on the GPU."""
    pytest.importorskip("triton")
    temperature = 0.5
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.5, 0.0])
    n = 400  # one program per row: every row is an independent draw
    seq = make_seq([1], temperature=temperature)
    sampler = KernelSampler(seed=7)
    assert kernel_applies([seq.sampling_params])
    tokens = sampler(logits.repeat(n, 1), [seq] * n).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    probs = (logits.double() / temperature).softmax(-1)
    assert chi_square(counts, probs) < 30.0, (counts / n, probs)
    wrong = (logits.double() / (temperature * 3)).softmax(-1)
    assert chi_square(counts, wrong) > 100.0
    # The next step draws fresh numbers (a new seed from the engine's generator).
    again = sampler(logits.repeat(n, 1), [seq] * n).token_ids
    assert again != tokens


@IGNORE_INTERPRETER_WARNINGS
def test_kernel_greedy_rows_banned_tokens_and_fallbacks():
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(5)
    logits = distinct_logits(gen, 8, 3000)  # several tiles of the kernel's loop
    seqs = [make_seq([1], temperature=0.0 if r % 2 == 0 else 1.0) for r in range(8)]
    sampler = KernelSampler(seed=0, eos_token_ids=[EOS])
    tokens = sampler(logits, seqs).token_ids
    for r in range(0, 8, 2):
        assert tokens[r] == int(logits[r].argmax())
    # min_tokens bans EOS by -inf logits; the kernel never picks them.
    hot = torch.zeros(20, 16)
    hot[:, EOS] = 20.0
    young = make_seq([1], temperature=1.0, min_tokens=2)
    assert EOS not in sampler(hot, [young] * 20).token_ids
    # Seeds and top-k/top-p need the torch path (per-request generators, sorted filters).
    for p in (dict(seed=3), dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1)):
        assert not kernel_applies([make_seq([1], temperature=1.0, **p).sampling_params])


@IGNORE_INTERPRETER_WARNINGS
def test_kernel_sampler_keeps_its_plan_while_the_rows_are_the_same_sequences(monkeypatch):
    """A decode step of the same sequences as the last one reuses their 1 / T on the device
    (no host copy per step); other sequences, even with equal values, get a plan of their own,
    so a greedy batch after a sampled one is argmax again."""
    pytest.importorskip("triton")
    from minipaged.sampling import kernel_sampler
    calls = []
    inv_temperature = kernel_sampler.inv_temperature
    monkeypatch.setattr(kernel_sampler, "inv_temperature",
                        lambda params, device: calls.append(len(params)) or
                        inv_temperature(params, device))
    gen = torch.Generator().manual_seed(3)
    logits = distinct_logits(gen, 4, 40, scale=0.2)  # flat: T = 1 rarely picks the argmax
    hot = [make_seq([1], temperature=1.0) for _ in range(4)]
    sampler = KernelSampler(seed=2)
    first = sampler(logits, hot).token_ids
    second = sampler(logits, hot).token_ids
    assert calls == [4] and first != second  # one copy of 1 / T; fresh draws each step
    cold = [make_seq([1], temperature=0.0) for _ in range(4)]
    assert sampler(logits, cold).token_ids == logits.argmax(-1).tolist()
    assert calls == [4]  # all greedy: no 1 / T at all


@IGNORE_INTERPRETER_WARNINGS
def test_kernel_two_stage_draw_matches_softmax_across_chunks():
    """The kernel draws a chunk by its log-sum-exp, then a token inside it: together exactly the
    softmax. Eight live tokens spread over four chunks of 16 (the rest banned, -inf)."""
    pytest.importorskip("triton")
    from minipaged.sampling.kernels import gumbel_sample
    live = torch.tensor([3, 10, 17, 30, 33, 40, 50, 63])
    values = torch.tensor([0.5, -0.3, 1.2, 0.0, -1.0, 0.8, 0.3, -0.6])
    logits = torch.full((64,), float("-inf"))
    logits[live] = values
    n, temperature = 600, 0.8
    inv_t = torch.full((n,), 1 / temperature)
    tokens = gumbel_sample(logits.repeat(n, 1), inv_t, seed=5, chunk=16)
    assert set(tokens.tolist()) <= set(live.tolist())
    counts = torch.bincount(tokens, minlength=64)[live].double()
    probs = (values.double() / temperature).softmax(-1)
    assert chi_square(counts, probs) < 25.0, (counts / n, probs)  # 7 d.o.f.: p ~ 0.001
    assert chi_square(counts, (values.double() / (3 * temperature)).softmax(-1)) > 60.0
    # greedy rows: the first maximum whatever the chunking
    gen = torch.Generator().manual_seed(11)
    many = distinct_logits(gen, 3, 3000, scale=0.5)
    for chunk in (16, 256, 4096):
        assert gumbel_sample(many, torch.zeros(3), seed=1, chunk=chunk).tolist() \
            == many.argmax(-1).tolist()


@IGNORE_INTERPRETER_WARNINGS
def test_kernel_reads_bf16_logits_and_breaks_ties_like_argmax():
    """The model hands the sampler bf16 logits on the GPU; the kernel widens them as it reads,
    so it draws exactly what it draws from their fp32 copy. A greedy row whose maximum appears
    twice (possible in bf16) takes the first, as torch.argmax does."""
    pytest.importorskip("triton")
    from minipaged.sampling.kernels import gumbel_sample
    gen = torch.Generator().manual_seed(12)
    logits = distinct_logits(gen, 4, 3000, scale=0.5).to(torch.bfloat16)
    inv_t = torch.tensor([0.0, 1.0, 2.0, 0.5])
    assert (gumbel_sample(logits, inv_t, seed=9).tolist()
            == gumbel_sample(logits.float(), inv_t, seed=9).tolist())
    tied = torch.zeros(2, 3000)
    tied[:, [1500, 2999, 7]] = 3.0  # one tie inside a tile, one across tiles
    assert gumbel_sample(tied, torch.zeros(2), seed=1).tolist() == [7, 7]
    tied[:, 7] = 0.0
    assert gumbel_sample(tied, torch.zeros(2), seed=1, chunk=1024).tolist() == [1500, 1500]
    assert gumbel_sample(tied, torch.zeros(2), seed=1, chunk=4096).tolist() == [1500, 1500]
    # NaN logits (a broken model) still give a token id inside the vocabulary
    nan = torch.full((2, 40), float("nan"))
    assert all(0 <= t < 40 for t in gumbel_sample(nan, torch.tensor([0.0, 1.0]), seed=1).tolist())


def _token_mask(allowed: torch.Tensor, masked: list[int], stops: list[int]):
    """A TokenMask from (rows, vocab) bool `allowed` (xgrammar's bit layout)."""
    from minipaged.sampling.params import TokenMask
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.to(torch.int64)
    packed = (padded.reshape(rows, words, 32) << torch.arange(32)).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    keep = torch.full((words * 32,), 1, dtype=torch.int64)
    keep[stops] = 0
    keep = (keep.reshape(words, 32) << torch.arange(32)).sum(-1)
    keep = torch.where(keep >= 2**31, keep - 2**32, keep).to(torch.int32)
    return TokenMask(packed, torch.tensor(masked, dtype=torch.int32), keep)


@IGNORE_INTERPRETER_WARNINGS
def test_kernel_applies_grammar_masks_and_flags_rows_that_allow_only_stop_tokens():
    """With a TokenMask the kernels draw each masked row from its allowed tokens only: exactly
    what they draw from logits masked beforehand (same seed), for greedy and sampled rows; an
    unmasked row is untouched. The second output row flags the masked rows that allow nothing
    but stop tokens (as manager.ended_rows computes it with torch ops)."""
    pytest.importorskip("triton")
    from minipaged.sampling.kernels import gumbel_sample
    from minipaged.structured_output.manager import ended_rows
    gen = torch.Generator().manual_seed(21)
    rows, vocab, stop = 7, 3000, 2999
    logits = distinct_logits(gen, rows, vocab)
    allowed = torch.rand(rows, vocab, generator=gen) < 0.3
    allowed[2] = False
    allowed[2, stop] = True  # the grammar has ended: only the stop token
    allowed[3] = False
    allowed[3, [17, stop]] = True  # complete, but it may go on
    allowed[5] = False  # allows nothing (flagged too)
    masked = [1, 1, 1, 1, 0, 1, 1]  # row 4 is not constrained
    mask = _token_mask(allowed, masked, [stop])
    inv_t = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 2.0])
    out = gumbel_sample(logits, inv_t, seed=4, chunk=256, mask=mask)
    assert out.shape == (2, rows)
    forbid = ~allowed & torch.tensor(masked, dtype=torch.bool)[:, None]
    premasked = logits.masked_fill(forbid, float("-inf"))
    expect = gumbel_sample(premasked, inv_t, seed=4, chunk=256)
    assert out[0].tolist() == expect.tolist()
    assert out[0, 0] == premasked[0].argmax() and out[0, 2] == stop and out[0, 3] == 17
    for r in (0, 1, 3, 6):
        assert allowed[r, out[0, r]]
    assert out[1].tolist() == [0, 0, 1, 0, 0, 1, 0]
    assert ended_rows(mask).tolist() == out[1].tolist()
    # all rows greedy: the one-launch kernel finds the same tokens and flags
    from minipaged.sampling.kernels import masked_argmax
    greedy = gumbel_sample(logits, torch.zeros(rows), seed=4, chunk=256, mask=mask)
    assert masked_argmax(logits, mask).tolist() == greedy.tolist()
    assert greedy[0].tolist() == premasked.argmax(-1).tolist()
    # every token allowed: the unmasked draw, token for token
    everything = _token_mask(torch.ones(rows, vocab, dtype=torch.bool), [1] * rows, [stop])
    both = gumbel_sample(logits, inv_t, seed=4, chunk=256, mask=everything)
    assert both[0].tolist() == gumbel_sample(logits, inv_t, seed=4, chunk=256).tolist()
    assert both[1].tolist() == [0] * rows


class _StandIn:
    """A stand-in for a Triton kernel and the CUDA driver, for `kernel_launch.CompiledLaunch`:
    `jit_calls` records launches through `kernel[grid](...)`, `runs` through a compiled variant's
    launcher; `device[0]` is the current device; `on_cuda(t)` a CPU tensor that says it is on the
    GPU."""

    def __init__(self, monkeypatch, arg_names, unspecialized=()):
        import types

        import triton
        self.jit_calls, self.runs, self.device = [], [], [0]
        runs, jit_calls = self.runs, self.jit_calls

        class Compiled:
            function, packed_metadata = "function", "metadata"

            def run(self, *args):
                runs.append(args)

        class Kernel:
            params = [types.SimpleNamespace(num=i, do_not_specialize=name in unspecialized)
                      for i, name in enumerate(arg_names)]

            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    jit_calls.append((grid, args, kwargs))
                    return Compiled()
                return launch

        Kernel.arg_names = list(arg_names)
        self.kernel = Kernel()
        driver = types.SimpleNamespace(active=types.SimpleNamespace(
            get_current_device=lambda: self.device[0], get_current_stream=lambda d: 100 + d))
        monkeypatch.setattr(triton.runtime, "driver", driver)

    @staticmethod
    def on_cuda(t: torch.Tensor) -> torch.Tensor:
        class OnCuda(torch.Tensor):
            @property
            def device(self):
                return torch.device("cuda", 0)
        return t.as_subclass(OnCuda)


def test_compiled_launch_reuses_a_variant_only_for_the_same_specialisation(monkeypatch):
    """kernel_launch.CompiledLaunch, with a stand-in for a Triton kernel and the CUDA driver: the
    first launch of a variant goes through `kernel[grid](...)` and keeps what it returns; a launch with
    the same dtypes, 16-byte alignment and integer values calls that variant's launcher with the
    grid padded to 3, the current stream and the constexprs after the arguments; another
    alignment, integer or device, or a launch hook (a profiler), takes `kernel[grid]` again."""
    import triton

    from minipaged import kernel_launch

    stand_in = _StandIn(monkeypatch, ["y_ptr", "x_ptr", "n", "BLOCK"])
    jit_calls, runs, device = stand_in.jit_calls, stand_in.runs, stand_in.device
    launch = kernel_launch.CompiledLaunch(stand_in.kernel)
    buf = torch.zeros(64, dtype=torch.int32)
    first = stand_in.on_cuda(torch.zeros(8))
    launch((4,), first, buf, 7, num_warps=2, BLOCK=16)  # new: Triton's path
    assert len(jit_calls) == 1 and not runs
    launch((8, 2), first, buf, 7, num_warps=2, BLOCK=16)  # same variant, another grid
    assert len(jit_calls) == 1
    assert runs == [(8, 2, 1, 100, "function", "metadata", None, None, None, first, buf, 7, 16)]
    launch((4,), first, buf[1:], 7, num_warps=2, BLOCK=16)  # 4 bytes in: not 16-byte aligned
    launch((4,), first, buf, 9, num_warps=2, BLOCK=16)  # another integer
    launch((4,), first, buf, 7, num_warps=4, BLOCK=16)  # other warps
    launch((4,), first, buf, 7, num_warps=2, BLOCK=32)  # another constexpr
    device[0] = 1
    launch((4,), first, buf, 7, num_warps=2, BLOCK=16)  # another current device
    assert len(jit_calls) == 6 and len(runs) == 1
    device[0] = 0
    launch((4,), first, buf[4:], 7, num_warps=2, BLOCK=16)  # 16 bytes in: the first variant
    assert len(jit_calls) == 6 and len(runs) == 2
    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch((4,), first, buf, 7, num_warps=2, BLOCK=16)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(jit_calls) == 7 and len(runs) == 2
    with pytest.raises(AssertionError):  # constexprs out of the kernel's order
        kernel_launch.CompiledLaunch(stand_in.kernel)((4,), first, buf, num_warps=2, BLOCK=16, n=7)
    with pytest.raises(AssertionError):  # a bool would share an int's variant (True == 1)
        kernel_launch.CompiledLaunch(stand_in.kernel)((4,), first, buf, True, num_warps=2, BLOCK=16)


def test_compiled_launch_keys_an_unspecialised_integer_by_its_type_only(monkeypatch):
    """An integer the kernel does not specialise on (`do_not_specialize`: the sampler's per-step
    seed) takes the same variant whatever its value, and another one only where its type changes
    (past 32 bits): without this every step's new seed went through Triton's dispatch and kept
    one more variant."""
    from minipaged import kernel_launch

    stand_in = _StandIn(monkeypatch, ["x_ptr", "seed", "BLOCK"], unspecialized=("seed",))
    jit_calls, runs = stand_in.jit_calls, stand_in.runs
    launch = kernel_launch.CompiledLaunch(stand_in.kernel)
    x = stand_in.on_cuda(torch.zeros(8))
    for seed in (5, 16, 1, 2**31 - 1, 12345):
        launch((1,), x, seed, num_warps=1, BLOCK=16)
    assert len(jit_calls) == 1 and len(runs) == 4 and len(launch.variants) == 1
    launch((1,), x, 2**40, num_warps=1, BLOCK=16)  # a 64-bit integer: another variant
    assert len(jit_calls) == 2 and len(launch.variants) == 2
