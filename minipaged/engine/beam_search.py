"""Moved to minipaged/groups/beam_search.py (beam search lives with the other requests of
several sequences, groups/); this import path stays for one release."""
from minipaged.groups.beam_search import (BeamSearchOutput, BeamSearchParams,  # noqa: F401
                                          BeamSearchSequence, BeamSearchState, beam_score)
