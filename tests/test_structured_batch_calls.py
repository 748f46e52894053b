"""structured_output/batch_calls.py: xgrammar's batched accept and fill, called on matcher
handles taken once, must answer as xgrammar's own calls do: the rows whose token is refused (their
matchers unmoved, the others advanced), and each row's next-token mask where `rows` puts it; both
on the direct C++ path (which this xgrammar must offer) and on the public methods."""
import pytest
import torch

from minipaged import LLM
from minipaged.structured_output import StructuredOutputsParams as SO
from minipaged.structured_output.batch_calls import BatchCalls


@pytest.fixture(scope="module")
def grammar():
    """A compiled choice grammar over stories260K's vocabulary, a token it allows first and one
    it refuses."""
    import xgrammar as xgr
    mgr = LLM("stories260K", device="cpu").engine.structured_output
    compiled = mgr.compile(SO(choice=["yes", "no", "the cat sat"]))
    bitmask = xgr.allocate_token_bitmask(1, mgr.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    allowed = [t for t in range(mgr.vocab_size) if bitmask[0, t // 32] >> (t % 32) & 1]
    refused = next(t for t in range(mgr.vocab_size) if t not in allowed and t > 3)
    return compiled, allowed[0], refused, mgr.vocab_size


def _state(matcher):
    return matcher._debug_print_internal_state()


@pytest.mark.parametrize("direct", [True, False])
def test_batched_accept_reports_the_refused_rows_and_moves_only_the_others(grammar, direct):
    import xgrammar as xgr
    compiled, ok, bad, _ = grammar
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(4)]
    calls = BatchCalls(matchers, direct=direct)
    assert calls.direct == direct  # this xgrammar has the C++ calls the direct path uses
    assert calls.accept([ok, bad, ok, bad]) == [1, 3]
    fresh, moved = xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(compiled)
    assert moved.accept_token(ok)
    assert [_state(m) for m in matchers] == [_state(moved), _state(fresh)] * 2
    assert calls.accept([bad] * 4) == [0, 1, 2, 3]  # nothing accepted: nothing moved
    assert [_state(m) for m in matchers] == [_state(moved), _state(fresh)] * 2
    assert BatchCalls(matchers[1:2], direct=direct).accept([ok]) == []
    assert _state(matchers[1]) == _state(moved)


@pytest.mark.parametrize("direct", [True, False])
def test_batched_fill_writes_each_matchers_mask_into_its_row(grammar, direct):
    import xgrammar as xgr
    compiled, ok, _, vocab = grammar
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(3)]
    assert matchers[1].accept_token(ok)
    bitmask = xgr.allocate_token_bitmask(5, vocab)
    bitmask.zero_()
    BatchCalls(matchers, direct=direct).fill(xgr.BatchGrammarMatcher(2), bitmask, [4, 0, 2])
    want = xgr.allocate_token_bitmask(5, vocab)
    want.zero_()
    for row, m in zip([4, 0, 2], matchers):
        m.fill_next_token_bitmask(want, row)
    assert torch.equal(bitmask, want) and not torch.equal(want[4], want[0])
