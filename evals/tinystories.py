"""The two small evaluation tasks of docs/guides/evaluation.md, for lm-evaluation-harness.

The items are in the JSON-lines files beside this one, written in TinyStories' style for
stories260K: `tinystories_mc` (multiple choice, scored by log-likelihood: which continuation of
the story the model finds most likely) and `tinystories_gen` (generate until a stop: the story's
next word). lm-eval reads them through the tasks' `custom_dataset` (their YAML files), so they
work offline and wherever the repository is.
"""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent


def load(name: str) -> dict:
    import datasets
    return datasets.load_dataset("json", data_files={"test": str(HERE / f"{name}.jsonl")})


def load_mc(**kwargs) -> dict:
    return load("tinystories_mc")


def load_gen(**kwargs) -> dict:
    return load("tinystories_gen")
