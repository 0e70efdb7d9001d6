"""server.protocol without a server: every field OpenAI or vLLM defines that loramux does not implement is
refused by name on both endpoints (unless sent with its "off" value); stream_options and max_tokens rules;
strict JSON types (no "5" or true for a number); a lone surrogate anywhere in a body refused naming its field.
(Served, through the openai client: test_openai_fields.)"""
import re
import typing

import pydantic
import pytest

from loramux.server.http import protocol as p

MESSAGES = [{"role": "user", "content": "a"}]


def build(endpoint: str, **fields):
    if endpoint == "chat":
        return p.ChatCompletionRequest(**{"model": "m", "messages": MESSAGES, **fields})
    return p.CompletionRequest(**{"model": "m", "prompt": "a", **fields})


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("field", sorted(p.NOT_IMPLEMENTED))
def test_every_unimplemented_field_is_refused_by_name(endpoint, field):
    model = p.ChatCompletionRequest if endpoint == "chat" else p.CompletionRequest
    if field in model.model_fields:  # implemented on this endpoint (echo on completions, ...)
        pytest.skip(f"{field} is a {endpoint} field")
    with pytest.raises(pydantic.ValidationError, match=f"unsupported field\\(s\\): {field}"):
        build(endpoint, **{field: 12345})
    if field == "add_special_tokens":  # accepted with what loramux does: vLLM's default per endpoint
        accepted = [endpoint == "completions"]
    elif field in p.OURS:
        accepted = [p.OURS[field]]
    else:
        accepted = [None, False, [], {}]  # an SDK's "off" value asks for nothing
    for value in accepted:
        build(endpoint, **{field: value})


def test_max_completion_tokens_is_chat_only():
    assert build("chat", max_tokens=5, max_completion_tokens=3).max_tokens_for() == 3
    assert build("chat").max_tokens_for() is None  # up to the model's length
    assert build("completions").max_tokens_for() == 16  # OpenAI's default
    with pytest.raises(pydantic.ValidationError, match="unsupported field\\(s\\): max_completion_tokens"):
        build("completions", max_completion_tokens=3)


def test_stream_options():
    assert build("chat", stream=True, stream_options={"include_usage": True}).include_usage
    with pytest.raises(pydantic.ValidationError, match="stream_options can only be set when stream is true"):
        build("completions", stream_options={"include_usage": True})
    with pytest.raises(pydantic.ValidationError, match="stream_options.continuous_usage_stats"):
        build("completions", stream=True, stream_options={"continuous_usage_stats": True})
    build("completions", stream_options={"include_usage": False})  # off: nothing asked
    build("completions", stream_options={"include_usage": None})


def test_chat_prompt_logprobs_are_not_streamed():
    with pytest.raises(pydantic.ValidationError, match="prompt_logprobs are not available when stream is true"):
        build("chat", stream=True, prompt_logprobs=1)
    build("completions", stream=True, prompt_logprobs=1)  # a completion stream's first event carries them


def test_echo_asks_the_engine_for_the_larger_of_logprobs_and_prompt_logprobs():
    params = build("completions", echo=True, logprobs=3, prompt_logprobs=1).sampling_params(4)
    assert (params.logprobs, params.prompt_logprobs) == (3, 3)
    assert build("completions", echo=True, logprobs=0).sampling_params(4).prompt_logprobs == 0
    assert build("completions", logprobs=2).sampling_params(4).prompt_logprobs is None  # no echo: not scored


def _kinds(annotation) -> set:
    """The JSON scalar kinds a field's annotation takes (int | None -> {int})."""
    return {a for a in (typing.get_args(annotation) or (annotation,)) if a in (int, float, bool)}


SCALARS = [(endpoint, name, kind) for endpoint, model in (("chat", p.ChatCompletionRequest),
                                                         ("completions", p.CompletionRequest))
           for name, field in model.model_fields.items() for kind in _kinds(field.annotation)]
WRONG = {int: ["5", True, 5.0], float: ["0.5", True], bool: ["true", "yes", 1, 0]}
"""What pydantic coerced before: numbers as strings, booleans as numbers, a whole float as an integer."""


def test_every_number_and_boolean_field_is_checked():
    assert {(e, n) for e, n, _ in SCALARS} >= {("chat", "top_logprobs"), ("completions", "logprobs"),
                                               ("chat", "logprobs"), ("completions", "seed"), ("chat", "n"),
                                               ("completions", "temperature"), ("chat", "stream")}


@pytest.mark.parametrize("endpoint, name, kind", SCALARS)
def test_number_and_boolean_fields_take_no_strings_or_other_types(endpoint, name, kind):
    for value in WRONG[kind]:
        with pytest.raises(pydantic.ValidationError) as err:
            build(endpoint, **{name: value})
        assert err.value.errors()[0]["loc"] == (name,), (name, value)


def test_an_integer_is_a_number_as_openai_takes_it():
    request = build("chat", temperature=1, top_p=1, presence_penalty=0)
    assert (request.temperature, type(request.temperature)) == (1.0, float)


