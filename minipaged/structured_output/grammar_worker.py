"""The grammar process's side: matchers and bitmask fills outside the engine's process (lesson
12; `grammar_process.py` is the engine's side and says why it exists).

    python -m minipaged.structured_output.grammar_worker

reads requests on stdin and answers on stdout, each a pickled tuple in
`multiprocessing.connection`'s frames (stdout itself is pointed at stderr, so that a stray print
cannot break a frame):

    ("init", info_path, bitmask_path, rows, words, stop_ids, max_threads)   -> ("ready",)
        the tokenizer's xgrammar.TokenizerInfo (its JSON, in a file this process deletes) and
        the bitmask, (rows, words) int32 in a file both processes map
    ("fill", entries, grammars, drop)   -> ("filled", rows, ended, errors)
        entries: (row, seq_id, grammar id, reset, tokens): the sequence's matcher (made anew
        from the grammar if `reset` or unknown here) accepts `tokens`, then its mask is filled
        into bitmask row `row`; grammars: (id, kind, spec, disable_any_whitespace) first seen;
        drop: sequence ids whose matchers go
    ("same", tokens)   the last fill's rows again, each one token further -> as "fill"

Answers: rows filled; rows whose grammar ended (it accepted a stop token); errors as
(row, token, position) for a token the grammar refuses (position: its index in the output) and
(row, None, message) for anything else. A row with an error loses its matcher; the others are
not disturbed. The process ends when stdin closes.
"""
from __future__ import annotations

import mmap
import os
import sys
from multiprocessing.connection import Connection
from typing import Optional


class _Row:
    """A sequence's matcher and the tokens it has accepted (to make it again after a fault)."""
    __slots__ = ("matcher", "grammar", "tokens")

    def __init__(self, matcher, grammar: int):
        self.matcher, self.grammar, self.tokens = matcher, grammar, []


