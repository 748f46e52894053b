"""Structured outputs: output that matches a JSON schema, a regex, a choice or a grammar
(lesson 12). The request's side, `StructuredOutputsParams`, lives beside `SamplingParams` in
sampling/structured_outputs.py (as in vLLM; `params.py` here re-exports it for one release);
`manager.py` is the engine's (masks per step)."""
from minipaged.sampling.structured_outputs import StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "StructuredOutputManager"]


def __getattr__(name):  # the manager imports the engine's Sequence: loaded when first asked for
    if name == "StructuredOutputManager":
        from minipaged.structured_output.manager import StructuredOutputManager
        return StructuredOutputManager
    raise AttributeError(name)
