"""`SequenceGroup`: the sequences of one request that share its prompt (lesson 06)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minipaged.engine.sequence import Sequence


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one request that share its prompt: `n` parallel samples, or the beams of a
    beam search (vLLM's `SequenceGroup`).

    Life of a group: one sequence (`seqs[0]`) prefills the prompt, like any request. When it
    reaches its first sample the engine forks it: `size - 1` children get the same block table
    (ref counts +1, `BlockManager.fork`), and each samples its own first token. The first write
    into the shared, partly filled last block copies it (copy-on-write); the full prompt blocks
    stay shared until the last sample finishes. Beams fork again at every step (`beam_search.py`).

    The scheduler reserves `size` seats when the prompt is admitted. Forked samples are then
    independent sequences (preempted one at a time); beams are gang-scheduled: preempted,
    swapped and readmitted together, since a beam-search step needs all of them.
    """

    request_id: str
    size: int  # n samples, or the beam width
    seqs: list[Sequence]  # samples in index order; for a beam search, the live beams, best first
    beam: Optional[object] = None  # a beam search's state (beam_search.BeamSearchState)
    forked: bool = False  # the prompt's sequence has been forked into `size` sequences
    num_created: int = 1  # sequences created so far (beams get increasing indices)

    @property
    def lockstep(self) -> bool:
        """Beams must all reach a sample before any of them can move on."""
        return self.beam is not None

    @property
    def is_finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.is_finished for s in self.seqs)
