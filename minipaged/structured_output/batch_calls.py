"""xgrammar's batched calls on matcher handles taken once, for the async fill (lesson 12).

xgrammar's `BatchGrammarMatcher.batch_accept_token` and `batch_fill_next_token_bitmask` take
`GrammarMatcher` objects, and on every call build the list of their C++ handles in Python; the
accept then reads its result back with one FFI call per row. That is about a microsecond of
Python per row and call, which at 64 rows is a good part of what the calls cost, and under async
scheduling (background.py) the same rows are advanced and filled step after step while the
main thread is the bottleneck. `BatchCalls` takes the handles once per batch of rows and calls
the C++ functions behind those methods directly, testing an accept's result with one call
(does it contain a 0?). Where this xgrammar does not have them, it uses the public methods.

    calls = BatchCalls(matchers)          # xgrammar GrammarMatchers
    refused = calls.accept(tokens)        # matcher k accepts tokens[k]; the k that refused
    calls.fill(batch, bitmask, rows)      # row rows[k] of bitmask <- matcher k's next mask
                                          # (batch: an xgrammar.BatchGrammarMatcher: threads)
"""
from __future__ import annotations

try:  # the C++ functions behind xgrammar's batched methods (xgrammar >= 0.2.9)
    from tvm_ffi import _ffi_api as _tvm_ffi
    from xgrammar.matcher import _core
    _BATCH = _core.BatchGrammarMatcher
    _CONTAINS = _tvm_ffi.ArrayContains
except (ImportError, AttributeError):  # pragma: no cover (another xgrammar: the public calls)
    _BATCH = _CONTAINS = None


class BatchCalls:
    """Batched accept and fill for a fixed list of matchers (the rows of one plan)."""

    def __init__(self, matchers: list, direct: bool = True):
        self.matchers = matchers
        self.direct = direct and _BATCH is not None and all(hasattr(m, "_handle")
                                                            for m in matchers)
        self.handles = [m._handle for m in matchers] if self.direct else None

    def accept(self, tokens: list[int]) -> list[int]:
        """Advance matcher k by tokens[k], each in C++; returns the k whose token was refused
        (those matchers have not moved). If it raises, some matchers may have moved."""
        if not self.direct:
            import xgrammar as xgr
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(self.matchers, tokens)
            return [k for k, ok in enumerate(accepted) if not ok]
        result = _BATCH.batch_accept_token(self.handles, tokens, False)  # an FFI array of 0/1
        if not _CONTAINS(result, 0):
            return []
        return [k for k in range(len(tokens)) if not result[k]]

    def fill(self, batch, bitmask, rows: list[int]) -> None:
        """Fill row rows[k] of `bitmask` ((n, ceil(vocab / 32)) int32 on the CPU) with matcher
        k's next-token mask, on `batch`'s threads (the GIL released)."""
        if not self.direct:
            batch.batch_fill_next_token_bitmask(self.matchers, bitmask, indices=rows)
            return
        batch._handle.batch_fill_next_token_bitmask(self.handles, bitmask, rows, False)
