"""Tool calling for /v1/chat/completions, as vLLM does it. No torch.

- tool_choice "required" or a named function: the output is constrained by a JSON schema (structured
  outputs) built from the tools' parameter schemas, so it always parses into tool calls.
- tool_choice "auto" (the default when tools are given): the model decides; its text is parsed for calls in
  the format it was trained on. That format is the model's, so the server must be told it
  (`--enable-auto-tool-choice --tool-call-parser hermes`, vLLM's flags); without them "auto" is refused.
  hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen 2.5/3, SmolLM3, ...).
- tool_choice "none": no calls; the tools still go to the chat template.
The tools are always passed to the chat template (`tools`), which shows them to the model if it knows how.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from loramux.sampling_params import StructuredOutputsParams, shorten

TOOL_CALL_PARSERS = ("hermes",)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_HERMES_START = "<tool_call>"


def check_tools(tools: list, tool_choice, parallel: bool | None, parser: str | None) -> str:
    """Checks the request's tools and tool_choice; returns the mode: "none", "auto", "required" or "named".
    ValueError naming the problem."""
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(fn["name"])
    if tool_choice is None or tool_choice == "auto":
        if not tools:
            return "none"
        if parser is None:
            raise ValueError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        return "auto"
    if tool_choice in ("none", "required"):
        if tool_choice == "required" and not tools:
            raise ValueError('tool_choice "required" needs tools')
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError("tool_choice must be \"none\", \"auto\", \"required\" or "
                         "{'type': 'function', 'function': {'name': ...}}")
    if name not in names:
        raise ValueError(f"tool_choice names the function {shorten(repr(name))}, which is not among the tools")
    return "named"


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def tool_grammar(tools: list, mode: str, tool_choice, parallel: bool | None) -> StructuredOutputsParams | None:
    """The structured output that makes the model call a tool ("required": a JSON array of {name,
    parameters}; "named": that function's parameters)."""
    if mode == "named":
        name = tool_choice["function"]["name"]
        tool = next(t for t in tools if t["function"]["name"] == name)
        return StructuredOutputsParams(json=json.dumps(_parameters(tool)))
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=json.dumps(schema))


def tool_call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def parse(mode: str, text: str, tool_choice=None, parallel: bool | None = None) -> tuple[str | None, list[dict]]:
    """(content, tool calls) from a finished choice's text. Text that does not parse (cut by max_tokens, or a
    model that wrote something else) stays content, with no calls. parallel False: the first call only (in
    "required" mode the grammar already allows one)."""
    try:
        if mode == "named":
            json.loads(text)
            return None, [tool_call(tool_choice["function"]["name"], text)]
        if mode == "required":
            return None, [tool_call(c["name"], c["parameters"]) for c in json.loads(text)]
        if mode == "auto":
            content, calls = _parse_hermes(text)
            return content, calls[:1] if parallel is False else calls
    except (ValueError, KeyError, TypeError):
        pass
    return text, []


def _parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    start = text.find(_HERMES_START)
    if start < 0:
        return text, []
    calls = []
    for match in _HERMES.finditer(text):
        call = json.loads(match.group(1) or match.group(2))
        calls.append(tool_call(call["name"], call.get("arguments", {})))
    return text[:start] or None, calls  # as it streamed: the text before the first call, whitespace included


def finish_reason(mode: str, calls: list[dict], reason: str | None) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (auto, required); a forced named call is "stop"."""
    if calls and mode in ("auto", "required") and reason == "stop":
        return "tool_calls"
    return reason


@dataclass
class ToolStream:
    """A streamed choice's text, split into content deltas and, at the end, tool calls. Constrained modes
    hold everything back (it is a call); "auto" passes text through until a call may be starting."""

    mode: str
    tool_choice: object = None
    parallel: bool | None = None
    held: str = ""
    calls: list[dict] = field(default_factory=list)

    def feed(self, delta: str) -> str:
        """The content to send now."""
        if self.mode == "none":
            return delta
        self.held += delta
        if self.mode != "auto" or _HERMES_START in self.held:
            return ""
        keep = _prefix_overlap(self.held, _HERMES_START)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def finish(self) -> str:
        """At the end: the rest of the content (self.calls set)."""
        if self.mode == "none":
            return ""
        content, self.calls = parse(self.mode, self.held, self.tool_choice, self.parallel)
        return content or ""


def _prefix_overlap(text: str, marker: str) -> int:
    """The longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