class GrammarWorker:
    def __init__(self, info_path: str, bitmask_path: str, rows: int, words: int,
                 stop_ids: list[int], max_threads: int):
        import torch
        import xgrammar as xgr
        self.xgr = xgr
        with open(info_path) as f:
            info = xgr.TokenizerInfo.deserialize_json(f.read())
        os.unlink(info_path)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.stop_ids = list(stop_ids)
        self.stop_set = frozenset(stop_ids)
        with open(bitmask_path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), rows * words * 4)
        self.bitmask = torch.frombuffer(self._map, dtype=torch.int32).view(rows, words)
        self.batch = xgr.BatchGrammarMatcher(max_threads)
        self.grammars: dict[int, object] = {}  # id -> CompiledGrammar
        self.rows: dict[int, _Row] = {}  # seq_id -> its matcher
        self.plan: Optional[tuple] = None  # the last fill's (rows, seq ids, _Rows, BatchCalls)

    def fill(self, entries: list, grammars: list, drop: list) -> tuple:
        from minipaged.structured_output.params import _grammar
        for gid, kind, spec, ws in grammars:
            try:
                self.grammars[gid] = self.compiler.compile_grammar(_grammar(kind, spec, ws))
            except Exception as exc:  # (checked where the request entered: not expected)
                self.grammars[gid] = exc
        for sid in drop:
            self.rows.pop(sid, None)
        ended, errors = [], []
        one, ready = [], []  # (row, sid, _Row, token) for the batched accept; (row, sid, _Row)
        for row, sid, gid, reset, tokens in entries:
            try:
                st = None if reset else self.rows.get(sid)
                if st is None:
                    compiled = self.grammars[gid]
                    if isinstance(compiled, Exception):
                        raise compiled
                    st = self.rows[sid] = _Row(self.xgr.GrammarMatcher(
                        compiled, override_stop_tokens=self.stop_ids), gid)
                if len(tokens) == 1 and tokens[0] not in self.stop_set:
                    one.append((row, sid, st, tokens[0]))
                    continue
                if self._accept_each(st, tokens, row, errors):
                    if st.matcher.is_terminated():  # it accepted a stop token
                        ended.append(row)
                        del self.rows[sid]
                    else:
                        ready.append((row, sid, st))
                else:
                    del self.rows[sid]
            except Exception as exc:  # this row alone
                errors.append((row, None, f"{type(exc).__name__}: {exc}"))
                self.rows.pop(sid, None)
        ready += self._accept_batched(one, None, errors)
        ready.sort()
        return self._fill(ready, ended, errors)

    def same(self, tokens: list[int]) -> tuple:
        rows, sids, states, calls = self.plan
        if len(tokens) != len(rows):
            raise ValueError(f"'same' with {len(tokens)} tokens for {len(rows)} rows")
        errors = []
        ready = self._accept_batched(list(zip(rows, sids, states, tokens)), calls, errors)
        return self._fill(ready, [], errors, calls if len(ready) == len(rows) else None)

    def _accept_each(self, st: _Row, tokens: list[int], row: int, errors: list) -> bool:
        for t in tokens:
            if not st.matcher.accept_token(t):
                errors.append((row, t, len(st.tokens)))
                return False
            st.tokens.append(t)
        return True

    def _accept_batched(self, one: list, calls, errors: list) -> list:
        """Each (row, sid, _Row, token) accepts its token in one call into xgrammar's C++;
        returns the (row, sid, _Row) that did. If the call raises, some matchers may have
        moved: those rows' matchers are made again from their tokens, one row at a time."""
        from minipaged.structured_output.batch_calls import BatchCalls
        if not one:
            return []
        tokens = [t for *_, t in one]
        try:
            refused = set((calls or BatchCalls([st.matcher for _, _, st, _ in one])).accept(tokens))
        except Exception:
            ready = []
            for row, sid, st, t in one:
                try:
                    again = _Row(self.xgr.GrammarMatcher(self.grammars[st.grammar],
                                                         override_stop_tokens=self.stop_ids),
                                 st.grammar)
                    self.rows[sid] = again
                    if self._accept_each(again, st.tokens + [t], row, errors):
                        ready.append((row, sid, again))
                    else:
                        del self.rows[sid]
                except Exception as exc:  # this row alone
                    errors.append((row, None, f"{type(exc).__name__}: {exc}"))
                    self.rows.pop(sid, None)
            return ready
        ready = []
        for k, (row, sid, st, t) in enumerate(one):
            if k in refused:  # the matcher has not moved; the request fails
                errors.append((row, t, len(st.tokens)))
                del self.rows[sid]
            else:
                st.tokens.append(t)
                ready.append((row, sid, st))
        return ready

    def _fill(self, ready: list, ended: list, errors: list, calls=None) -> tuple:
        """Fill the ready rows' masks in one call (on xgrammar's threads); the plan for a
        following "same" is the rows filled."""
        from minipaged.structured_output.batch_calls import BatchCalls
        try:
            if ready:
                calls = calls or BatchCalls([st.matcher for _, _, st in ready])
                calls.fill(self.batch, self.bitmask, [row for row, _, _ in ready])
        except Exception:  # find the row: one at a time
            kept = []
            for row, sid, st in ready:
                try:
                    st.matcher.fill_next_token_bitmask(self.bitmask, row)
                    kept.append((row, sid, st))
                except Exception as exc:  # this row alone
                    errors.append((row, None, f"{type(exc).__name__}: {exc}"))
                    self.rows.pop(sid, None)
            ready, calls = kept, None
        states = [st for _, _, st in ready]
        rows = [row for row, _, _ in ready]
        self.plan = (rows, [sid for _, sid, _ in ready], states,
                     calls or BatchCalls([st.matcher for st in states]))
        return ("filled", rows, ended, errors)


def main() -> None:
    requests = Connection(os.dup(0), writable=False)
    answers = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # stray output goes to stderr, not into the frames
    worker = None
    while True:
        try:
            message = requests.recv()
        except EOFError:  # the engine has gone
            return
        kind = message[0]
        try:
            if kind == "init":
                worker = GrammarWorker(*message[1:])
                answer = ("ready",)
            elif kind == "fill":
                answer = worker.fill(*message[1:])
            elif kind == "same":
                answer = worker.same(*message[1:])
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as exc:  # not one row's: the engine stops using this process
            answer = ("failed", f"{type(exc).__name__}: {exc}")
        answers.send(answer)


if __name__ == "__main__":
    sys.exit(main())
