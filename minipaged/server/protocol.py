"""The OpenAI API's request and response bodies as pydantic models. Lesson 07 explains it.

FastAPI reads these to validate every request (a wrong type is a 400 before any engine code runs)
and to write the OpenAPI schema that `/docs` (Swagger UI) shows. Field names and defaults follow
OpenAI's API reference; the extra sampling fields vLLM accepts (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, ...) are here too, so the
`openai` client can send them with `extra_body={...}`.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # Unknown fields are accepted and ignored, as vLLM and OpenAI do (clients send fields that
    # not every server knows); the ones minipaged cannot honour are declared and checked.
    model_config = ConfigDict(extra="allow")


# --- errors ----------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# --- models ----------------------------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minipaged"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: Optional[int] = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- shared ----------------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingFields(OpenAIBaseModel):
    """Sampling fields both endpoints share (OpenAI's, then vLLM's extensions)."""

    model: Optional[str] = Field(None, description="a name from /v1/models; default: the first")
    n: int = Field(1, ge=1, le=128, description="independent samples per prompt")
    temperature: Optional[float] = Field(None, description="0 = greedy; default 1.0")
    top_p: Optional[float] = None
    seed: Optional[int] = Field(None, description="same seed, same prompt -> same output")
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = Field(None, description="not supported (400 if set)")
    # vLLM extensions (send them with the openai client's extra_body=...)
    top_k: Optional[int] = Field(None, description="vLLM extension: keep the k most likely tokens")
    min_p: Optional[float] = Field(None, description="vLLM extension: drop tokens below min_p x p_max")
    repetition_penalty: Optional[float] = Field(None, description="vLLM extension (HF's rule)")
    ignore_eos: bool = Field(False, description="vLLM extension: keep going past EOS (benchmarks)")
    min_tokens: int = Field(0, ge=0, description="vLLM extension: no EOS/stop before this many")
    stop_token_ids: Optional[list[int]] = Field(None, description="vLLM extension")
    priority: int = Field(0, description="vLLM extension: lower runs first (default 0); other "
                                         "than 0 needs a server started with --scheduling-policy "
                                         "priority")
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs (lesson 12; server/structured_outputs.py): at most one of these
    response_format: Optional[dict[str, Any]] = Field(
        None, description='{"type": "json_object"} or {"type": "json_schema", "json_schema": '
                          '{"name": ..., "schema": {...}}}')
    structured_outputs: Optional[dict[str, Any]] = Field(
        None, description="vLLM extension: one of json, regex, choice, grammar, json_object")
    guided_json: Optional[Union[str, dict[str, Any]]] = Field(None, description="vLLM extension")
    guided_regex: Optional[str] = Field(None, description="vLLM extension")
    guided_choice: Optional[list[str]] = Field(None, description="vLLM extension")
    guided_grammar: Optional[str] = Field(None, description="vLLM extension (EBNF)")


# --- /v1/completions -------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="text, a list of texts, token ids, or a list of token-id lists")
    max_tokens: Optional[int] = Field(16, description="OpenAI's default for completions is 16")
    logprobs: Optional[int] = Field(None, ge=0,
                                    description="return the top-N log-probabilities per token")
    echo: bool = Field(False, description="the prompt, then the completion: in `text`, and in "
                                          "`logprobs` (the first prompt token's is null); with "
                                          "max_tokens 0, the prompt alone")
    prompt_logprobs: Optional[int] = Field(
        None, ge=0, description="vLLM extension: the top-N log-probabilities at every prompt "
                                "token, in each choice's `prompt_logprobs` (default with echo: "
                                "logprobs)")
    suffix: Optional[str] = Field(None, description="not supported (400 if set)")
    best_of: Optional[int] = Field(None, description="only None or equal to n")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """One readable message instead of pydantic's four (one per member of the union)."""
        def token_ids(xs) -> bool:
            return all(isinstance(t, int) and not isinstance(t, bool) for t in xs)
        ok = (isinstance(value, str)
              or (isinstance(value, list) and (token_ids(value)
                                               or all(isinstance(p, str) for p in value)
                                               or all(isinstance(p, list) and token_ids(p)
                                                      for p in value))))
        if not ok:
            raise ValueError(f"must be text, a list of texts, a list of token ids (integers) or "
                             f"a list of such lists; got {str(value)[:80]}")
        return value


class CompletionLogprobs(OpenAIBaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's `Logprob`, as its completions endpoint returns prompt logprobs."""

    logprob: float
    rank: int
    decoded_token: Optional[str] = None


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    # vLLM's: per prompt token {token id: PromptLogprob}, null for the first (prompt_logprobs)
    prompt_logprobs: Optional[list[Optional[dict[int, PromptLogprob]]]] = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


# --- /v1/chat/completions --------------------------------------------------------------------
class ChatMessage(OpenAIBaseModel):
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # role "tool": which call this result answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, description="deprecated by OpenAI in favour of "
                                      "max_completion_tokens; default: up to max_model_len")
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, description="at most the server's --max-logprobs")
    tools: Optional[list[dict[str, Any]]] = Field(
        None, description='[{"type": "function", "function": {"name", "description", '
                          '"parameters"}}] (server/tool_parsers.py)')
    tool_choice: Optional[Union[str, dict[str, Any]]] = Field(
        None, description='"none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}; default "auto" with --enable-auto-tool-choice')
    parallel_tool_calls: Optional[bool] = None
    # vLLM extensions
    chat_template: Optional[str] = Field(None, description="a Jinja template for this request")
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None


# --- streaming chunks (each one a `data: {...}` server-sent event) ---------------------------
class CompletionStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Optional[UsageInfo] = None


class DeltaMessage(OpenAIBaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


# --- /tokenize and /detokenize (vLLM's extensions) -------------------------------------------
class TokenizeRequest(OpenAIBaseModel):
    """Either `prompt` (text), or chat `messages` rendered through the chat template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = Field(True, description="for `prompt`; chat templates add their own")
    add_generation_prompt: bool = True
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
