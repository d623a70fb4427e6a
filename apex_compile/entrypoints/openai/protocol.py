"""Request and response bodies of the OpenAI-compatible API (the subset apex serves), as pydantic models.

Unknown request fields are accepted and ignored (clients send many optional ones); fields apex cannot honour
with a value other than their default (n > 1, logprobs, ...) are rejected by the server with a 400.
"""
import time
import uuid
from typing import Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields common to both endpoints."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None  # None: 1.0 (OpenAI's default); 0: greedy
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # an extension (vLLM's): 0 or -1 disables it
    seed: Optional[int] = None
    stop: Union[None, str, List[str]] = None
    ignore_eos: bool = False  # an extension: run to max_tokens whatever the model's EOS
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    user: Optional[str] = None


class ChatMessage(_Request):
    role: str
    content: Union[None, str, List[Dict]] = None


class ChatCompletionRequest(_SamplingFields):
    messages: List[ChatMessage]
    max_completion_tokens: Optional[int] = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    echo: bool = False


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Optional[str] = None
    token_ids: Optional[List[int]] = None  # the generated ids, from a server with no tokenizer (as vLLM's field)


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: List[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: List[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatCompletionStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "apex_compile"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Union[None, int, str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
