"""The engine side of structured outputs: compile per vocabulary, a matcher per sequence, the
bitmask per step (lesson 12).

    compile(params)                its grammar against this tokenizer's vocabulary (cached; a
                                   refusal is a RequestError); a request's is compiled off the
                                   engine's thread when it is added (compiling.py)
    apply_masks(logits, seqs)      each step, before the sampler: one bit per token per
                                   constrained row, filled for all of them in one threaded
                                   call, applied to the logits in one call (forbidden -> -inf)
    accept(seq)                    after a token is appended: advance the matcher; a grammar at
                                   its end finishes the request ("stop")
    token_mask(rows, n, device)    under async scheduling instead (background.py fills the
                                   bitmask on a worker thread): the filled rows for the sampling
                                   kernels, which apply them and find the grammars that ended

The library is xgrammar (docs/guides/structured_outputs.md says why). A matcher is a pushdown automaton over the
grammar; filling its bitmask writes, for its state, which of the vocabulary's tokens may come
next, as int32 words of 32 tokens each, and `apply_token_bitmask_inplace` sets the logits of the
others to -inf (a C++ loop on the CPU, a kernel on CUDA; no Python loop over the vocabulary).
`BatchGrammarMatcher.batch_fill_next_token_bitmask` fills every constrained row in one call, on
`max_threads` threads (its C++ loop, not Python's, walks the rows).

The mask needs only tokens already read, not the logits, so it is filled on the CPU while the GPU
still runs the step's forward: the engine calls `apply_masks` right after launching it, and
nothing before the fill waits for the GPU. On CUDA the bitmask lives in pinned host memory and
goes to the GPU with a non-blocking copy, queued behind the forward, as are the mask kernel and
the sampler; the next fill waits for that copy only (an event), never for the GPU's other work.

Matchers are kept beside the sequences, not in them, keyed by the `Sequence` object (weakly, so a
finished sequence's matcher goes with it; async scheduling keeps the last batch's for its next
step, background.py), and each remembers how many of its sequence's output
tokens it has accepted. Before a mask is filled the matcher catches up with
`seq.output_token_ids`; so a sample forked from its prompt (n > 1) gets its own matcher, and a
sequence preempted by recompute (its tokens kept, its K/V rebuilt) keeps a matcher that is still
right. If the tokens ever were fewer than the matcher has accepted it is rebuilt from them.
Rows without a constraint are not touched: a step with none costs one check per row.
"""
from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from typing import Optional, Sequence as Seq

import torch

from minipaged.engine.sequence import Sequence, SequenceStatus
from minipaged.sampling.params import TokenMask
from minipaged.sampling.structured_outputs import StructuredOutputsParams, grammar_of, library_error


class RequestGrammarError(ValueError):
    """A constraint the grammar library refuses for this vocabulary (raised as RequestError)."""


