"""OpenAI / vLLM request and response shapes. No torch: this module lives in the HTTP process.

Requests are pydantic models; responses are built as plain dicts in OpenAI's exact layout. A field OpenAI
or vLLM defines that this server does not implement is refused (400 naming it), never accepted and ignored:
a client relying on it would get a wrong answer without knowing — unless it is sent with its "off" value
(null, false, [] or {}), as many SDKs send them. Fields neither defines are accepted (clients send extras),
as are those that cannot change an answer (`user` is logged; `store`, `metadata`, ...). A value of the
wrong JSON type is refused, never coerced, and so is text that is not valid Unicode (RequestModel).
"""
from __future__ import annotations

import base64
import dataclasses
import json
import struct
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from loramux.sampling_params import SamplingParams, StructuredOutputsParams, choice_seed, shorten
from loramux.server.http import tools

NOT_IMPLEMENTED = frozenset({
    # OpenAI
    "suffix", "functions", "function_call", "modalities", "audio", "prediction", "reasoning_effort", "verbosity",
    "web_search_options",
    # vLLM extras
    "use_beam_search", "length_penalty", "include_stop_str_in_output", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "allowed_token_ids", "guided_decoding_backend", "guided_whitespace_pattern",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "documents", "echo",
    "return_tokens_as_token_ids", "return_token_ids", "add_special_tokens", "logits_processors", "structural_tag",
    "prompt_embeds", "mm_processor_kwargs", "vllm_xargs", "kv_transfer_params",
    "max_completion_tokens",  # chat's field; /v1/completions has max_tokens (a chat request declares it)
})
"""Fields that would change the answer, which loramux does not implement: refused by name unless "off"."""
OURS = {"add_generation_prompt": True, "spaces_between_special_tokens": True, "length_penalty": 1.0}
"""Values of NOT_IMPLEMENTED fields that ask for what loramux does anyway (vLLM's defaults): accepted."""


def _matches_ours(name: str, value, chat: bool) -> bool:
    if name == "add_special_tokens":  # vLLM's defaults: on for completions (as loramux), off for chat templates
        return value is (not chat)
    if name in OURS:
        return value == OURS[name] and isinstance(value, bool) == isinstance(OURS[name], bool)
    return _is_off(value)


def _is_off(value) -> bool:
    return value is None or value is False or value == [] or value == {}


class RequestModel(BaseModel):
    """Every request body. Types are strict, as OpenAI's schema writes them: a string or a boolean is not a
    number ("5", true), nor a number a boolean (1), nor 2.0 an integer, as pydantic would otherwise coerce
    them; an integer is taken where a number is (temperature 1, as OpenAI does). Every string in the body,
    keys included, must be valid Unicode: checked here once, so that no field is forgotten."""

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        problem = lone_surrogate(data)
        if problem:
            raise ValueError(problem)
        return data


def lone_surrogate(data) -> str | None:
    """Where parsed JSON holds a lone surrogate ("\\ud800" is valid JSON, but no text: encoding it failed deep
    inside, a 500), as an error message naming the field; None if nowhere."""
    try:  # the common case, at C speed: all the text encodes
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return None
    except (UnicodeEncodeError, TypeError, ValueError, RecursionError):  # or not JSON (a caller's objects), or deep
        return _find_surrogate(data)


