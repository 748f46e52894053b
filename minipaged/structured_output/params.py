"""The old home of `StructuredOutputsParams`, kept for one release: it now lives beside
`SamplingParams` in `minipaged/sampling/structured_outputs.py` (lesson 12), and
`from minipaged import StructuredOutputsParams` is the way to import it."""
from minipaged.sampling.structured_outputs import (KINDS, MAX_SPEC_CHARS, MAX_WHITESPACE,
                                                  StructuredOutputsParams, check_spec,
                                                  grammar_of, library_error)

__all__ = ["StructuredOutputsParams", "KINDS", "MAX_SPEC_CHARS", "MAX_WHITESPACE", "check_spec",
           "grammar_of", "library_error"]
