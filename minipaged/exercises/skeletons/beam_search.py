"""Stage 11, `beam_search` (lesson 06): one beam-search step, by Hugging Face's rules.

Write `BeamSearchState.step` (minipaged/groups/beam_search.py: choose the next beams) and
`beam_step` (minipaged/groups/sampling.py: apply the choice to the sequences and their blocks).
While the grader runs, yours replace the real ones, and `LLM.beam_search` runs on them; the
graders compare its beams and scores with Hugging Face's `generate(num_beams=k)`, token for
token. Grade them with

    minipaged exercise check beam_search

Needs from stage 10 (fork): `scheduler.fork(parent, children)` (the children share the
parent's blocks and run) and `seq.fork(index)`; and `scheduler.finish(seq, status)` frees a
dropped beam's blocks. The rules are in the module docstring of beam_search.py (read its
numbered steps 1 to 4 first); `Hypothesis` and `Candidate` are the dataclasses to return.
`self.params` holds beam_width, length_penalty, early_stopping and ignore_eos;
`self.max_new_tokens`, `self.eos_token_ids`, `self.finished` (best first) and `self.done` are
the search's state. Scores are float32 tensors, added and divided in HF's order.
"""
from __future__ import annotations

import torch

from minipaged.engine.scheduler import Scheduler
from minipaged.engine.sequence import Sequence, SequenceStatus  # noqa: F401
from minipaged.groups.beam_search import Candidate, Hypothesis  # noqa: F401
from minipaged.groups.group import SequenceGroup
from minipaged.sampling import Logprob  # noqa: F401


def step(self, beams: list["Sequence"], logits: torch.Tensor) -> list[Candidate]:
    """`logits`: (len(beams), vocab), row i for `beams[i]`. Returns the next step's beams
    (best first) and updates `finished` and `done`."""
    # log_softmax each row and add its beam's cumulative logprob; the best K = max(2, 1 +
    # number of EOS ids) * width candidates over all beams (topk of the flattened scores:
    # parent = index // vocab, token = index % vocab); each candidate's own logprob and rank.
    # A candidate stops at EOS (unless ignore_eos) or at max_new_tokens. Stopping candidates
    # among the best `width` become Hypothesis entries scored cum / gen_len ** length_penalty
    # (keep the best `width`, stable sort); the first `width` that go on are the next beams.
    # Done when none goes on, or `width` are finished and early_stopping is True or the best
    # live beam cannot beat the worst finished one (HF's heuristic, see the module docstring).
    raise NotImplementedError("exercise: write BeamSearchState.step")


def beam_step(group: SequenceGroup, scheduler: Scheduler) -> None:
    """One beam-search step: choose the next beams and fork / free blocks to match.
    Leaves the new beams (best first) in `group.seqs`."""
    # The beams' logits wait in group.beam.logits (seq_id -> row): stack them in beam order
    # and take the step. Beams no candidate continues finish as FINISHED_ABORTED. A parent
    # chosen by m candidates is forked m - 1 times (indices from group.num_created on, before
    # it moves on); each of them appends its candidate's token and takes its cum_logprob and
    # logprob. group.seqs becomes the chosen, in the candidates' order.
    raise NotImplementedError("exercise: write beam_step")