def _find_surrogate(data) -> str | None:
    """lone_surrogate's walk, iterative: deep nesting cannot exhaust the stack."""
    stack = [(data, None)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            at = _surrogate_at(value)
            if at is not None:
                return f"{_path(where)} is not valid Unicode: a lone surrogate at position {at}"
        elif isinstance(value, dict):
            for key in value:
                at = _surrogate_at(key) if isinstance(key, str) else None
                if at is not None:
                    return (f"the key {shorten(ascii(key))} in {_path(where)} is not valid Unicode: a lone "
                            f"surrogate at position {at}")
            stack.extend((item, (where, key)) for key, item in value.items() if isinstance(item, _TEXTUAL))
        elif isinstance(value, (list, tuple)):  # numbers are not stacked: a prompt may hold a million token ids
            stack.extend((item, (where, i)) for i, item in enumerate(value) if isinstance(item, _TEXTUAL))
    return None


_TEXTUAL = (str, dict, list, tuple)


def _surrogate_at(text: str) -> int | None:
    if text.isascii():  # the common case, without an encoding
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _path(where) -> str:
    """A field's path from lone_surrogate's (parent, key) links: messages[0].content."""
    parts = []
    while where is not None:
        where, key = where
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    path = "".join(reversed(parts)).lstrip(".")
    return shorten(path, 120) if path else "the request body"


class GenerationRequest(RequestModel):
    """Fields both generation endpoints take. Types are checked here; ranges by SamplingParams (one place)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
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
    repetition_penalty: float | None = None  # vLLM's extra fields from here
    min_p: float | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: {"token id": bias}
    best_of: int | None = None  # accepted when it equals n (the same request); more is not implemented
    user: str | None = None  # logged with the request; picks its target when `model` is a weighted alias
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's extra field: logprobs of the prompt tokens (top N each)
    cache_salt: str | None = None  # vLLM's: the prefix cache shared only with requests of the same salt
    priority: int = 0  # vLLM's: lower first, with --scheduling-policy priority (else only 0)
    # a weighted combination of adapters ({name: weight}; `model` names the base model): PEFT's cat combination
    adapters: dict[str, float] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI's schema lets most fields be null, meaning "the default"; pydantic would refuse a null bool."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _no_unsupported_fields(self):
        chat = isinstance(self, ChatCompletionRequest)
        extra = sorted(k for k, v in (self.model_extra or {}).items()
                       if k in NOT_IMPLEMENTED and not _matches_ours(k, v, chat))
        if self.best_of is not None and self.best_of != self.n:
            extra.append("best_of (other than n)")
        options = {k for k, v in (self.stream_options or {}).items() if not _is_off(v)}
        extra += sorted(f"stream_options.{k}" for k in options - {"include_usage"})  # continuous_usage_stats, ...
        if options and not self.stream:  # as vLLM
            raise ValueError("stream_options can only be set when stream is true")
        _refuse(extra)
        return self

    @model_validator(mode="after")
    def _include_usage_is_a_boolean(self):
        usage = (self.stream_options or {}).get("include_usage")
        if not (usage is None or isinstance(usage, bool)):  # stream_options is a free dict: "no" or 1 read as true
            raise ValueError("stream_options.include_usage must be true, false or null")
        return self

    def logprob_count(self) -> int | None:
        """Top alternatives per generated token (None: no logprobs)."""
        return None

    def structured(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint the request sets (ValueError: several, or a malformed one)."""
        found = {name: spec for name, spec in self._structured_sources() if spec is not None}
        if len(found) > 1:
            raise ValueError(f"set one structured output at most; this request sets {', '.join(found)}")
        return next(iter(found.values()), None)

    def _structured_sources(self):
        yield "response_format", _response_format(self.response_format)
        if self.structured_outputs is not None:
            fields = {k: v for k, v in self.structured_outputs.items() if not _is_off(v)}
            unknown = set(fields) - {"json", "regex", "choice", "grammar", "json_object"}
            if unknown:
                raise ValueError(f"structured_outputs: unsupported key(s) {', '.join(sorted(unknown))}")
            if not isinstance(fields.get("choice", []), list):
                raise ValueError("structured_outputs.choice must be a list of strings")
            yield "structured_outputs", StructuredOutputsParams(**fields) if fields else None
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            yield name, None if value is None else StructuredOutputsParams(**{key: value})

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def max_tokens_for(self) -> int | None:
        """The request's max_tokens; None = up to the model's length (chat without one)."""
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
            skip_special_tokens=self.skip_special_tokens,
            logprobs=self.logprob_count(),
            prompt_logprobs=self.prompt_logprobs,
            structured_outputs=self.structured(),
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens,
            bad_words=tuple(self.bad_words or ()),
            logit_bias=self.logit_bias or None,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            cache_salt=self.cache_salt,
            priority=self.priority,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


def _refuse(unsupported: list[str]) -> None:
    if unsupported:
        raise ValueError(f"unsupported field(s): {', '.join(unsupported)}. loramux does not implement "
                         f"{'them' if len(unsupported) > 1 else 'it'} and refuses rather than ignores a field "
                         "that changes the answer")


def _response_format(fmt: dict | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
    "schema", "strict"}}. The schema is enforced as written whether or not `strict` is set."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return StructuredOutputsParams(json=json.dumps(spec["schema"]))
    raise ValueError(f"response_format type must be text, json_object or json_schema, got {fmt.get('type')!r}")


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # top N alternatives per token (0: the chosen token's logprob alone)
    echo: bool = False  # the prompt is returned before the completion (with its logprobs, when asked)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def sampling_params(self, max_tokens: int, seed_offset: int = 0) -> SamplingParams:
        """echo with logprobs scores the prompt too: the prompt logprobs it needs are asked for here (as many
        alternatives as logprobs or prompt_logprobs asks, whichever is more; each answer shows its own count)."""
        params = super().sampling_params(max_tokens, seed_offset)
        if self.echo and self.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=max(self.logprobs, params.prompt_logprobs or 0))
        return params

    def prompts(self) -> list:
        return prompt_list(self.prompt, "prompt")


