"""InputProcessor: the one place prompts and chat messages are checked, for the offline API and the server."""
import pytest

from conftest import char_tokenizer
from loramux.engine.input_processor import EngineLimits, InputProcessor
from loramux.sampling_params import SamplingParams
from loramux.tokenizer import Tokenizer

CHAT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"


@pytest.fixture(scope="module")
def inputs():
    tokenizer = Tokenizer.from_pretrained(char_tokenizer())
    tokenizer.chat_template = CHAT
    return InputProcessor(tokenizer, EngineLimits(max_model_len=32, vocab_size=98))


def test_text_parts_are_joined_like_a_string(inputs):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    assert inputs.chat_ids(parts) == inputs.chat_ids([{"role": "user", "content": "hello\nthere"}])
    assistant = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]
    assert inputs.tokenizer.decode(inputs.chat_ids(assistant)) == "<user>a<assistant>>"


@pytest.mark.parametrize("messages, words", [
    ([], "at least one message"),
    ("hi", "messages must be a list"),
    (["hi"], "messages[0] must be an object"),
    ([{"content": "x"}], "messages[0].role must be one of"),
    ([{"role": "banana", "content": "x"}], "got 'banana'"),
    ([{"role": "user"}], "messages[0] has no 'content'"),
    ([{"role": "user", "content": 5}], "must be a string or a list of text parts, got int"),
    ([{"role": "user", "content": None}], "got NoneType"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "only text parts"),
    ([{"role": "user", "content": "bad \ud800 text"}], "messages[0].content is not valid Unicode"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
     "messages[1].content[0].text is not valid Unicode"),
])
def test_bad_messages_are_refused_naming_the_message(inputs, messages, words):
    with pytest.raises(ValueError) as err:
        inputs.chat_ids(messages)
    assert words in str(err.value)


def test_a_template_that_raises_is_a_value_error(inputs):
    tokenizer = Tokenizer.from_pretrained(char_tokenizer())
    tokenizer.chat_template = "{{ raise_exception('system messages are not supported') }}"
    with pytest.raises(ValueError, match="system messages are not supported"):
        InputProcessor(tokenizer, inputs.limits).chat_ids([{"role": "system", "content": "x"}])


@pytest.mark.parametrize("prompt, words", [("", "the prompt is empty"), ([], "the prompt is empty"),
                                           ([5, 98], "in [0, 98)"), ([5, -1], "in [0, 98)"), ([5, True], "in [0, 98)"),
                                           ([1.5], "in [0, 98)"), ("a\ud800", "not valid Unicode")])
def test_bad_prompts(inputs, prompt, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        inputs.prompt_ids(prompt)


def test_lengths(inputs):
    inputs.check_length(31, SamplingParams(max_tokens=100), strict=False)  # offline: ends at the model's length
    with pytest.raises(ValueError, match="32 tokens; this model's maximum context length is 32"):
        inputs.check_length(32, SamplingParams(max_tokens=1), strict=False)
    with pytest.raises(ValueError, match="you requested 40 tokens .30 in the prompt, 10 in the completion"):
        inputs.check_length(30, SamplingParams(max_tokens=10), strict=True)
    assert inputs.max_tokens_left(30) == 2


def test_tools_and_tool_messages_reach_the_chat_template():
    tokenizer = Tokenizer.from_pretrained(char_tokenizer())
    tokenizer.chat_template = ("{% if tools %}[{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
                               "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
                               "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments.a }}"
                               "{% endfor %}{% endfor %}")
    inputs = InputProcessor(tokenizer, EngineLimits(max_model_len=64, vocab_size=98))
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 7}'}}  # JSON text
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]},  # no content: fine
                {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert tokenizer.decode(inputs.chat_ids(messages, tools=tools)) == "[f,g]<user>q<assistant>f7<tool>42"
    bad = [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"):
        inputs.chat_ids(bad)


# an HF-style template: concatenates content (None or a missing key breaks `+`), writes calls' arguments with tojson
TOOLS_CHAT = ("{% for m in messages %}{{ '<' + m.role + '>' + m.content }}"
              "{% for c in m.tool_calls or [] %}{{ c.function.name + c.function.arguments | tojson }}{% endfor %}"
              "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}")


def tools_inputs(template: str = TOOLS_CHAT) -> InputProcessor:
    tokenizer = Tokenizer.from_pretrained(char_tokenizer())
    tokenizer.chat_template = template
    return InputProcessor(tokenizer, EngineLimits(max_model_len=128, vocab_size=98))


def test_the_openai_sdks_tool_call_message_renders_as_vllm_renders_it():
    """The SDK sends the server's own message back: content null, arguments as JSON text (and its other
    fields null). The template gets content "" and the arguments as an object."""
    inputs = tools_inputs()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":7}'}}
    said = {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None, "audio": None}
    messages = [{"role": "user", "content": "q"}, said, {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert inputs.tokenizer.decode(inputs.chat_ids(messages)) == '<user>q<assistant>f{"a": 7}<tool>42#c1'
    absent = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]}]
    assert inputs.tokenizer.decode(inputs.chat_ids(absent)) == '<user>q<assistant>f{"a": 7}'
    empty = [{"role": "assistant", "content": "x", "tool_calls": []}]  # dropped, as vLLM does
    assert inputs.tokenizer.decode(inputs.chat_ids(empty)) == "<assistant>x"
    no_arguments = [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "g"}}]}]
    assert inputs.tokenizer.decode(inputs.chat_ids(no_arguments)) == "<assistant>g{}"


@pytest.mark.parametrize("message, words", [
    ({"role": "assistant", "content": "x", "tool_calls": 5}, "messages[0].tool_calls must be a list"),
    ({"role": "assistant", "content": "x", "tool_calls": {"a": 1}}, "messages[0].tool_calls must be a list"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}, "only assistant messages"),
    ({"role": "tool", "content": "x", "tool_call_id": 5}, "messages[0].tool_call_id must be a string, got int"),
    ({"role": "user", "content": "x", "name": ["a"]}, "messages[0].name must be a string, got list"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}]},
     "messages[0].tool_calls[0].function.arguments is not valid JSON"),
    ({"role": "x" * 100_000, "content": "x"}, "messages[0].role must be one of"),
])
def test_malformed_tool_messages_are_value_errors_naming_the_field(message, words):
    with pytest.raises(ValueError) as err:
        tools_inputs().chat_ids([message])
    assert words in str(err.value) and len(str(err.value)) < 400


def test_a_template_that_cannot_render_tool_calls_is_a_clear_value_error():
    inputs = tools_inputs("{% for m in messages %}{{ m.role + m.tool_calls[0].function.nme.upper() }}{% endfor %}")
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    with pytest.raises(ValueError, match="the chat template .* tool calls or tool results"):
        inputs.chat_ids([{"role": "assistant", "content": None, "tool_calls": [call]}])
    refusing = tools_inputs("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}"
                            "{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="no tools .the messages hold tool calls or tool results"):
        refusing.chat_ids([{"role": "tool", "content": "42", "tool_call_id": "c1"}])
