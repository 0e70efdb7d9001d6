"""server.protocol without a server: every field OpenAI or vLLM defines that loramux does not implement is
refused by name on both endpoints (unless sent with its "off" value); stream_options and max_tokens rules.
(Served, through the openai client: test_openai_fields.)"""
import pydantic
import pytest

from loramux.server import protocol as p

MESSAGES = [{"role": "user", "content": "a"}]


def build(endpoint: str, **fields):
    if endpoint == "chat":
        return p.ChatCompletionRequest(model="m", messages=MESSAGES, **fields)
    return p.CompletionRequest(model="m", prompt="a", **fields)


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


def test_chat_prompt_logprobs_are_not_streamed():
    with pytest.raises(pydantic.ValidationError, match="prompt_logprobs are not available when stream is true"):
        build("chat", stream=True, prompt_logprobs=1)
    build("completions", stream=True, prompt_logprobs=1)  # a completion stream's first event carries them


def test_echo_asks_the_engine_for_the_larger_of_logprobs_and_prompt_logprobs():
    params = build("completions", echo=True, logprobs=3, prompt_logprobs=1).sampling_params(4)
    assert (params.logprobs, params.prompt_logprobs) == (3, 3)
    assert build("completions", echo=True, logprobs=0).sampling_params(4).prompt_logprobs == 0
    assert build("completions", logprobs=2).sampling_params(4).prompt_logprobs is None  # no echo: not scored