def prompt_list(value, field: str) -> list:
    """The prompts a field holds: one string or token-id list, or a list of them (each checked by the
    InputProcessor)."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    if not value:
        raise ValueError(f"{field} must not be empty")
    return list(value)


class EmbeddingRequest(RequestModel):
    """/v1/embeddings: OpenAI's fields, and vLLM-style extras for how the hidden states are pooled. Any other field
    is a 400 naming it."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # honoured only as the model's own size: these embeddings cannot be shortened
    user: str | None = None
    pooling: Literal["last", "mean"] = "last"  # the last token's hidden state (vLLM's for decoder models), or the mean
    normalize: bool = True  # scaled to unit length, as vLLM's pooling does by default
    cache_salt: str | None = None  # vLLM's: the prefix cache shared only with requests of the same salt

    def prompts(self) -> list:
        return prompt_list(self.input, "input")


def embedding_list(model: str, vectors: list[list[float]], encoding: str, prompt_tokens: int) -> dict:
    """OpenAI's embeddings response; base64: each vector's float32 bytes, little-endian, as OpenAI sends them."""
    def encoded(vector):
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() if encoding == "base64" else vector

    data = [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


class ChatCompletionRequest(GenerationRequest):
    messages: list = Field(min_length=1)  # each message is checked by the InputProcessor (one place for both APIs)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    _tool_mode: str = PrivateAttr("none")  # set by check_tools: "none" | "auto" | "required" | "named"

    def check_tools(self, parser: str | None) -> str:
        """Checks tools and tool_choice against the server's tool-call parser; returns the mode (ValueError)."""
        self._tool_mode = tools.check_tools(self.tools or [], self.tool_choice, self.parallel_tool_calls, parser)
        return self._tool_mode

    @property
    def tool_mode(self) -> str:
        return self._tool_mode

    def _structured_sources(self):
        yield from super()._structured_sources()
        yield "tool_choice", tools.tool_grammar(self.tools or [], self._tool_mode, self.tool_choice,
                                                self.parallel_tool_calls)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.stream and self.prompt_logprobs is not None:  # as vLLM: a chat stream has no place for them
            raise ValueError("prompt_logprobs are not available when stream is true on /v1/chat/completions")
        return self

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_tokens_for(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


TOKENIZE_NOT_IMPLEMENTED = frozenset({"continue_final_message", "chat_template", "chat_template_kwargs",
                                      "mm_processor_kwargs"})
"""vLLM's /tokenize fields loramux does not implement: refused by name unless "off", as NOT_IMPLEMENTED."""


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: `prompt` (completions) or `messages` (chat, through the chat template)."""

    model_config = ConfigDict(extra="allow")

    model: str
    prompt: str | None = None
    messages: list | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self

    @model_validator(mode="after")
    def _no_unsupported_fields(self):
        _refuse(sorted(k for k, v in (self.model_extra or {}).items() if k in TOKENIZE_NOT_IMPLEMENTED
                       and not _is_off(v)))
        return self


class DetokenizeRequest(RequestModel):
    model: str
    tokens: list[int]


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False  # as SGLang: never evicted from host memory or its device slot until unpinned or unloaded
    load_inplace: bool = False  # as vLLM: replace a loaded adapter's weights; running requests finish on the old


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class PinLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1)


class LoRAAliasRequest(RequestModel):
    """POST /v1/lora_aliases: `name`'s requests go to `targets` (adapters or name@rev) in the shares of their
    weights (server/http/aliases.py)."""

    name: str = Field(min_length=1)
    targets: dict[str, float]


def alias_card(name: str, targets) -> dict:
    return {"name": name, "targets": dict(targets)}


def error_body(message: str, err_type: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error layout, which the openai client turns into its typed exceptions."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens read from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_response(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                        cached_tokens: int = 0) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None,
                      prompt_logprobs: list | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def completion_chunk(rid: str, model: str, choice: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}


def chat_response(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                  cached_tokens: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def chat_choice(index: int, text: str | None, finish_reason: str | None, logprobs: list | None = None,
                tool_calls: list | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish_reason}


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish_reason: str | None,
               logprobs: list | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs},
                         "finish_reason": finish_reason}]}


def model_list(base: dict | None, cards: list[dict]) -> dict:
    """/v1/models: the base model's card (None: not shown), then the adapters' cards."""
    return {"object": "list", "data": ([base] if base is not None else []) + cards}


def adapter_cards(name: str, path: str, base_name: str, revisions=()) -> list[dict]:
    """An adapter's card (its parent: the base model), then one per earlier revision it keeps, name@rev, whose
    parent is the name (vLLM's card fields; root: where the name loads from now)."""
    return [model_card(name, path, base_name)] + [model_card(revision, path, name) for revision in revisions]


def model_card(name: str, root: str, parent: str | None, max_model_len: int | None = None) -> dict:
    card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "loramux", "root": root,
            "parent": parent, "permission": []}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card
