"""OpenAI / vLLM request and response shapes. No torch: this module lives in the HTTP process.

Requests are pydantic models (extra fields are accepted and ignored, as OpenAI does for unknown ones
clients commonly send); responses are built as plain dicts in OpenAI's exact layout.
"""
from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field

from loramux.sampling_params import SamplingParams, choice_seed


class GenerationRequest(BaseModel):
    """Fields both generation endpoints take. Types are checked here; ranges by SamplingParams (one place)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def max_tokens_for(self, chat: bool) -> int | None:
        """The request's max_tokens; None = up to the model's length (chat without one)."""
        if chat:
            return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default, also for an explicit null

    def sampling_params(self, max_tokens: int, seed_offset: int = 0) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=choice_seed(self.seed, seed_offset),
            stop=tuple(self.stop_list()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]

    def prompts(self) -> list:
        """The prompts: one string or token-id list, or a list of them (each checked by the InputProcessor)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        return list(p)


class ChatCompletionRequest(GenerationRequest):
    messages: list = Field(min_length=1)  # each message is checked by the InputProcessor (one place for both APIs)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False  # as SGLang: never evicted from host memory or its device slot until unpinned or unloaded
    load_inplace: bool = False  # as vLLM: replace a loaded adapter's weights; running requests finish on the old


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class PinLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)


def error_body(message: str, err_type: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error layout, which the openai client turns into its typed exceptions."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def completion_chunk(rid: str, model: str, choice: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}


def chat_response(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def chat_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish_reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def model_card(name: str, root: str, parent: str | None, max_model_len: int | None = None) -> dict:
    card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "loramux", "root": root,
            "parent": parent, "permission": []}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card