@pytest.mark.parametrize("endpoint, fields, loc", [
    ("completions", {"stop_token_ids": [1, True]}, ("stop_token_ids", 1)),
    ("completions", {"logit_bias": {"5": "1"}}, ("logit_bias", "5")),
    ("completions", {"logit_bias": {"5": True}}, ("logit_bias", "5")),
    ("chat", {"stream": True, "stream_options": {"include_usage": "no"}}, ()),  # "no" is truthy
    ("chat", {"stream": True, "stream_options": {"include_usage": 1}}, ()),
])
def test_numbers_inside_lists_and_objects_are_strict_too(endpoint, fields, loc):
    with pytest.raises(pydantic.ValidationError) as err:
        build(endpoint, **fields)
    assert err.value.errors()[0]["loc"] == loc


def test_token_ids_are_integers_not_booleans():
    with pytest.raises(pydantic.ValidationError):
        p.DetokenizeRequest(model="m", tokens=[True])  # decoded token 1 before
    with pytest.raises(pydantic.ValidationError):
        p.CompletionRequest(model="m", prompt=[1, True])


def test_logit_bias_keys_are_canonical_token_ids():
    with pytest.raises(ValueError, match="logit_bias key ' 7 ' is not a token id"):
        build("completions", logit_bias={" 7 ": 1}).sampling_params(4)
    assert build("completions", logit_bias={"7": 1}).sampling_params(4).logit_bias == {7: 1.0}


@pytest.mark.parametrize("endpoint, fields, where", [
    ("completions", {"stop": ["x", "a\ud800"]}, "stop[1] is not valid Unicode: a lone surrogate at position 1"),
    ("completions", {"stop": "\udfff"}, "stop is not valid Unicode"),
    ("completions", {"bad_words": ["\ud800"]}, "bad_words[0] is not valid Unicode"),
    ("completions", {"user": "\ud800"}, "user is not valid Unicode"),
    ("completions", {"prompt": ["ok", "\ud800"]}, "prompt[1] is not valid Unicode"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text is not valid Unicode"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"description": "\ud800"}}}]},
     "tools[0].function.parameters.description is not valid Unicode"),
    ("chat", {"logit_bias": {"\ud800": 1}}, "the key '\\ud800' in logit_bias is not valid Unicode"),
    ("chat", {"made_up": {"x": "\ud800"}}, "made_up.x is not valid Unicode"),
    ("chat", {"guided_choice": ["\ud800"]}, "guided_choice[0] is not valid Unicode"),
])
def test_a_lone_surrogate_anywhere_is_refused_naming_its_field(endpoint, fields, where):
    with pytest.raises(pydantic.ValidationError, match=re.escape(where)):
        build(endpoint, **fields)


def test_every_request_model_refuses_lone_surrogates():
    for model, fields in ((p.TokenizeRequest, {"model": "m", "prompt": "\ud800"}),
                          (p.DetokenizeRequest, {"model": "\ud800", "tokens": []}),
                          (p.LoadLoRAAdapterRequest, {"lora_name": "\ud800", "lora_path": "/x"}),
                          (p.UnloadLoRAAdapterRequest, {"lora_name": "\ud800"}),
                          (p.PinLoRAAdapterRequest, {"lora_name": "\ud800"}),
                          (p.CompletionRequest, {"model": "m\ud800", "prompt": "a"})):
        with pytest.raises(pydantic.ValidationError, match="is not valid Unicode: a lone surrogate"):
            model(**fields)


def test_a_surrogate_message_quotes_no_long_input_and_survives_deep_nesting():
    with pytest.raises(pydantic.ValidationError) as err:
        build("completions", **{"k" * 100_000: ["\ud800"]})
    assert len(str(err.value)) < 600
    with pytest.raises(pydantic.ValidationError) as err:
        build("completions", logit_bias={"1" * 100_000 + "\ud800": 1})
    assert len(str(err.value)) < 600
    deep = "\ud800"
    for _ in range(100_000):  # far past the recursion limit: the walk is iterative
        deep = [deep]
    assert "is not valid Unicode" in p.lone_surrogate({"x": deep})
    clean = "é"
    for _ in range(100_000):
        clean = [clean]
    assert p.lone_surrogate({"x": clean}) is None and p.lone_surrogate({"x": [["ok", {"é": "ü"}]]}) is None


def test_tokenize_refuses_the_vllm_fields_it_does_not_implement():
    """They were ignored: a chat_template sent to /tokenize changed nothing in the ids it answered."""
    for field in sorted(p.TOKENIZE_NOT_IMPLEMENTED):
        with pytest.raises(pydantic.ValidationError, match=f"unsupported field\\(s\\): {field}"):
            p.TokenizeRequest(model="m", messages=MESSAGES, **{field: "x"})
        p.TokenizeRequest(model="m", messages=MESSAGES, **{field: None})  # off: nothing asked
    p.TokenizeRequest(model="m", prompt="a", made_up_field=1)  # fields vLLM does not define: accepted
