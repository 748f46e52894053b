"""n > 1 samples and beam search as a request extension (engine/extensions.py; lesson 06).

Attached to every engine (any request may ask for several sequences); while none is in flight
(`engine.groups` empty) each hook returns at once. At each point:

    prepare (add_request)   n or beam_width checked against max_num_seqs (and beams against the
                            cache); a beam search runs its sequences greedily, one token a step
    after_plan              a beam preempted by recompute computes its logits again
    rows_to_sample          a group's prompt, prefilled once, forks into its n samples when it
                            samples its first token; a beam's logits are set aside until every
                            live beam of its group has them (sampling.py)
    after_tokens            a group of n samples reports (streams, or ends with its last
                            sample); each beam search whose beams all have logits steps (HF's
                            rules, beam_search.py): forks and frees blocks to match, emits its
                            output
    abort                   every sample and beam of the request gives its blocks back
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from minipaged.engine import failures
from minipaged.engine.extensions import RequestExtension
from minipaged.engine.processor import RequestError
from minipaged.engine.sequence import Sequence, SequenceStatus
from minipaged.groups.beam_search import BeamSearchParams, BeamSearchState
from minipaged.groups.group import SequenceGroup
from minipaged.groups.sampling import beam_step, drop_beam_logits, split_groups
from minipaged.sampling import SamplingParams


def check_group_fits(request_id: str, size: int, knob: str, max_len: int, config,
                     block_manager, all_resident: bool) -> None:
    """`size` sequences (n samples, or beams) fit max_num_seqs; beams (`all_resident`) must
    also fit the KV cache together, unshared in the worst case, at `max_len` tokens each."""
    if size > config.max_num_seqs:
        raise RequestError(f"request {request_id!r}: {knob}={size} sequences cannot run at "
                           f"once with max_num_seqs={config.max_num_seqs}. Lower {knob} or raise "
                           f"max_num_seqs.")
    if all_resident:  # every beam must be in the cache at once, in the worst case unshared
        length = min(max_len, config.max_model_len)
        need = size * block_manager.num_blocks_for(length)
        if need > block_manager.num_blocks:
            raise RequestError(
                f"request {request_id!r}: {knob}={size} beams of up to {length} tokens may need "
                f"{need} KV blocks at once (if they share nothing), but the cache has "
                f"{block_manager.num_blocks}. Lower {knob} or max_tokens, or give the cache more "
                f"blocks.")


class GroupExtension(RequestExtension):
    def __init__(self, engine):
        self.groups: dict[str, SequenceGroup] = engine.groups  # the engine's, by request id
        self.scheduler = engine.scheduler
        self.ready_beams: list[SequenceGroup] = []  # beam searches to step after this sample

    def prepare(self, engine, request_id: str, params, num_prompt_tokens: int
                ) -> tuple[SamplingParams, Optional[Callable[[Sequence], None]]]:
        """Called by add_request once the prompt is read: (the params its sequences sample
        with, a function that makes the new sequence its group's first, or None for one
        sequence). Raises RequestError for a group that cannot run."""
        cfg, bm = engine.config, engine.block_manager
        if isinstance(params, BeamSearchParams):
            check_group_fits(request_id, params.beam_width, "beam_width",
                             num_prompt_tokens + params.max_tokens, cfg, bm, all_resident=True)
            beam = BeamSearchState(params, engine.eos_token_ids, num_prompt_tokens,
                                   cfg.max_model_len)
            size = params.beam_width
            params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens,
                                    ignore_eos=params.ignore_eos)
        else:
            beam, size = None, params.n
            if size == 1:
                return params, None
            check_group_fits(request_id, size, "n", 0, cfg, bm, all_resident=False)

        def start(seq: Sequence) -> None:
            seq.group = self.groups[request_id] = SequenceGroup(request_id, size, [seq], beam=beam)
            if beam is not None:
                seq.logprobs = []
        return params, start

    def after_plan(self, engine, sched) -> None:
        if self.groups and sched.preempted:
            drop_beam_logits(sched.preempted)

    def rows_to_sample(self, engine, logits: torch.Tensor, seqs: list[Sequence]):
        if not self.groups:
            return logits, seqs
        logits, seqs, self.ready_beams = split_groups(logits, seqs, engine.scheduler)
        return logits, seqs

    def after_tokens(self, engine, seqs: list[Sequence], outputs: list,
                     finished: list[str]) -> None:
        if self.groups:
            self.report_samples(engine, seqs, outputs, finished)
        if not self.ready_beams:
            return
        ready, self.ready_beams = self.ready_beams, []
        for group in ready:
            try:
                outputs += self.step_beams(engine, group, finished)
            except Exception as exc:  # this request's fault: it fails alone
                failures.fail_request(engine, engine.requests[group.request_id], exc, outputs,
                                      finished)

    def report_samples(self, engine, seqs: list[Sequence], outputs: list,
                       finished: list[str]) -> None:
        """The output of each group of n samples that got a token: the request's last once its
        last sample has finished, else (streaming) what it has so far."""
        touched = {s.request_id: s.group for s in seqs if s.group is not None}
        out = engine.output_processor
        for rid, group in touched.items():
            if rid not in engine.requests:  # it failed this step
                continue
            try:
                if group.is_finished:
                    outputs.append(out.make_group_output(group, None))
                    engine.requests.pop(rid, None)
                    self.groups.pop(rid, None)
                    finished.append(rid)
                elif engine.stream_outputs:
                    outputs.append(out.make_group_output(group, None))
            except Exception as exc:
                failures.fail_request(engine, group.seqs[0], exc, outputs, finished)

    def step_beams(self, engine, group: SequenceGroup, finished: list[str]) -> list:
        """One beam-search step of `group`; its output when it ends (or streams)."""
        beam_step(group, engine.scheduler)
        now = time.time()
        root = engine.requests.get(group.request_id)
        if root is not None and root.first_token_time is None:
            root.first_token_time = now
        out = engine.output_processor
        if not group.beam.done:
            return [out.make_group_output(group, root)] if engine.stream_outputs else []
        if root is not None:
            root.finished_time = now
        output = out.make_group_output(group, root)
        finished.append(group.request_id)
        engine.requests.pop(group.request_id, None)
        self.groups.pop(group.request_id, None)
        group.seqs = []
        return [output]

    def abort(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        for s in group.seqs if group is not None else []:
            if not s.is_finished:  # every sample / beam gives its blocks back
                self.scheduler.finish(s, SequenceStatus.FINISHED_ABORTED)
