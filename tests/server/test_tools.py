"""server.tools without a server: modes, the hermes parser, streaming hold-back. (Served: test_openai_fields.)"""
import json

import pytest

from loramux.server.http import tools

FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_auto_needs_a_parser_as_in_vllm():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice and --tool-call-parser"):
        tools.check_tools([FN], None, None, None)
    assert tools.check_tools([FN], None, None, "hermes") == "auto"
    assert tools.check_tools([], None, None, None) == "none"  # no tools: nothing to choose
    assert tools.check_tools([FN], "none", None, None) == "none"
    assert tools.check_tools([FN], {"type": "function", "function": {"name": "f"}}, None, None) == "named"


def test_hermes_calls_and_content():
    text = 'I will look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "g"}'
    content, calls = tools.parse("auto", text)
    assert content == "I will look.\n" and [c["function"]["name"] for c in calls] == ["f", "g"]  # as streamed
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1} and calls[1]["function"]["arguments"] == "{}"
    assert tools.parse("auto", "no calls here") == ("no calls here", [])
    assert tools.parse("auto", "<tool_call>{broken") == ("<tool_call>{broken", [])  # unparsable: left as content
    assert tools.parse("required", '[{"name": "f", "par') == ('[{"name": "f", "par', [])  # cut by max_tokens
    _, first = tools.parse("auto", text, parallel=False)  # parallel_tool_calls false: the first call only
    assert [c["function"]["name"] for c in first] == ["f"]
    stream = tools.ToolStream("auto", parallel=False)
    assert stream.feed(text) + stream.finish() == "I will look.\n" and len(stream.calls) == 1


def test_streaming_holds_back_what_may_start_a_call():
    stream = tools.ToolStream("auto")
    sent = [stream.feed(d) for d in ["Hello <to", "ol", "_call>{\"name\": \"f\", ", "\"arguments\": {}}</tool_call>"]]
    assert sent == ["Hello ", "", "", ""]
    assert stream.finish() == "" and [c["function"]["name"] for c in stream.calls] == ["f"]
    plain = tools.ToolStream("auto")
    assert [plain.feed(d) for d in ["a <t", "x", "!"]] == ["a ", "<tx", "!"] and plain.finish() == "" and not plain.calls


def test_an_unknown_named_function_is_quoted_shortened():
    choice = {"type": "function", "function": {"name": "g" * 100_000}}
    with pytest.raises(ValueError, match="which is not among the tools") as err:
        tools.check_tools([FN], choice, None, None)
    assert len(str(err.value)) < 200
