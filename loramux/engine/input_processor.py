"""InputProcessor: prompts and chat messages -> checked token ids. No torch.

This is the one place a request's input is validated, with one message per cause: the offline LLM calls
it, and so does the HTTP front end (in its own process, with the limits the engine reported). The engine
behind it only asserts what it was promised.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from loramux.config import GrammarLimits
from loramux.engine import grammar
from loramux.sampling_params import SamplingParams, shorten
from loramux.tokenizer import CHAT_ROLES, Tokenizer


@dataclass(frozen=True)
class EngineLimits:
    """What one request may hold, as the running engine computed them."""

    max_model_len: int
    """Prompt + generated tokens at most."""
    vocab_size: int
    """Prompt token ids must be below this."""
    grammar: GrammarLimits = GrammarLimits()
    """What a structured output may be."""
    priority_scheduling: bool = False
    """Whether a request's priority orders it (EngineConfig.scheduling_policy "priority"); else it must be 0."""


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, limits: EngineLimits):
        self.tokenizer = tokenizer
        self.limits = limits

    # ---- prompts ---------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A text prompt's token ids, or a list of token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(_text(prompt, "the prompt"))
        else:
            ids = list(prompt)
            vocab = self.limits.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def chat_ids(self, messages: Sequence, add_generation_prompt: bool = True, tools: list | None = None) -> list[int]:
        """The token ids of a conversation through the model's chat template (messages checked first); tools
        (OpenAI's function specs) are the template's `tools` variable."""
        conversation = [_message(m, i) for i, m in enumerate(_list(messages, "messages"))]
        if not conversation:
            raise ValueError("messages must hold at least one message")
        try:
            extra = {"tools": tools} if tools else {}
            return self.tokenizer.apply_chat_template(conversation, add_generation_prompt, **extra)
        except (TypeError, ValueError, LookupError) as e:
            raise ValueError(f"the chat template could not render these messages: {shorten(str(e), 300)}"
                             f"{_tool_hint(conversation)}") from e
        except Exception as e:  # jinja2's TemplateError (raise_exception in a template), sandbox errors, ...
            raise ValueError(f"the chat template refused these messages: {type(e).__name__}: "
                             f"{shorten(str(e), 300)}{_tool_hint(conversation)}") from e

    # ---- lengths ---------------------------------------------------------------------------------
    def check_length(self, prompt_len: int, params: SamplingParams, strict: bool) -> None:
        """Whether a prompt and its max_tokens fit. strict (the HTTP API, as vLLM): prompt + max_tokens must
        fit max_model_len; otherwise (offline) generation just ends there, with finish_reason "length"."""
        limit = self.limits.max_model_len
        if prompt_len >= limit:
            raise ValueError(f"the prompt has {prompt_len} tokens; this model's maximum context length is {limit} "
                             "tokens, which leaves no room for a new token")
        if strict and prompt_len + params.max_tokens > limit:
            raise ValueError(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, {params.max_tokens} "
                             "in the completion).")
        # Nothing else to check: the engine sizes its prefill budget and its KV cache for one max_model_len
        # request, so whatever passes here fits an otherwise empty engine.

    # ---- what SamplingParams cannot check alone -------------------------------------------------------
    def check_params(self, params: SamplingParams) -> None:
        """logit_bias and stop token ids inside the vocabulary (ValueError naming the problem). A structured
        output is checked apart: in-process offline (check_structured), in a worker process by the server."""
        vocab = self.limits.vocab_size
        if params.logit_bias and not all(k < vocab for k in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab}")
        if not all(t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}")
        if params.priority != 0 and not self.limits.priority_scheduling:
            raise ValueError("priority other than 0 needs the priority scheduling policy (--scheduling-policy "
                             "priority, as vLLM's); this engine serves first come, first served")

    def check_structured(self, params: SamplingParams) -> None:
        """A structured output's schema, regex, choices or grammar valid and within the limits."""
        if params.structured_outputs is not None:
            grammar.check(params.structured_outputs, self.limits.grammar)

    def max_tokens_left(self, prompt_len: int) -> int:
        """max_tokens when a chat request gives none: up to the model's length."""
        return max(1, self.limits.max_model_len - prompt_len)


def _list(value, what: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} must be a list, got {type(value).__name__}")
    return list(value)


def _text(value: str, what: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800") is valid JSON but no text
        raise ValueError(f"{what} is not valid Unicode text ({e.reason} at position {e.start})") from e
    return value


def _message(message, index: int) -> dict:
    """One chat message, normalized for the chat template as vLLM does it: OpenAI's list-of-parts content
    becomes one string (text parts joined with newlines, for text-only models), an assistant's null or
    absent content "" (the openai SDK sends its tool-call messages back so; templates concatenate content),
    and tool calls' arguments objects. Anything else a text model cannot take is refused."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {shorten(repr(role))}")
    if "content" not in message and not (role == "assistant" and message.get("tool_calls")):
        raise ValueError(f"{where} has no 'content'")
    for key in ("name", "tool_call_id"):  # templates write them as text
        if message.get(key) is not None and not isinstance(message[key], str):
            raise ValueError(f"{where}.{key} must be a string, got {type(message[key]).__name__}")
    normalized = {**message, "content": _content(message.get("content"), where, role)}
    calls = normalized.pop("tool_calls", None)
    if calls:  # an empty list is dropped, as vLLM does: templates take the tool-call path on the key alone
        normalized["tool_calls"] = _tool_calls(calls, role, f"{where}.tool_calls")
    return normalized


def _tool_calls(calls, role: str, where: str) -> list[dict]:
    if role != "assistant":
        raise ValueError(f"{where}: only assistant messages carry tool calls, not {role} messages")
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of tool calls, got {type(calls).__name__}")
    return [_tool_call(call, f"{where}[{j}]") for j, call in enumerate(calls)]


def _tool_call(call, where: str) -> dict:
    """OpenAI sends a call's arguments as JSON text; HF chat templates expect an object (they write it with
    tojson), as vLLM passes them (null or "" as {})."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}")
    arguments = fn.get("arguments")
    if arguments is None or isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments and arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nesting past the parser's depth
            raise ValueError(f"{where}.function.arguments is not valid JSON: {shorten(str(e))}") from e
    return {**call, "function": {**fn, "arguments": arguments}}


def _tool_hint(conversation: list[dict]) -> str:
    if any(m.get("tool_calls") or m["role"] == "tool" for m in conversation):
        return " (the messages hold tool calls or tool results, which this model's chat template may not support)"
    return ""


def _content(content, where: str, role: str) -> str:
    if isinstance(content, str):
        return _text(content, f"{where}.content")
    if content is None and role == "assistant":
        return ""  # as vLLM renders it: a template may concatenate content, which None (or no key) breaks
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                                 f"supported by this text model, got {shorten(repr(kind))}")
            texts.append(_text(part["text"], f"{where}.content[{j}].text"))
        return "\n".join(texts)
    raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")
