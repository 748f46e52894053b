"""The request fields that ask for structured output, turned into one `StructuredOutputsParams`
(lesson 12). Both endpoints accept them:

    response_format      OpenAI's: {"type": "text" | "json_object"} or
                         {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    structured_outputs   vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json, guided_regex, guided_choice, guided_grammar
                         vLLM's older names for the same

A request sets at most one of them. A constraint that cannot be honoured (a schema the grammar
library refuses, an invalid regex, too large) is a 400 naming the field it came in, decided here
in the API server before the engine core sees the request.
"""
from __future__ import annotations

from typing import Optional

from minipaged.structured_output import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def from_response_format(rf: dict, error) -> Optional[dict]:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise error('response_format of type "json_schema" needs json_schema.schema, a JSON '
                        'schema object: {"type": "json_schema", "json_schema": {"name": "...", '
                        '"schema": {...}}}', param="response_format")
        return {"json": schema}
    raise error(f'response_format.type must be "text", "json_object" or "json_schema", got '
                f"{kind!r:.80}", param="response_format")


def request_structured_outputs(req, error) -> Optional[StructuredOutputsParams]:
    """The request's constraint, or None. `error(message, param=...)` builds the 400."""
    asked: list[tuple[str, dict]] = []  # (request field, StructuredOutputsParams fields)
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        asked.append(("structured_outputs", dict(so)))
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            asked.append((name, {kind: value}))
    rf = getattr(req, "response_format", None)
    if rf is not None:
        fields = from_response_format(rf, error)
        if fields is not None:
            asked.append(("response_format", fields))
    if not asked:
        return None
    if len(asked) > 1:
        raise error(f"set only one of {', '.join(n for n, _ in asked)}: each asks for a "
                    "structured output", param=asked[1][0])
    param, fields = asked[0]
    try:
        return StructuredOutputsParams.from_value(fields)
    except (ValueError, TypeError) as e:
        raise error(f"{param}: {e}", param=param) from None
