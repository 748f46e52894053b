"""Requests of several sequences: n > 1 samples and beam search (lesson 06).

    extension.py     GroupExtension: the request extension the engine calls (a request's
                     group started, forks before sampling, beam steps after it)
    sampling.py      forking a prompt into its samples, setting beams' logits aside, a beam step
    beam_search.py   BeamSearchParams and Hugging Face's beam-search rules (`LLM.beam_search`)
    scheduling.py    GroupScheduling: seats reserved for forks, beams preempted and readmitted
                     as one gang (a scheduler mixin, engine/build.py composes it in)
"""
