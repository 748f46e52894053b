"""Requests of several sequences around the sampler: n > 1 samples and beam search (lesson 06).

The engine calls these through `GroupExtension` (extension.py), a request extension.

A group's prompt is prefilled once by one sequence. When it reaches its first sample,
`split_groups` forks it into its `n` samples (they share every block; each samples its own first
token from the same logits row). A beam search sets each beam's logits aside until every live
beam of its group has them, then `beam_step` decides the next beams (`BeamSearchState.step`,
Hugging Face's rules) and applies the decision to the KV cache: a beam nobody continues is
freed, a parent continued by m candidates is forked m - 1 times.
"""
from __future__ import annotations

import torch

from minipaged.engine.scheduler import Scheduler
from minipaged.engine.sequence import Sequence, SequenceStatus
from minipaged.groups.group import SequenceGroup
from minipaged.utils import to_device


def split_groups(logits: torch.Tensor, sampling: list[Sequence], scheduler: Scheduler):
    """Returns (logits rows to sample, the sequences they belong to, beam groups ready to step)."""
    rows: list[int] = []
    seqs: list[Sequence] = []
    ready: list[SequenceGroup] = []
    for row, seq in enumerate(sampling):
        group = seq.group
        if group is not None and group.beam is not None:
            group.beam.logits[seq.seq_id] = logits[row].clone()
            if len(group.beam.logits) == len(group.seqs):
                ready.append(group)
            continue
        rows.append(row)
        seqs.append(seq)
        if group is not None and not group.forked:  # the prompt was prefilled once: fork it
            children = [seq.fork(i) for i in range(1, group.size)]
            scheduler.fork(seq, children)  # BlockManager.fork: share every block
            group.seqs += children
            rows += [row] * len(children)
            seqs += children
    if rows != list(range(logits.shape[0])):
        logits = logits[to_device(rows, logits.device, torch.long)]  # (len(seqs), vocab)
    return logits, seqs, ready


def drop_beam_logits(preempted: list[Sequence]) -> None:
    """A beam preempted by recompute will compute its logits again."""
    for s in preempted:
        beam = s.group.beam if s.group is not None else None
        if beam is not None and s.status is SequenceStatus.WAITING:
            beam.logits.pop(s.seq_id, None)


def beam_step(group: SequenceGroup, scheduler: Scheduler) -> None:
    """One beam-search step: choose the next beams and fork / free blocks to match.
    Leaves the new beams (best first) in `group.seqs`."""
    beams = group.seqs
    logits = torch.stack([group.beam.logits.pop(s.seq_id) for s in beams])  # (beams, vocab)
    chosen = group.beam.step(beams, logits)
    by_parent: dict[int, list[int]] = {}
    for j, c in enumerate(chosen):
        by_parent.setdefault(c.parent, []).append(j)
    for i, seq in enumerate(beams):
        if i not in by_parent:
            scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)  # dropped beam
    next_beams: list[Sequence] = [None] * len(chosen)  # type: ignore[list-item]
    for i, js in by_parent.items():
        parent = beams[i]
        children = [parent.fork(group.num_created + k) for k in range(len(js) - 1)]
        group.num_created += len(children)
        scheduler.fork(parent, children)  # forks before the parent moves on
        for seq, j in zip([parent] + children, js):
            c = chosen[j]
            seq.append_token(c.token)
            seq.cumulative_logprob = c.cum_logprob
            seq.logprobs.append({c.token: c.logprob})
            next_beams[j] = seq
    group.seqs = next_beams
