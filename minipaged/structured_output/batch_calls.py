"""xgrammar's batched calls on matcher handles taken once, for the async fill (lesson 12).

xgrammar's `BatchGrammarMatcher.batch_accept_token` and `batch_fill_next_token_bitmask` take
`GrammarMatcher` objects, and on every call build the list of their C++ handles in Python; the
accept then reads its result back with one FFI call per row. That is about a microsecond of
Python per row and call, which at 64 rows is a good part of what the calls cost, and under async
scheduling (background.py) the same rows are advanced and filled step after step while the
main thread is the bottleneck. `BatchCalls` takes the handles once per batch of rows and calls
the C++ functions behind those methods directly, testing an accept's result with one call
(does it contain a 0?). Where this xgrammar does not have them (tried once), it uses the
public methods.

    calls = BatchCalls(matchers)          # xgrammar GrammarMatchers
    refused = calls.accept(tokens)        # matcher k accepts tokens[k]; the k that refused
    calls.fill(batch, bitmask, rows)      # row rows[k] of bitmask <- matcher k's next mask
                                          # (batch: an xgrammar.BatchGrammarMatcher: threads)
"""
from __future__ import annotations

import functools


@functools.cache
def _direct_calls():
    """xgrammar's C++ batched accept and tvm_ffi's `ArrayContains`, if this xgrammar has them
    with the arguments used here (tried once, on empty lists: a later version that renamed or
    changed them gets the public methods, instead of an error at every step); else None.
    (On first use, not at import: xgrammar takes seconds to import.)"""
    try:
        import torch
        from tvm_ffi import _ffi_api as tvm_ffi
        from xgrammar import BatchGrammarMatcher
        from xgrammar.matcher import _core
        batch, contains = _core.BatchGrammarMatcher, tvm_ffi.ArrayContains
        if contains(batch.batch_accept_token([], [], False), 0):
            return None
        BatchGrammarMatcher(1)._handle.batch_fill_next_token_bitmask(
            [], torch.zeros((1, 1), dtype=torch.int32), [], False)
        return batch, contains
    except Exception:  # pragma: no cover (another xgrammar: the public calls)
        return None


class BatchCalls:
    """Batched accept and fill for a fixed list of matchers (the rows of one plan)."""

    def __init__(self, matchers: list, direct: bool = True):
        self.matchers = matchers
        calls = _direct_calls() if direct else None
        self.direct = calls is not None and all(hasattr(m, "_handle") for m in matchers)
        self._cpp, self._contains = calls if self.direct else (None, None)
        self.handles = [m._handle for m in matchers] if self.direct else None

    def accept(self, tokens: list[int]) -> list[int]:
        """Advance matcher k by tokens[k], each in C++; returns the k whose token was refused
        (those matchers have not moved). If it raises, some matchers may have moved."""
        if not self.direct:
            import xgrammar as xgr
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(self.matchers, tokens)
            return [k for k, ok in enumerate(accepted) if not ok]
        result = self._cpp.batch_accept_token(self.handles, tokens, False)  # FFI array, 0/1
        if not self._contains(result, 0):  # (0, not False: the elements are ints)
            return []
        return [k for k in range(len(tokens)) if not result[k]]

    def fill(self, batch, bitmask, rows: list[int]) -> None:
        """Fill row rows[k] of `bitmask` ((n, ceil(vocab / 32)) int32 on the CPU) with matcher
        k's next-token mask, on `batch`'s threads (the GIL released)."""
        if not self.direct:
            batch.batch_fill_next_token_bitmask(self.matchers, bitmask, indices=rows)
            return
        batch._handle.batch_fill_next_token_bitmask(self.handles, bitmask, rows, False)
