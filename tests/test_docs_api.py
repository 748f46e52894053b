"""The Python API documents itself: `help(LLM)` and `help(EngineConfig)` list every knob with its
default and meaning, from the one declaration in config.py; the package ships `py.typed`."""
from dataclasses import fields
from pathlib import Path

import minipaged
from minipaged import LLM, EngineConfig


def test_help_lists_every_knob_with_its_default():
    for doc in (LLM.__doc__, EngineConfig.__doc__):
        for f in fields(EngineConfig):
            line = next((ln for ln in doc.splitlines() if ln.strip().startswith(f"{f.name} = ")),
                        None)
            assert line is not None, f"{f.name} missing from the docs"
            assert repr(f.default) in line and f.metadata["help"] in line


def test_py_typed_is_shipped():
    assert (Path(minipaged.__file__).parent / "py.typed").is_file()
