"""Requests of several sequences: n > 1 samples and beam search (lesson 06).

    scheduling.py   GroupScheduling: seats reserved for forks, beams preempted and readmitted
                    as one gang (a scheduler mixin, engine/build.py composes it in)
    engine/groups.py, engine/beam_search.py   forking around the sampler, the beam-search step
"""
