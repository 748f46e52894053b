"""Structured outputs: output that matches a JSON schema, a regex, a choice or a grammar
(lesson 12). `params.py` is the request's side, `manager.py` the engine's (masks per step)."""
from minipaged.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "StructuredOutputManager"]


def __getattr__(name):  # the manager imports the engine's Sequence: loaded when first asked for
    if name == "StructuredOutputManager":
        from minipaged.structured_output.manager import StructuredOutputManager
        return StructuredOutputManager
    raise AttributeError(name)
