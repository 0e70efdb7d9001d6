"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: a request becomes one chat completion
(`model` names the adapter, as everywhere), and its answer a Response object, or, streamed, the Responses
event sequence. No torch.

- Honoured: `input` (a string, or items: messages with text parts, `function_call` and `function_call_output`
  items for tool round trips), `instructions` (a system message first), `max_output_tokens`, `temperature`,
  `top_p`, `text.format` (text, json_object, json_schema), function `tools`, `tool_choice`,
  `parallel_tool_calls`, `stream`, `user` (logged; picks a weighted alias's target), `metadata` (returned),
  `include: ["message.output_text.logprobs"]` with `top_logprobs` (each output_text part's token logprobs),
  `store: false`. `text.format` shapes text answers: a turn that must call a tool (`tool_choice` "required" or a
  named function) is constrained to the call instead, and with `tool_choice` "auto" the answer is text in the
  format (one grammar constrains a turn: no call can be written then, so it runs as "none").
- Refused with a 400 naming the field: what needs state kept between requests (`store: true`,
  `previous_response_id`, `conversation`, `background`, stored `prompt`s), and every other field this server does
  not implement, unless it is null, empty or its default.
"""
from __future__ import annotations

import time
import uuid

from pydantic import ConfigDict, Field

from loramux.server.http import protocol as p

STATEFUL = ("previous_response_id", "conversation", "background", "prompt")
"""Fields that need responses kept server-side, which this server does not do."""
LOGPROBS = "message.output_text.logprobs"  # the one `include` value served: each output_text part's token logprobs
NOT_IMPLEMENTED = ("reasoning", "max_tool_calls", "service_tier", "truncation",
                   "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
                   "context_management", "moderation", "image", "access_programs", "background_options",
                   "stream_options")
_DEFAULTS = {"truncation": "disabled", "background": False}


class ResponsesRequest(p.RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: a 400 naming them (checked below)

    model: str
    input: str | list = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def refused(self) -> str | None:
        """Why this request cannot be served as sent (a field named), or None."""
        sent = {k: v for k, v in (self.model_extra or {}).items() if v not in (None, [], {}, _DEFAULTS.get(k))}
        if self.store:
            return "store: responses are not stored by this server; send store: false (or leave it out)"
        if self.top_logprobs is not None and not self.wants_logprobs:
            return f"top_logprobs: logprobs are returned with include: [{LOGPROBS!r}]"
        others = sorted(set(self.include or ()) - {LOGPROBS})
        if others:
            return f"include: {', '.join(map(repr, others))} not implemented by this server (only {LOGPROBS!r})"
        stateful = sorted(k for k in sent if k in STATEFUL)
        if stateful:
            return f"{stateful[0]}: this server keeps no responses or conversations; send the whole input instead"
        unknown = sorted(sent)
        return f"{', '.join(unknown)}: not implemented by this server" if unknown else None

    def to_chat(self) -> p.ChatCompletionRequest:
        """The chat completion this request is (ValueError naming what does not convert)."""
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, dict)  # the output is a call
        shape = None if forced else _response_format(self.text)
        choice = _chat_tool_choice(self.tool_choice)
        if shape is not None and self.tools and choice in (None, "auto"):
            choice = "none"  # the format's grammar lets no call be written: "auto" can only answer, as "none" does
        fields = {"model": self.model, "messages": self._messages(), "max_completion_tokens": self.max_output_tokens,
                  "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream, "user": self.user,
                  "response_format": shape, "tools": _chat_tools(self.tools), "tool_choice": choice,
                  "parallel_tool_calls": self.parallel_tool_calls, "logprobs": self.wants_logprobs or None,
                  "top_logprobs": self.top_logprobs if self.wants_logprobs else None}
        return p.ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())

    def _messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            _add_item(messages, item, f"input[{i}]")
        return messages


def _add_item(messages: list[dict], item, where: str) -> None:
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object (a message, function_call or function_call_output)")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise ValueError(f"{where}.role must be user, assistant, system or developer")
        messages.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), where)})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        if not all(isinstance(v, str) for v in (call["id"], *call["function"].values())):
            raise ValueError(f"{where}: a function_call needs call_id, name and arguments (strings)")
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
            last["tool_calls"].append(call)  # consecutive calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise ValueError(f"{where}: a function_call_output needs call_id and output (strings)")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    else:
        raise ValueError(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)")


def _text(content, where: str) -> str:
    """A message's content as text: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{j}] must be an input_text or output_text part (this server serves "
                             "text models)")
        texts.append(part["text"])
    return "".join(texts)


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise ValueError("text.format.type must be text, json_object or json_schema")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _chat_tools(tools: list | None) -> list | None:
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f"tools[{i}]: only function tools are supported")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        converted.append({"type": "function", "function": fn})
    return converted


def _chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}')
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


# ---- the answer -------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    """logprobs: the text's tokens' (chat's shape, which output_text's is), when `include` asks for them."""
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    content = [part] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def output_of(choice: dict, logprobs: bool) -> list[dict]:
    """A whole chat choice (its content and tool calls parsed) as Response output items: the message, if it
    wrote text, then one function_call per call. logprobs: the text part carries its tokens'."""
    message = choice["message"]
    content, calls = message["content"], message.get("tool_calls") or []
    tokens = (choice["logprobs"] or {}).get("content") if logprobs else None
    text = [message_item(new_id("msg"), content, logprobs=tokens)] if content else []
    return text + [call_item(call) for call in calls]


def call_item(call: dict, status: str = "completed") -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if status == "completed" else "", "status": status}


def response(request: ResponsesRequest, rid: str, output: list[dict], status: str, usage: dict | None,
             incomplete: str | None = None) -> dict:
    """A Response object (status: in_progress, completed, incomplete or failed)."""
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": request.model,
            "output": output, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "tool_choice": request.tool_choice or ("auto" if request.tools else "none"), "tools": request.tools or [],
            "text": request.text or {"format": {"type": "text"}}, "store": False, "metadata": request.metadata or {},
            "user": request.user, "previous_response_id": None, "reasoning": None, "truncation": "disabled",
            "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def outcome(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) of a response whose one choice ended so."""
    return ("incomplete", "max_output_tokens") if finish_reason == "length" else ("completed", None)
