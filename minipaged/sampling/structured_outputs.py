"""`StructuredOutputsParams`: what a request's output must match (vLLM's names), checked at entry
(lesson 12). It is a field of `SamplingParams` (params.py), so it lives beside it, as in vLLM;
the engine's side of structured outputs is `minipaged/structured_output/`.

Exactly one of:

    json=SCHEMA          a JSON schema (a dict, or its JSON text): the output is one JSON value
                         that validates against it
    regex="..."          the whole output matches the regular expression
    choice=[...]         the output is one of these strings
    grammar="..."        an EBNF grammar (xgrammar's GBNF dialect: `root ::= ...`)
    json_object=True     any JSON object (OpenAI's `response_format={"type": "json_object"}`)

`validate` parses the spec with the grammar library (no tokenizer needed yet), so a schema it
cannot compile or an invalid regex is a `ValueError` that starts with `structured_outputs.FIELD`,
raised where the request enters (`SamplingParams(...)`, the server's request handler), never in
the engine's step. The engine compiles it against its tokenizer's vocabulary when the request is
added, off its own thread (structured_output/: `compiling.py`, `manager.py`).
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, fields
from typing import Any, Optional

MAX_SPEC_CHARS = 64 * 1024  # a grammar, regex or schema text longer than this is refused
# Free whitespace between JSON tokens, at most this many characters in a row: a model that
# knows no JSON (stories260K) otherwise fills max_tokens with newlines inside "{ }".
MAX_WHITESPACE = 4
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: Optional[Any] = None  # dict or JSON text
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False  # JSON: no free whitespace between tokens (vLLM's name)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        for k in KINDS:
            if getattr(self, k) not in (None, False):
                return k
        raise AssertionError("validate() guarantees one kind")

    @property
    def spec(self) -> str:
        """The constraint as one string (the compile cache's key with `kind`)."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else json.dumps(self.json,
                                                                            sort_keys=True)
        if kind == "choice":
            return json.dumps(self.choice, ensure_ascii=False)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    def validate(self) -> None:
        name = "structured_outputs"
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"{name} must set exactly one of {', '.join(KINDS)}, got "
                             f"{set_kinds or 'none'}")
        kind = set_kinds[0]
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"{name}.disable_any_whitespace must be True or False, got "
                             f"{self.disable_any_whitespace!r}")
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"{name}.json must be a JSON schema (an object), but its "
                                     f"text is not JSON: {e}") from None
            else:
                parsed = value
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"{name}.json must be a JSON schema (an object), got "
                                 f"{type(parsed).__name__}")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}.{kind} must be a non-empty string, got {value!r:.80}")
        elif kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise ValueError(f"{name}.choice must be a non-empty list of non-empty strings, "
                                 f"got {value!r:.80}")
            self.choice = list(value)
        elif kind == "json_object" and value is not True:
            raise ValueError(f"{name}.json_object must be True (or unset), got {value!r}")
        spec = self.spec
        if len(spec) > MAX_SPEC_CHARS:
            raise ValueError(f"{name}.{kind} is too large: {len(spec)} characters, the limit is "
                             f"{MAX_SPEC_CHARS}")
        check_spec(self)

    @classmethod
    def from_value(cls, value) -> "StructuredOutputsParams":
        """A `StructuredOutputsParams`, or the dict of its fields (how it crosses to the engine
        core, and how the server's `structured_outputs` field arrives)."""
        if isinstance(value, cls):
            value.validate()
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {unknown}; it takes "
                                 f"{', '.join(sorted(known))}")
            return cls(**value)
        raise ValueError(f"structured_outputs must be None, StructuredOutputsParams or a dict of "
                         f"its fields, got {value!r:.80}")


_LOCATION = re.compile(r"^\[[\d:]+\] \S+\.cc:\d+: (Check failed: \(error\.empty\(\)\) is false: )?")


def library_error(exc: BaseException) -> str:
    """xgrammar's message without the C++ file and line it starts with."""
    return _LOCATION.sub("", str(exc).strip()).strip()


def grammar_of(p: StructuredOutputsParams):
    """The tokenizer-independent `xgrammar.Grammar` of a constraint; raises what xgrammar raises."""
    return _grammar(p.kind, p.spec, p.disable_any_whitespace)


def _grammar(kind: str, spec: str, disable_any_whitespace: bool):
    import xgrammar as xgr
    if kind in ("json", "json_object"):  # json_object: OpenAI's "any JSON object"
        schema = spec if kind == "json" else '{"type": "object"}'
        return xgr.Grammar.from_json_schema(schema, any_whitespace=not disable_any_whitespace,
                                            max_whitespace_cnt=MAX_WHITESPACE)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":  # root ::= "a" | "b" (JSON string escapes are EBNF's too)
        return xgr.Grammar.from_ebnf(
            "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec)))
    return xgr.Grammar.from_ebnf(spec)


def check_spec(p: StructuredOutputsParams) -> None:
    """Parse the constraint once; a spec xgrammar refuses is a ValueError naming the field."""
    try:
        error = _spec_error(p.kind, p.spec, p.disable_any_whitespace)
    except Exception as e:  # anything else the parse raised (not remembered)
        error = library_error(e)
    if error is not None:
        raise ValueError(f"structured_outputs.{p.kind} is not valid: {error}")


@functools.lru_cache(maxsize=64)  # (at most 64 specs of MAX_SPEC_CHARS characters each)
def _spec_error(kind: str, spec: str, disable_any_whitespace: bool) -> Optional[str]:
    """xgrammar's message if it refuses the constraint, else None. Remembered for the last 64
    specs: requests mostly repeat a few schemas, a request is validated twice (when its
    `SamplingParams` is made and when the engine adds it), and parsing a large schema takes
    0.2-0.3 ms, which at 64 new requests a step is a good part of a step. Only the parser's
    refusals are remembered; any other exception (out of memory, say) propagates."""
    try:
        _grammar(kind, spec, disable_any_whitespace)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parser: RuntimeError
        return library_error(e)
    return None