class _Matcher:
    __slots__ = ("matcher", "compiled", "num_accepted")

    def __init__(self, xgr, compiled, stop_ids: list[int]):
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids)
        self.num_accepted = 0


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int],
                 max_num_seqs: int, cache_size: int = 128,
                 max_threads: Optional[int] = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's vocabulary)
        self.eos_token_ids = list(eos_token_ids)
        self.stop_ids = frozenset(self.eos_token_ids)  # the matchers' stop tokens
        self.max_num_seqs = max_num_seqs
        self.cache_size = cache_size
        self._compiler = None  # built on the first constrained request (xgrammar's import: ~2 s)
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._matchers: weakref.WeakKeyDictionary[Sequence, _Matcher] = weakref.WeakKeyDictionary()
        # threads for a batched fill: half the cores (xgrammar's own default), at most 4 (more
        # were slower on the H200's 16-core host:
        # benchmarks/experiments/structured_outputs/structured_fill_threads.py)
        self.max_threads = max_threads or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._batch = None  # xgrammar.BatchGrammarMatcher, with the first constrained row
        # host buffers, pinned when the logits are on CUDA, reused each step
        self._bitmask: Optional[torch.Tensor] = None  # (max_num_seqs, ceil(vocab / 32)) int32
        self._indices: Optional[torch.Tensor] = None  # (max_num_seqs,) int32: constrained rows
        self._masked: Optional[torch.Tensor] = None  # (max_num_seqs,) int32: row constrained?
        self._keep: dict[torch.device, torch.Tensor] = {}  # device -> the non-stop tokens' bits
        self._last_masked = None  # (rows, num_rows, their flags on the device): token_mask's
        self._copied = None  # CUDA event: the last copy out of the host buffers is done
        self._one_row: Optional[torch.Tensor] = None  # (1, ceil(vocab / 32)): has it ended?
        self.advance_on_fill = False  # set by async scheduling: see `accept`

    # --- when a request is added ------------------------------------------------------------
    def _xgr(self):
        import xgrammar as xgr
        if self._compiler is None:
            if self.tokenizer is None:
                raise RequestGrammarError("structured_outputs needs the model's tokenizer, and "
                                          "this model has none (dummy weights?)")
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return xgr

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar (cached by kind and spec); raises RequestGrammarError. Requests
        are compiled off the engine's thread when they are added (compiling.py)."""
        hit = self.cached(params)
        if hit is not None:
            return hit
        self.prepare_compiler()
        compiled = self.compile_uncached(params)
        self.remember(self.key(params), compiled)
        return compiled

    @staticmethod
    def key(params: StructuredOutputsParams) -> tuple:
        return (params.kind, params.spec, params.disable_any_whitespace)

    def cached(self, params: StructuredOutputsParams):
        """The compiled grammar if the cache holds it, else None."""
        key = self.key(params)
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
        return hit

    def prepare_compiler(self) -> None:
        """Make the compiler for this vocabulary (the first time: it reads every token)."""
        self._xgr()

    def compile_uncached(self, params: StructuredOutputsParams):
        """Compile, touching no state of this object (compiling.py runs it on a worker thread,
        after `prepare_compiler`); raises RequestGrammarError."""
        try:
            return self._compiler.compile_grammar(grammar_of(params))
        except Exception as e:
            raise RequestGrammarError(f"structured_outputs.{params.kind} cannot be compiled: "
                                      f"{library_error(e)}") from None

    def remember(self, key: tuple, compiled) -> None:
        self._compiled[key] = compiled
        self._compiled.move_to_end(key)
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)

    # --- each step --------------------------------------------------------------------------
    def matcher_of(self, seq: Sequence) -> _Matcher:
        """`seq`'s matcher, not yet caught up: a new one for a new sequence (or a fork), or
        when tokens were taken back."""
        st = self._matchers.get(seq)
        if st is None or st.num_accepted > len(seq.output_token_ids):
            # (a matcher made again keeps its grammar: never compiled again on this thread)
            compiled = (st.compiled if st is not None
                        else self.compile(seq.sampling_params.structured_outputs))
            st = self._matchers[seq] = _Matcher(self._xgr(), compiled, self.eos_token_ids)
        return st

    def forget(self, seq: Sequence) -> None:
        """Drop `seq`'s matcher: the next `matcher_of` makes it again from the sequence's tokens
        (after a batched accept that raised midway, background.py)."""
        self._matchers.pop(seq, None)

    def _state(self, seq: Sequence) -> _Matcher:
        """`seq`'s matcher, caught up with its output tokens."""
        st = self.matcher_of(seq)
        out = seq.output_token_ids
        while st.num_accepted < len(out):
            token = out[st.num_accepted]
            if not st.matcher.accept_token(token):
                raise rejected_token(seq, token, st.num_accepted)
            st.num_accepted += 1
        return st

    def fill_bitmask(self, seqs: Seq[Sequence], pin: bool = False) -> list[int]:
        """Fill row i of the host bitmask for each constrained, unfinished `seqs[i]`; returns
        those rows (the others' rows hold stale bits and are not applied)."""
        rows = [i for i, s in enumerate(seqs)
                if s.sampling_params.structured_outputs is not None and not s.is_finished]
        if not rows:
            return rows
        self.prepare_buffers(len(seqs), pin)
        matchers = [self._state(seqs[i]).matcher for i in rows]
        # (rows, ceil(vocab / 32)) int32: bit t of row i = token t allowed
        self._batch.batch_fill_next_token_bitmask(matchers, self._bitmask, indices=rows)
        return rows

    def fill_rows(self, calls, rows: list[int]) -> None:
        """Fill the host bitmask's `rows` with the next-token masks of `calls`' matchers
        (batch_calls.BatchCalls, one per row) on the batched filler's threads: background.py's
        worker runs this after `prepare_buffers`."""
        calls.fill(self._batch, self._bitmask, rows)

    def fill_row(self, matcher, row: int) -> None:
        """One matcher's next-token mask into the host bitmask's `row` (to find a failing row)."""
        matcher.fill_next_token_bitmask(self._bitmask, row)

    def prepare_buffers(self, num_rows: int, pin: bool) -> None:
        """Host bitmask and row-index buffers for `num_rows` rows (pinned for a GPU), and the
        batched filler; waits until the last step's copy has left the buffers."""
        xgr = self._xgr()
        if self._bitmask is None or self._bitmask.shape[0] < num_rows or (
                pin and not self._bitmask.is_pinned()):
            n = max(self.max_num_seqs, num_rows)
            self._bitmask = xgr.allocate_token_bitmask(n, self.vocab_size)
            self._indices = torch.zeros(n, dtype=torch.int32)
            self._masked = torch.zeros(n, dtype=torch.int32)
            if pin:
                self._bitmask = self._bitmask.pin_memory()
                self._indices = self._indices.pin_memory()
                self._masked = self._masked.pin_memory()
            self._copied = None
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(self.max_threads)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left these buffers

    def apply_masks(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        """Set to -inf, in each constrained row, the logits of the tokens its grammar forbids.
        logits: (len(seqs), vocab), possibly still being computed on the GPU. Returns the logits
        (the same tensor unless they had to be widened to fp32 for the CPU kernel)."""
        rows = self.fill_bitmask(seqs, pin=logits.device.type == "cuda")
        return self.apply_bitmask(logits, rows)

    def apply_bitmask(self, logits: torch.Tensor, rows: list[int],
                      on_device: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Apply the host bitmask's `rows` (filled by `fill_bitmask`) to those rows of logits.
        `on_device`: the bitmask already copied to the logits' GPU (`token_mask`'s), used as it
        is instead of being copied again."""
        if not rows:
            return logits
        import xgrammar as xgr
        if logits.device.type != "cuda":
            if logits.dtype != torch.float32:
                logits = logits.float()  # xgrammar's CPU kernel takes fp32
            xgr.apply_token_bitmask_inplace(logits, self._bitmask, vocab_size=self.vocab_size,
                                            indices=rows)
            return logits
        self._indices[:len(rows)] = torch.tensor(rows, dtype=torch.int32)
        mask = (self._bitmask[:logits.shape[0]].to(logits.device, non_blocking=True)
                if on_device is None else on_device)
        indices = self._indices[:len(rows)].to(logits.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size,
                                        indices=indices)
        return logits

    def token_mask(self, rows: list[int], num_rows: int, device: torch.device) -> TokenMask:
        """The host bitmask's first `num_rows` rows, with `rows` marked constrained, for the
        sampling kernels on `device` (copied without waiting: the buffers are not written again
        before the copy is done, see `prepare_buffers`). The same `rows` list as the last time
        (background.py keeps it while the batch stays the same) reuses its row flags."""
        last = self._last_masked
        if last is not None and last[0] is rows and last[1] == num_rows and last[2].device == device:
            masked = last[2]
        else:
            if self._copied is not None:
                self._copied.synchronize()  # the last copy of the flags has left
            flags = self._masked.numpy()
            flags[:num_rows] = 0
            flags[rows] = 1
            masked = self._masked[:num_rows].to(device, non_blocking=True)
            self._last_masked = (rows, num_rows, masked)
        mask = TokenMask(self._bitmask[:num_rows].to(device, non_blocking=True), masked,
                         self.keep_words(device))
        if device.type == "cuda":
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()  # (re-recorded: synchronize waits for the latest copy)
        return mask

    def keep_words(self, device: torch.device) -> torch.Tensor:
        """(ceil(vocab / 32),) int32 on `device`: every token's bit set but the stop tokens'. A
        mask row AND these words is zero exactly when the row allows stop tokens only."""
        keep = self._keep.get(device)
        if keep is None:
            words = torch.full(((self.vocab_size + 31) // 32,), -1, dtype=torch.int64)
            for t in self.eos_token_ids:
                if 0 <= t < self.vocab_size:
                    words[t // 32] &= ~(1 << (t % 32))
            keep = self._keep[device] = words.to(torch.int32).to(device)  # (wraps to int32)
        return keep

    def accept(self, seq: Sequence) -> Optional[SequenceStatus]:
        """Advance `seq`'s matcher over its new tokens; FINISHED_STOPPED once the grammar has
        ended (it accepted a stop token, or nothing but one can follow). Under async scheduling
        (`advance_on_fill`) this does nothing: the matchers advance just before the next fill is
        handed to the worker, and the grammar's end is found there or by the sampling kernels
        (background.py)."""
        if self.advance_on_fill:
            return None
        return SequenceStatus.FINISHED_STOPPED if self.has_ended(self._state(seq)) else None

    def caught_up_and_ended(self, seq: Sequence) -> bool:
        """Advance `seq`'s matcher over its new tokens; has its grammar ended?"""
        return self.has_ended(self._state(seq))

    def has_ended(self, st: _Matcher) -> bool:
        """Has the grammar ended, i.e. can nothing but a stop token follow?"""
        m = st.matcher
        return m.is_terminated() or (m.is_completed() and _only_stop_tokens(self, m))


def ended_rows(mask: TokenMask) -> torch.Tensor:
    """(rows,) int64: 1 where a constrained row's mask allows stop tokens only (its grammar has
    ended), what the sampling kernels report beside their tokens (torch ops, for the others)."""
    opened = (mask.bitmask & mask.keep).ne(0).any(dim=1)
    return (mask.masked.ne(0) & ~opened).to(torch.int64)


def rejected_token(seq: Sequence, token: int, position: int) -> ValueError:
    """The error of a token the grammar does not allow (the request fails alone)."""
    kind = seq.sampling_params.structured_outputs.kind
    return ValueError(f"the grammar does not allow token {token} at output position {position} "
                      f"(structured_outputs.{kind})")


def _only_stop_tokens(mgr: StructuredOutputManager, matcher) -> bool:
    """True when the grammar has ended: its next mask allows stop tokens only."""
    import xgrammar as xgr
    if mgr._one_row is None:
        mgr._one_row = xgr.allocate_token_bitmask(1, mgr.vocab_size)
    matcher.fill_next_token_bitmask(mgr._one_row, 0)
    return not bool((mgr._one_row[0] & mgr.keep_words(torch.device("cpu"))).any())
