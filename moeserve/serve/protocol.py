"""The HTTP protocol: request and response schemas, and every error the server answers with.

Requests follow the OpenAI completions shape so existing clients work unchanged. Schemas are strict
(no "1" for 1, no true for 1, no unknown fields, no NaN) because a silently coerced field is a
request answered differently from how it was asked. Limits that depend on the model or the server's
settings (prompt tokens, max_tokens, prompts per request) are checked by the app, which knows them,
and fail with the same `ApiError` shape: `{"error": {"message", "type", "code", "param", "limit"}}`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from moeserve.errors import MoeServeError

# code -> HTTP status: the one place where a kind of failure gets its status.
STATUS: dict[str, int] = {
    "invalid_json": 400,  # the body is not JSON (or not UTF-8)
    "no_chat_template": 400,  # chat completions for a model without a chat template
    "unauthorized": 401,  # missing or wrong bearer token
    "not_found": 404,  # no such route
    "model_not_found": 404,  # `model` names a model this server does not serve
    "method_not_allowed": 405,
    "body_timeout": 408,  # the body did not arrive within the read timeout
    "conflict": 409,  # a profile started while one runs, or stopped while none does
    "body_too_large": 413,
    "too_much_work": 413,  # the request asks for more model work than --max-request-tokens
    "unsupported_media_type": 415,  # a body that is not application/json
    "invalid_value": 422,  # a field of the wrong type, out of range, unknown, missing, or past a limit
    "queue_full": 429,
    "internal_error": 500,
    "not_ready": 503,  # the model is still loading or warming up
    "shutting_down": 503,
    "unavailable": 503,  # a part of the model (an expert-parallel group on Ray) is not answering; retry
    "deadline_exceeded": 504,
}


def error_type(status: int) -> str:
    """OpenAI's error `type` for a status (clients branch on it)."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


class ApiError(MoeServeError):
    """A request the server refuses or could not finish; `code` picks the status (STATUS)."""

    def __init__(self, code: str, message: str, *, param: str | None = None, limit: Any = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code, self.message, self.param, self.limit = code, message, param, limit
        self.status = STATUS[code]
        self.headers = headers or {}

    def body(self) -> dict:
        err = {"message": self.message, "type": error_type(self.status), "code": self.code, "param": self.param}
        if self.limit is not None:
            err["limit"] = self.limit
        return {"error": err}


# ---- requests ------------------------------------------------------------------------------------
_STRICT = ConfigDict(extra="forbid", strict=True)
MAX_SEED = 2**63 - 1
MAX_CHOICES = 128  # n and best_of, as OpenAI; the server's max_inputs bounds prompts x best_of further
MAX_LOGPROBS = 20
MAX_TEMPLATE_KWARGS = 16  # chat_template_kwargs: variables a template reads are few


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions. OpenAI fields we cannot honour are accepted only at their neutral value,
    so a client that always sends them works, and one that relies on them is told."""

    model_config = _STRICT
    model: str = Field(description="the served model's id (GET /v1/models)")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, a list of texts (one choice each), token ids, or a list of token-id lists")
    max_tokens: int | None = Field(16, ge=0, description="tokens to generate at most (default 16; 0 with echo "
                                   "scores the prompt)")
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=1, description="extension: sample from the k likeliest tokens")
    stop: str | list[str] | None = Field(None, description="up to 4 strings; the text ends before the first")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="makes sampling reproducible per request; "
                             "choice i of a prompt samples with seed + i")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices per prompt, sharing the prompt's prefill")
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = Field(False, description="the prompt first in each choice's text (and its log-probabilities)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="per token: its log-probability and "
                                 "the N likeliest alternatives (the model's own, before temperature, top-k, top-p)")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices generated per prompt, of which "
                                "the n with the highest mean token log-probability are returned (not streamed)")
    presence_penalty: float = Field(0.0, ge=0, le=0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=0, le=0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(None, max_length=0)
    suffix: None = None
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool = Field(False, description="extension (as vLLM): generate max_tokens whatever the model says; "
                             "for benchmarks with fixed output lengths")


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(description="text, or a list of text parts (joined with newlines)")
    name: str | None = Field(None, max_length=256)


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions: the messages become a prompt through the model's chat template."""

    model_config = _STRICT
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0, description="default: the rest of the context")
    max_tokens: int | None = Field(None, ge=0, description="the older name of max_completion_tokens")
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")
    presence_penalty: float = Field(0.0, ge=0, le=0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=0, le=0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(None, max_length=0)
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool = Field(False, description="extension (as vLLM): generate max tokens whatever the model says")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="the chat template's reasoning_effort variable (gpt-oss's template defaults to medium)")
    chat_template_kwargs: dict[str, bool | int | float | str] | None = Field(
        None, max_length=MAX_TEMPLATE_KWARGS, description="extension (as vLLM): more variables for the chat template, "
        "as transformers' apply_chat_template(**kwargs), e.g. {\"enable_thinking\": false} for Qwen3")


class TextsRequest(BaseModel):
    """POST /v1/score and /v1/classify: one text or a list of texts."""

    model_config = _STRICT
    model: str
    input: str | list[str] = Field(description="a text or a list of texts")


class ScoreRequest(TextsRequest):
    """POST /v1/score: a text longer than the model's context is scored in rolling windows."""

    stride: int | None = Field(None, ge=1, description="for a text longer than the context: tokens each window "
                               "scores past the last (default half the context; less than the context)")


# ---- responses -----------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape; the prompt's first token (with echo) has no log-probability (null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]  # the N likeliest and the token itself
    text_offset: list[int]  # where each token's text starts in the choice's text


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ContentLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ContentLogprob]
    refusal: None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ScoreItem(BaseModel):
    index: int
    logprob: float = Field(description="natural log-probability of the text's tokens, each given those before it")
    n_tokens: int = Field(description="tokens scored (the <bos> that conditions the first is not one)")
    perplexity: float
    bits_per_byte: float
    windows: int = Field(description="context windows the text was scored in: 1 unless it is longer than the context")


class ScoreResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[ScoreItem]
    usage: Usage


class ClassifyItem(BaseModel):
    index: int
    label: int = Field(description="the most probable class")
    label_name: str | None = Field(None, description="its name, where the checkpoint names its classes")
    probs: list[float]


class ClassifyResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[ClassifyItem]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moeserve"
    task: str
    max_model_len: int
    router: str
    n_experts: int
    top_k: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str
    param: str | None = None
    limit: Any = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in sorted(set(STATUS.values()))}
