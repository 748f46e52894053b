"""The engine step with speculative decoding: propose, verify, roll back (lesson 10).

`SpecDecodeStepLoop` is the step loop (the seam in engine/step_loop.py) of an engine whose
config has a `speculative_config`, chosen once when the engine is built; it brings its own
scheduler and calls the engine's public phases. One step:

    propose        prompt lookup for every running decode (`seq.spec_token_ids`); a draft
                   model only reserves k slots here and guesses after the plan
    schedule       SpecDecodeScheduler: 1 + k tokens for a decode with proposals, slots
                   reserved up front (can_append), within the token budget
    forward        the target scores the newest token and the k proposals in one short query
                   (the chunked-prefill path); the runner returns logits at all k + 1 positions
    verify         rows without proposals sample as always (the engine's sampler, every
                   feature); speculating rows go through `verify.py` (rejection sampling; an
                   all-greedy step only compares argmaxes, and takes its greedy rows without
                   proposals along, so it reads the GPU once)
    rollback       num_computed_tokens = the accepted length: the K/V of rejected proposals
                   are garbage that the next step overwrites; blocks that hold only rejected
                   slots go back to the free queue (`BlockManager.truncate`).
                   Prefix-cache hashing only ever covers computed, accepted tokens.
    emit           accepted tokens + the bonus / corrected token, one by one through the
                   engine's stop checks, so max_tokens, stop tokens and stop strings cut the
                   step's tokens where they apply

Statistics: per request (`RequestOutput.metrics`: spec_num_draft_tokens,
spec_num_accepted_tokens), per step (`StepRecord`: proposals and acceptances by position) and
in total (`SpecDecodingStats`, vLLM's counters, served at /metrics).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minipaged.engine.output import RequestOutput
from minipaged.engine.scheduler import SchedulerOutput
from minipaged.engine.sequence import SequenceStatus
from minipaged.engine.step_loop import StepLoop
from minipaged.sampling import SamplerOutput
from minipaged.spec_decode.request_checks import check_request
from minipaged.spec_decode.ngram_proposer import NgramProposer
from minipaged.spec_decode.scheduler import SpecDecodeScheduler
from minipaged.spec_decode.verify import can_speculate, num_proposals_allowed, verify


@dataclass
class SpecDecodingStats:
    """vLLM's spec-decode counters, since the engine started."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verify steps of one sequence (with at least one proposal)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def add(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class SpecDecodeStepLoop(StepLoop):
    """The step loop of speculative decoding: its scheduler plans 1 + k tokens."""

    scheduler_cls = SpecDecodeScheduler

    def __init__(self, engine):
        super().__init__(engine)
        spec = engine.config.speculative
        self.k = spec.num_speculative_tokens
        self.method = spec.method
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                          spec.prompt_lookup_max)
        else:
            from minipaged.spec_decode.draft_proposer import DraftModelProposer
            self.proposer = DraftModelProposer(engine, spec)
        self.stats = SpecDecodingStats(self.k)
        if engine.config.use_cuda_graphs:  # verify steps replay graphs too (q = k + 1 tokens)
            self.install_verify_graphs(engine, capture=True)

    def check_request(self, request_id: str, params) -> None:
        check_request(request_id, params)  # n > 1 and beam search do not speculate yet

    def install_verify_graphs(self, engine, capture: bool) -> None:
        """Register a `VerifyGraphRunner` (spec_decode/cuda_graphs.py) in the GPU model
        runner's graph registry; `capture=False`: its padded static buffers run eagerly (the CPU
        tests)."""
        from minipaged.spec_decode.cuda_graphs import VerifyGraphRunner
        from minipaged.worker.cuda_graphs import VERIFY
        cfg, runner = engine.config, engine.model_runner
        graphs = VerifyGraphRunner(runner.model, runner.kv_cache, runner.backend,
                                   query_len=self.k + 1, max_num_seqs=cfg.max_num_seqs,
                                   max_model_len=cfg.max_model_len, block_size=cfg.block_size,
                                   device=runner.device)
        graphs.capture(graphs=capture)
        runner.cuda_graphs.register(VERIFY, graphs)

    # --- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        eng = self.engine
        t0 = time.perf_counter()
        self.propose()
        sched = eng.schedule()
        if sched.is_empty:
            return eng.finish_empty_step(sched, t0)
        spec = [s for s in sched.scheduled if s.spec_token_ids]
        if spec and self.method == "draft_model":
            self.proposer.propose(spec)  # fills the reserved proposals in place
        before = {s.seq.seq_id: s.seq.num_computed_tokens for s in spec}
        logits = eng.execute_model(sched)  # (sampling rows: 1 each, k + 1 speculating)
        if self.method == "draft_model":
            self.proposer.mirror(sched)  # the draft's cache follows the target's
        for s in sched.scheduled:  # speculating rows: only the newest token is known good yet
            s.seq.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)
            eng.block_manager.cache_full_blocks(s.seq)
        if not spec:  # a step without proposals: the engine's own sampling
            outputs, finished = eng.sample_and_process(
                logits, [s.seq for s in sched.scheduled if s.samples])
            accepted = []
        else:
            greedy = all(s.seq.sampling_params.greedy for s in spec)
            verified, starts, plain, plain_rows = self._split_rows(sched, greedy)
            outputs, finished = (eng.sample_and_process(logits[plain_rows], plain) if plain
                                 else ([], []))
            accepted = self.verify_and_emit(logits, verified, starts, outputs, finished)
        if eng.stream_outputs:
            outputs = self._last_per_request(outputs)
        outputs = eng.finish_step(sched, outputs, finished, t0)
        if spec:
            self._trace(spec, before, accepted)
        return outputs

    def propose(self) -> None:
        """Proposals for every running decode that may speculate (n-gram: the guesses; draft
        model: k placeholders that reserve the slots, guessed after the plan)."""
        eng = self.engine
        max_len = eng.config.max_model_len
        for seq in eng.scheduler.running:
            seq.spec_token_ids = []
            if seq.num_uncomputed_tokens != 1 or not can_speculate(seq):
                continue
            k = num_proposals_allowed(seq, self.k, max_len)
            if k == 0:
                continue
            if self.method == "ngram":
                seq.spec_token_ids = self.proposer.propose(seq.token_ids)[:k]
            else:
                seq.spec_token_ids = [-1] * k

    @staticmethod
    def _split_rows(sched: SchedulerOutput, greedy: bool):
        """The step's sampling rows split in two: the verified ones with the logits row each
        starts at, and the plain ones (the engine's sampler, every feature) with their rows.
        Verified: the entries with proposals and, when those are all greedy (`greedy`), the
        greedy rows without: `verify_greedy` takes the argmax the sampler would, in the same
        pass (one host read a step, not two)."""
        verified, starts, plain, plain_rows, row = [], [], [], [], 0
        for s in sched.scheduled:
            if not s.samples:
                continue
            if s.spec_token_ids or (greedy and s.seq.sampling_params.greedy
                                    and can_speculate(s.seq)):
                verified.append(s)
                starts.append(row)
            else:
                plain.append(s.seq)
                plain_rows.append(row)
            row += 1 + len(s.spec_token_ids)
        return verified, starts, plain, plain_rows

    def verify_and_emit(self, logits: torch.Tensor, entries: list, starts: list[int],
                        outputs: list[RequestOutput], finished: list[str]) -> list[int]:
        """Rejection-sample the verified rows (`starts`: each one's first row of `logits`), roll
        their caches back to what was accepted, and append the tokens through the engine's stop
        checks; returns the number of accepted proposals of each entry with proposals."""
        eng = self.engine
        bm = eng.block_manager
        tokens, accepted = verify(logits, entries, starts,
                                  eng.sampler.engine_generator(logits.device))
        for s, a in zip(entries, accepted):
            k = len(s.spec_token_ids)
            if k:
                seq = s.seq
                seq.spec_token_ids = []
                seq.num_computed_tokens += a  # rollback: the accepted proposals' K/V stay
                seq.num_draft_tokens += k
                seq.num_accepted_tokens += a
                self.stats.add(k, a)
        # Token i of every entry in one call, i = 0, 1, ...: each sequence's tokens still go
        # through the stop checks in order, and once one stops it, `process_tokens` skips the rest.
        for i in range(max(map(len, tokens))):
            rows = [(s.seq, t[i]) for s, t in zip(entries, tokens) if len(t) > i]
            eng.process_tokens([seq for seq, _ in rows],
                               SamplerOutput(token_ids=[t for _, t in rows]), outputs, finished)
        for s in entries:
            if s.spec_token_ids and s.seq.status is SequenceStatus.RUNNING:
                bm.truncate(s.seq, s.seq.num_computed_tokens)  # blocks of rejected slots only
                bm.cache_full_blocks(s.seq)  # blocks the accepted proposals filled
        return [a for s, a in zip(entries, accepted) if s.spec_token_ids]

    def _trace(self, spec: list, before: dict[int, int], accepted: list[int]) -> None:
        """This step's proposals and acceptances in its StepRecord; the verify rows' cache
        position before the step (the record was written after the rollback)."""
        if not self.engine.trace:  # max_trace_len=0 keeps none
            return
        record = self.engine.trace[-1]
        record.scheduled = [e._replace(num_computed_before=before[e.seq_id])
                            if e.seq_id in before else e for e in record.scheduled]
        for s in spec:  # a verify row recomputes nothing (it is a decode), whatever the rollback
            seq, after = s.seq, s.seq.num_computed_tokens
            if seq.recompute_until:  # what the engine's formula counted from `after`
                record.num_recomputed_tokens -= max(
                    0, min(after, seq.recompute_until) - (after - s.num_new_tokens))
        drafts, hits = [0] * self.k, [0] * self.k
        for s, a in zip(spec, accepted):
            for i in range(len(s.spec_token_ids)):
                drafts[i] += 1
                hits[i] += i < a
        record.num_draft_tokens_per_pos = drafts
        record.num_accepted_tokens_per_pos = hits

    @staticmethod
    def _last_per_request(outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Streaming: one output per request and step (the newest), in first-seen order."""
        last = {}
        for out in outputs:
            last[out.request_id] = out
        return list(last.values())
