"""OpenAI fields real clients rely on, through `loramux serve` with the official openai client: logprobs
(completions and chat, streamed and not), echo (lm-evaluation-harness's loglikelihood request), vLLM's
prompt_logprobs, the Responses API (and the openai-agents SDK on it), and the refusal of any field the server
does not implement. Values are checked against the offline engine on the same weights (whose logprobs
tests/engine/test_logprobs.py checks against PEFT)."""
import math
import os

import jsonschema
import openai
import pytest

from loramux import SamplingParams
from support.serving import make_files, offline_llm, openai_client, server_log, start_server, stop

MAX_LEN = 256  # a character-level tokenizer: a tool call's JSON is ~60 tokens


# declares tools (their names: the tiny model has 256 positions); as HF templates do, it concatenates content
# (which a null or missing content breaks) and writes tool calls' arguments with tojson (an object, not text)
TEMPLATE = ("{% if tools %}<tools>{{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
            "{% for m in messages %}{{ '<' + m.role + '>' + m.content }}"
            "{% for c in m.tool_calls or [] %}{{ c.function.name + c.function.arguments | tojson }}{% endfor %}"
            "{% endfor %}>")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    files = make_files(tmp_path_factory)
    with open(os.path.join(files["model"], "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return files


@pytest.fixture(scope="module")
def served(files):
    proc, url = start_server(files, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                             "--max-model-len", str(MAX_LEN), "--log-level", "info")
    yield proc, url
    stop(proc)


@pytest.fixture(scope="module")
def server(served):
    return served[1]


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def offline(files):
    llm = offline_llm(files, files["served"], MAX_LEN)
    llm.tokenizer.chat_template = TEMPLATE
    return llm


def peft_logprobs(files, adapter, ids: list[int]):
    """The oracle: log_softmax of HF transformers + PEFT logits for that adapter alone ([len(ids), vocab])."""
    import conftest

    return conftest.peft_logprobs(conftest.tiny_llama(), None if adapter == "tiny" else files["served"][adapter], ids)


def close(a: list, b: list) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(a, b))


def test_completion_logprobs_equal_peft(client, offline, files):
    out = client.completions.create(model="s1", prompt="hello", max_tokens=6, temperature=0, logprobs=2)
    ref = offline.generate("hello", SamplingParams(max_tokens=6, temperature=0, logprobs=2), adapters="s1")[0]
    lp = out.choices[0].logprobs
    assert out.choices[0].text == ref.text
    prompt = offline.tokenizer.encode("hello")
    oracle = peft_logprobs(files, "s1", prompt + ref.token_ids)[len(prompt) - 1:-1]
    assert close(lp.token_logprobs, oracle.max(-1).values.tolist())  # greedy: the chosen token is the top one
    for top, row in zip(lp.top_logprobs, oracle):
        assert close(sorted(top.values(), reverse=True)[:2], row.topk(2).values.tolist())
    assert lp.tokens == [offline.tokenizer.decode([t]) for t in ref.token_ids]
    assert close(lp.token_logprobs, ref.logprobs.logprobs)
    assert all(len(top) <= 3 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert out.choices[0].logprobs is not None and client.completions.create(
        model="s1", prompt="hello", max_tokens=2, temperature=0).choices[0].logprobs is None


def test_echo_with_max_tokens_0_scores_the_prompt_as_lm_eval_asks(client, offline, files):
    """lm-evaluation-harness's local-completions loglikelihood: echo, logprobs, max_tokens 0."""
    out = client.completions.create(model="s2", prompt="the cat sat", max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = out.choices[0]
    assert choice.text == "the cat sat" and out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    prompt = offline.tokenizer.encode("the cat sat")
    oracle = peft_logprobs(files, "s2", prompt)[:-1].gather(1, __import__("torch").tensor(prompt[1:])[:, None])
    assert close(choice.logprobs.token_logprobs[1:], oracle.flatten().tolist())
    assert "".join(choice.logprobs.tokens) == "the cat sat"
    echoed = client.completions.create(model="s2", prompt="the cat sat", max_tokens=4, echo=True, temperature=0)
    completion = offline.generate("the cat sat", SamplingParams(max_tokens=4, temperature=0), adapters="s2")[0].text
    assert echoed.choices[0].text == "the cat sat" + completion


def test_streamed_completion_logprobs_and_echo_add_up_to_the_plain_answer(client):
    args = dict(model="s0", prompt=["ab", "xyz"], max_tokens=5, temperature=0, logprobs=1, echo=True)
    plain = client.completions.create(**args)
    for index in (0, 1):
        chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices[0].index == index]
        want = plain.choices[index]
        assert "".join(c.text for c in chunks) == want.text
        tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        values = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
        offsets = [v for c in chunks if c.logprobs for v in c.logprobs.text_offset]
        assert tokens == want.logprobs.tokens and offsets == want.logprobs.text_offset
        assert values[0] is None and close(values[1:], want.logprobs.token_logprobs[1:])


def test_chat_logprobs_equal_peft_streamed_and_not(client, offline, files):
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model="s3", messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3)
    ref = offline.chat(messages, SamplingParams(max_tokens=6, temperature=0, logprobs=3), adapters="s3")[0]
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [offline.tokenizer.decode([t]) for t in ref.token_ids]
    prompt = offline.engine.chat_ids(messages)
    oracle = peft_logprobs(files, "s3", prompt + ref.token_ids)[len(prompt) - 1:-1]
    assert close([c.logprob for c in content], oracle.max(-1).values.tolist())
    for entry, row in zip(content, oracle):
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 3
        assert close([t.logprob for t in entry.top_logprobs], row.topk(3).values.tolist())
    chunks = client.chat.completions.create(model="s3", messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=3, stream=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [c.token for c in content]
    assert close([e.logprob for e in streamed], [c.logprob for c in content])
    plain = client.chat.completions.create(model="s3", messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_vllm_prompt_logprobs_extra_field(client, offline):
    out = client.completions.create(model="tiny", prompt="abcd", max_tokens=1, extra_body={"prompt_logprobs": 2})
    ref = offline.generate("abcd", SamplingParams(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 4
    for entry, token, value, rank in zip(entries[1:], ref.token_ids, ref.logprobs, ref.ranks):
        assert math.isclose(entry[str(token)]["logprob"], value, abs_tol=1e-4) and entry[str(token)]["rank"] == rank
        assert 2 <= len(entry) <= 3
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 1


@pytest.mark.parametrize("api, body, words", [
    ("completions", {"prompt": "a", "logprobs": 21}, "logprobs must be null or an integer in [0, 20]"),
    ("completions", {"prompt": "a", "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("completions", {"prompt": "a", "logit_bias": {"5000": 10}}, "logit_bias token ids must be below"),
    ("completions", {"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias must map token ids"),
    ("completions", {"prompt": "a", "best_of": 2, "suffix": "x"}, "unsupported field(s): suffix, best_of (other than n)"),
    ("completions", {"prompt": "a", "min_tokens": 9, "max_tokens": 4}, "min_tokens must be an integer in [0, max_tokens]"),
    ("completions", {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty must be in (0, 10]"),
    ("completions", {"prompt": "a", "min_p": 1.5}, "min_p must be in [0, 1]"),
    ("completions", {"prompt": "a", "bad_words": [" "]}, "bad_words must be non-blank strings"),
    ("chat", {"modalities": ["audio"], "audio": {"voice": "x"}}, "unsupported field(s): audio, modalities"),
    ("chat", {"functions": [{"name": "f"}]}, "unsupported field(s): functions"),
    ("chat", {"chat_template_kwargs": {"x": 1}}, "unsupported field(s): chat_template_kwargs"),
    ("chat", {"add_generation_prompt": False}, "unsupported field(s): add_generation_prompt"),
    ("completions", {"prompt": "a", "add_special_tokens": False}, "unsupported field(s): add_special_tokens"),
    ("completions", {"prompt": "a", "stop_token_ids": [10**6], "min_tokens": 1}, "stop_token_ids must be below"),
    ("chat", {"min_tokens": 2, "response_format": {"type": "json_object"}}, "cannot be used with structured outputs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                          "function": "f"}},
     "tool_choice must be"),
    ("completions", {"prompt": "a", "structured_outputs": {"choice": "yes"}}, "choice must be a list"),
    ("chat", {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ("chat", {"logprobs": True, "top_logprobs": 30}, "logprobs must be null or an integer in [0, 20]"),
    ("chat", {"echo": True}, "unsupported field(s): echo"),
    ("completions", {"prompt": "a", "max_completion_tokens": 3}, "unsupported field(s): max_completion_tokens"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options can only be set when stream is true"),
    ("chat", {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs are not available when stream is true"),
    ("chat", {"prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low"},
     "unsupported field(s): prediction, reasoning_effort"),
    # OpenAI's integers and numbers are strict: strings and booleans were coerced
    ("chat", {"logprobs": True, "top_logprobs": "5"}, "top_logprobs: Input should be a valid integer"),
    ("completions", {"prompt": "a", "logprobs": True}, "logprobs: Input should be a valid integer"),
    ("completions", {"prompt": "a", "seed": True}, "seed: Input should be a valid integer"),
    ("completions", {"prompt": "a", "seed": "7"}, "seed: Input should be a valid integer"),
    ("completions", {"prompt": "a", "n": 2.0}, "n: Input should be a valid integer"),
    ("completions", {"prompt": "a", "max_tokens": True}, "max_tokens: Input should be a valid integer"),
    ("completions", {"prompt": "a", "stream": "yes"}, "stream: Input should be a valid boolean"),
    ("chat", {"temperature": "0.5"}, "temperature: Input should be a valid number"),
    ("chat", {"logprobs": 1}, "logprobs: Input should be a valid boolean"),
    ("completions", {"prompt": [5, True]}, "Input should be a valid integer"),
    ("completions", {"prompt": "a", "logit_bias": {" 7 ": 1}}, "logit_bias key ' 7 ' is not a token id"),
    ("completions", {"prompt": "a", "logit_bias": {"\u0661\u0662": 1}},
     "logit_bias key '\u0661\u0662' is not a token id"),  # Arabic-Indic digits: read as 12 before
    ("completions", {"prompt": "a", "temperature": 1e6},
     "temperature must be a finite number in [0, 2], got 1000000.0"),
])
def test_fields_out_of_range_or_not_implemented_are_refused_by_name(client, api, body, words):
    with pytest.raises(openai.BadRequestError) as e:
        if api == "chat":
            client.chat.completions.create(model="s0", messages=[{"role": "user", "content": "a"}], extra_body=body)
        else:
            client.completions.create(model="s0", extra_body=body, prompt=body.pop("prompt"))
    assert words in e.value.message


@pytest.mark.parametrize("path, body, where", [
    ("/v1/completions", {"prompt": "a", "stop": ["x", "a\ud800"]}, "stop[1]"),
    ("/v1/completions", {"prompt": "a", "bad_words": ["\udfff"]}, "bad_words[0]"),
    ("/v1/completions", {"prompt": "a", "model": "tiny\ud800"}, "model"),
    ("/v1/completions", {"prompt": "a", "user": "\ud800"}, "user"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f\ud800"}}]},
     "tools[0].function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logit_bias": {"\ud800": 1}},
     "the key '\\ud800' in logit_bias"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/detokenize", {"model": "\ud800", "tokens": [1]}, "model"),
    ("/v1/load_lora_adapter", {"lora_name": "\ud800", "lora_path": "/x"}, "lora_name"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(server, path, body, where):
    """JSON's "\\ud800" is valid JSON but no text: it was a 500 wherever it was encoded (a stop string, the
    model name echoed, /tokenize's tokenizer, ...)."""
    import json

    import httpx

    raw = json.dumps({"model": "s0", **body}).encode()  # json.dumps escapes the surrogate; httpx's json= cannot
    response = httpx.post(f"{server}{path}", content=raw, headers={"content-type": "application/json"})
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and f"{where} is not valid Unicode: a lone surrogate at position" in message


def test_fields_sent_with_their_off_value_and_harmless_ones_are_accepted(client, served):
    body = {"logit_bias": None, "tools": [], "functions": None, "user": "someone", "best_of": 1, "suffix": None,
            "made_up_field": 1, "store": False, "metadata": {"k": "v"}, "add_generation_prompt": True,
            "add_special_tokens": False, "priority": 0, "n": None, "stream": None, "logprobs": None,
            "min_tokens": None}
    out = client.chat.completions.create(model="s0", messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                         extra_body=body)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert "user 'someone'" in server_log(served[0])  # `user` is logged, as OpenAI means it to be used


def test_a_priority_needs_the_priority_scheduling_policy(client):
    """vLLM's answer under its default fcfs policy: a priority other than 0 is refused, naming the policy."""
    with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority"):
        client.completions.create(model="s0", prompt="a", max_tokens=2, extra_body={"priority": 3})


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.mark.parametrize("model", ["tiny", "s1"])
def test_response_format_json_schema_and_json_object(client, offline, model):
    import json

    from loramux.sampling_params import StructuredOutputsParams

    messages = [{"role": "user", "content": "give me json"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                         response_format=fmt)
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)  # the adapter never saw JSON
    assert out.choices[0].finish_reason == "stop"
    ref = offline.chat(messages, SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputsParams(
        json=json.dumps(SCHEMA))), adapters=None if model == "tiny" else model)[0]
    assert out.choices[0].message.content == ref.text
    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                              response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == ref.text
    obj = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("body, check", [
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"guided_regex": "[0-9]{2}-[a-z]{3}"}, lambda t: __import__("re").fullmatch("[0-9]{2}-[a-z]{3}", t)),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(__import__("json").loads(t), SCHEMA) is None),
    ({"guided_grammar": 'root ::= "a" ("b" | "c") "d"'}, lambda t: t in ("abd", "acd")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"structured_outputs": {"regex": "z{3}"}}, lambda t: t == "zzz"),
])
def test_vllm_structured_output_fields_on_completions(client, body, check):
    for model in ("tiny", "s2"):
        out = client.completions.create(model=model, prompt="pick", max_tokens=40, temperature=0.8, seed=3, n=2,
                                        extra_body=body)
        for choice in out.choices:
            assert choice.finish_reason == "stop" and check(choice.text), (body, choice.text)


@pytest.mark.parametrize("body, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format type must be"),
    ({"guided_json": {"type": "bogus"}}, "Invalid type"),
    ({"guided_regex": "a(b"}, "unclosed group"),
    ({"guided_grammar": "root ::= nothing"}, "nothing"),
    ({"guided_choice": []}, "non-empty list"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "set one structured output at most"),
    ({"structured_outputs": {"json": "{}", "whitespace": 1}}, "unsupported key(s) whitespace"),
])
def test_invalid_structured_outputs_are_400s_naming_the_problem(client, body, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="s0", prompt="a", max_tokens=4, extra_body=body)
    assert words in e.value.message
    assert client.completions.create(model="s0", prompt="a", max_tokens=2).choices[0].finish_reason == "length"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "weather?"}]


def check_call(call, names=("get_weather", "get_time")):
    import json

    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7 and set(args) == {"city", "days"}
    else:
        assert args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("model", ["tiny", "s4"])
def test_a_named_tool_choice_always_calls_that_function(client, model):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=model, messages=ASK, tools=[TIME, WEATHER], tool_choice=choice,
                                         max_tokens=40, temperature=0.7, seed=1)
    message = out.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1 and out.choices[0].finish_reason == "stop"
    check_call(message.tool_calls[0], ("get_weather",))


def test_tool_choice_required_streamed_and_not(client):
    for parallel in (None, False):
        out = client.chat.completions.create(model="s0", messages=ASK, tools=[TIME, WEATHER], tool_choice="required",
                                             max_tokens=200, temperature=0.9, seed=4, parallel_tool_calls=parallel)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and calls and (parallel is None or len(calls) == 1)
        for call in calls:
            check_call(call)
    args = dict(model="s0", messages=ASK, tools=[TIME, WEATHER], tool_choice="required", max_tokens=200, temperature=0,
                parallel_tool_calls=False)  # greedy on random weights could list calls until max_tokens
    plain = client.chat.completions.create(**args).choices[0].message.tool_calls
    chunks = [c for c in client.chat.completions.create(**args, stream=True) if c.choices]
    streamed = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in plain]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_parses_hermes_calls_and_keeps_the_content(client):
    """The random tiny model never writes a call by itself: a regex makes it write one in hermes format."""
    forced = r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    args = dict(model="s1", messages=ASK, tools=[TIME, WEATHER], max_tokens=120, temperature=0,
                extra_body={"structured_outputs": {"regex": forced}})
    out = client.chat.completions.create(**args)
    message = out.choices[0].message
    assert message.content == "Sure. " and out.choices[0].finish_reason == "tool_calls"  # as streamed
    assert len(message.tool_calls) == 1
    check_call(message.tool_calls[0], ("get_time",))
    chunks = [c for c in client.chat.completions.create(**args, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure. "
    streamed = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert [s.function.arguments for s in streamed] == [message.tool_calls[0].function.arguments]
    free = client.chat.completions.create(model="s1", messages=ASK, tools=[TIME], max_tokens=6, temperature=0)
    assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason == "length"


def test_a_multi_turn_tool_conversation_from_the_openai_sdk(client, server):
    """The SDK sends back the server's own tool-call message (content null, the arguments as JSON text) and
    a tool result; the template gets content "" and the arguments as an object, as vLLM gives them."""
    import json

    import httpx

    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model="s4", messages=ASK, tools=[TIME, WEATHER], tool_choice=named,
                                           max_tokens=40, temperature=0)
    said = first.choices[0].message
    assert said.content is None and len(said.tool_calls) == 1
    call = said.tool_calls[0]
    messages = [*ASK, said, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(model="s4", messages=messages, tools=[TIME, WEATHER], max_tokens=4,
                                            temperature=0)
    assert second.choices[0].message.role == "assistant" and second.choices[0].finish_reason in ("length", "stop")
    sent = [*ASK, said.model_dump(mode="json", exclude_unset=True), messages[-1]]  # as the SDK serializes it
    rendered = httpx.post(f"{server}/tokenize", json={"model": "s4", "messages": sent, "tools": [TIME, WEATHER],
                                                      "return_token_strs": True}).json()
    arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    assert "".join(rendered["token_strs"]) == f"<tools>get_time,get_weather<user>weather?<assistant>get_weather" \
                                             f"{arguments}<tool>sunny>"
    assert second.usage.prompt_tokens == rendered["count"]


@pytest.mark.parametrize("body, words", [
    ({"tools": [{"type": "function"}]}, "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name must be a non-empty string"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, 'tool_choice "required" needs tools'),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "set one structured output at most"),
])
def test_malformed_tools_are_400s(client, body, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="s0", messages=ASK, max_tokens=4, extra_body=body)
    assert words in e.value.message


def test_vllm_sampling_fields_served_equal_the_offline_engine(client, offline):
    fields = {"repetition_penalty": 1.3, "min_p": 0.05, "bad_words": ["ab"], "logit_bias": {"70": 2.5}}
    for model in ("tiny", "s3"):
        out = client.completions.create(model=model, prompt="hello", max_tokens=10, temperature=0.8, seed=7,
                                        extra_body={**fields, "ignore_eos": True})
        params = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True, repetition_penalty=1.3,
                                min_p=0.05, bad_words=("ab",), logit_bias={70: 2.5})
        ref = offline.generate("hello", params, adapters=None if model == "tiny" else model)[0]
        assert out.choices[0].text == ref.text


def test_logit_bias_min_tokens_and_bad_words_change_the_answer(client, offline):
    greedy = offline.generate("hello", SamplingParams(max_tokens=6, temperature=0), adapters="s0")[0]
    forced = client.completions.create(model="s0", prompt="hello", max_tokens=4, temperature=0,
                                       logit_bias={"70": 100})
    assert forced.choices[0].text == offline.tokenizer.decode([70]) * 4
    first = greedy.token_ids[0]
    stopped = client.completions.create(model="s0", prompt="hello", max_tokens=6, temperature=0,
                                        extra_body={"stop_token_ids": [first]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(model="s0", prompt="hello", max_tokens=6, temperature=0,
                                     extra_body={"stop_token_ids": [first], "min_tokens": 3})
    assert held.usage.completion_tokens >= 3
    banned = offline.tokenizer.decode([first])
    avoided = client.completions.create(model="s0", prompt="hello", max_tokens=6, temperature=0,
                                        extra_body={"bad_words": [banned]})
    assert banned not in avoided.choices[0].text and avoided.choices[0].text != greedy.text


def test_tokenize_detokenize_and_one_model_like_vllm(server, client, offline, files):
    import httpx

    ids = offline.tokenizer.encode("hello there")
    got = httpx.post(f"{server}/tokenize", json={"model": "s0", "prompt": "hello there"}).json()
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == MAX_LEN
    chat = httpx.post(f"{server}/tokenize", json={"model": "tiny", "messages": ASK, "return_token_strs": True}).json()
    assert chat["tokens"] == offline.engine.chat_ids(ASK) and "".join(chat["token_strs"]) == "<user>weather?>"
    assert httpx.post(f"{server}/detokenize", json={"model": "tiny", "tokens": ids}).json() == {"prompt": "hello there"}
    for path, body, status in (("/tokenize", {"model": "nope", "prompt": "a"}, 404),
                               ("/tokenize", {"model": "tiny"}, 400),
                               ("/detokenize", {"model": "tiny", "tokens": [10**6]}, 400)):
        response = httpx.post(f"{server}{path}", json=body)
        assert response.status_code == status and response.json()["error"]["message"], (path, response.text)
    assert client.models.retrieve("s2").parent == "tiny" and client.models.retrieve("tiny").id == "tiny"
    loaded = httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "org/new", "lora_path": files["runtime"]["new"]})
    assert loaded.status_code == 200, loaded.text
    assert client.models.retrieve("org/new").id == "org/new"
    lone = os.path.join(files["runtime"]["new"], "adapter_model.safetensors")  # its config the sidecar beside it
    assert httpx.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "lone", "lora_path": lone}).status_code == 200
    texts = [client.completions.create(model=m, prompt="hello", max_tokens=6, temperature=0).choices[0].text
             for m in ("org/new", "lone")]
    assert texts[0] == texts[1]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_auto_tool_choice_needs_a_template_that_declares_tools(tmp_path_factory):
    plain = make_files(tmp_path_factory)  # its chat template knows nothing of tools
    proc, url = start_server(plain, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        client = openai_client(url)
        with pytest.raises(openai.BadRequestError, match="chat template that declares tools"):
            client.chat.completions.create(model="tiny", messages=ASK, tools=[TIME], max_tokens=4)
        named = {"type": "function", "function": {"name": "get_time"}}
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=[TIME], tool_choice=named, max_tokens=40)
        assert out.choices[0].message.tool_calls[0].function.name == "get_time"
    finally:
        stop(proc)


# ---- the Responses API (server/http/responses.py), through the openai SDK's client.responses -------------------------
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in (TIME, WEATHER)]  # the Responses API's tool shape


def test_responses_answer_as_the_same_chat_streamed_and_not(client):
    chat = client.chat.completions.create(model="s2", messages=[{"role": "system", "content": "be brief"}, *ASK],
                                          max_tokens=12, temperature=0)
    out = client.responses.create(model="s2", instructions="be brief", input="weather?", max_output_tokens=12,
                                  temperature=0, metadata={"run": "7"})
    assert out.output_text == chat.choices[0].message.content and out.model == "s2" and out.metadata == {"run": "7"}
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    length = chat.choices[0].finish_reason == "length"
    assert out.status == ("incomplete" if length else "completed")
    assert (out.incomplete_details.reason if length else out.incomplete_details) == ("max_output_tokens" if length else None)
    parts = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]}]
    assert client.responses.create(model="s2", input=parts, max_output_tokens=12, temperature=0).output_text == out.output_text
    events = list(client.responses.create(model="s2", instructions="be brief", input="weather?", max_output_tokens=12,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == f"response.{out.status}"
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    assert events[-1].response.output_text == out.output_text and [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_structured_output_and_a_tool_round_trip(client):
    import json

    schema = WEATHER["function"]["parameters"]
    shaped = client.responses.create(model="s3", input="weather?", max_output_tokens=60, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "weather", "schema": schema}})
    jsonschema.validate(json.loads(shaped.output_text), schema)
    first = client.responses.create(model="s4", input="weather?", tools=FLAT_TOOLS, max_output_tokens=40, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"})
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city", "days"}
    back = [{"role": "user", "content": "weather?"}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = client.responses.create(model="s4", input=back, tools=FLAT_TOOLS, max_output_tokens=4, temperature=0)
    said = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
    chat = client.chat.completions.create(model="s4", messages=[*ASK, said, {"role": "tool", "tool_call_id": call.call_id,
                                                                           "content": "sunny"}],
                                          tools=[TIME, WEATHER], max_tokens=4, temperature=0)
    assert second.output_text == chat.choices[0].message.content and second.usage.input_tokens == chat.usage.prompt_tokens
    events = list(client.responses.create(model="s4", input="weather?", tools=FLAT_TOOLS, max_output_tokens=40,
                                          temperature=0, tool_choice={"type": "function", "name": "get_weather"},
                                          stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments] and events[-1].response.output[0].name == "get_weather"
    items = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item.")]
    assert items == [("response.output_item.added", 0), ("response.output_item.done", 0)]


def test_a_streamed_message_item_is_added_and_done_at_its_own_index(client):
    events = list(client.responses.create(model="s2", input="weather?", max_output_tokens=6, temperature=0,
                                          stream=True))
    items = [(e.type, e.output_index, e.item.id) for e in events if e.type.startswith("response.output_item.")]
    assert [i[:2] for i in items] == [("response.output_item.added", 0), ("response.output_item.done", 0)]
    assert items[0][2] == items[1][2] == events[-1].response.output[0].id


def test_responses_logprobs_equal_the_chat_ones_streamed_and_not(client):
    chat = client.chat.completions.create(model="s1", messages=ASK, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2)
    want = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in chat.choices[0].logprobs.content]
    args = dict(model="s1", input="weather?", max_output_tokens=5, temperature=0,
                include=["message.output_text.logprobs"], top_logprobs=2)
    got = client.responses.create(**args).output[0].content[0].logprobs
    assert [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in got] == want
    events = list(client.responses.create(**args, stream=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [(t.token, t.logprob) for t in streamed] == [w[:2] for w in want]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [(t.token, t.logprob) for t in done.logprobs] == [w[:2] for w in want]


@pytest.mark.parametrize("kwargs, words", [
    ({"top_logprobs": 2}, "top_logprobs: logprobs are returned with include"),
    ({"include": ["reasoning.encrypted_content"]}, "include: 'reasoning.encrypted_content' not implemented"),
    ({"store": True}, "store: responses are not stored"),
    ({"previous_response_id": "resp_1"}, "previous_response_id: this server keeps no responses"),
    ({"background": True}, "background: this server keeps no responses"),
    ({"reasoning": {"effort": "low"}}, "reasoning: not implemented"),
    ({"extra_body": {"surprise": 1}}, "surprise: not implemented"),
    ({"tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_text or output_text"),
])
def test_responses_fields_needing_state_or_not_implemented_are_400s_naming_them(client, kwargs, words):
    with pytest.raises(openai.BadRequestError, match=words):
        client.responses.create(**{"model": "s0", "input": "hi", "max_output_tokens": 2, **kwargs})


def test_an_openai_agents_sdk_agent_calls_a_tool_then_answers(server):
    """The openai-agents SDK (its Responses model, as it runs by default) with an adapter: the first turn must call
    the tool (tool_choice "required"), the SDK runs it and sends its output back; the second turn answers."""
    pytest.importorskip("agents")
    from typing import Literal

    import pydantic
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:  # (a free string: a random model may never end it)
        """The weather in a city."""
        asked.append(city)
        return "sunny"

    class Report(pydantic.BaseModel):  # a structured final answer: the grammar ends it (a random model rarely stops)
        sunny: bool

    model = OpenAIResponsesModel(model="s4", openai_client=openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="-"))
    agent = Agent(name="weather", instructions="answer", tools=[get_weather], model=model, output_type=Report,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                                               temperature=0))
    result = Runner.run_sync(agent, "weather?", max_turns=2)
    assert len(asked) == 1 and len(result.raw_responses) == 2
    assert result.raw_responses[0].output[0].type == "function_call"
    assert isinstance(result.final_output, Report)


# ---- embeddings per adapter ----------------------------------------------------------------------------------
def test_embeddings_per_adapter_equal_the_offline_engine_as_floats_and_base64(client, offline):
    import base64
    import struct

    texts = ["weather?", "a longer sentence about kites"]
    for model, adapter in (("s0", "s0"), ("s2", "s2"), ("tiny", None)):
        out = client.embeddings.create(model=model, input=texts)
        expected = [o.embedding for o in offline.embed(texts, adapters=adapter)]
        assert [d.index for d in out.data] == [0, 1] and out.model == model
        for got, want in zip(out.data, expected):
            assert max(abs(a - b) for a, b in zip(got.embedding, want)) < 1e-5
        assert out.usage.prompt_tokens == sum(len(offline.tokenizer.encode(t)) for t in texts)
    mean = client.embeddings.create(model="s1", input="weather?", extra_body={"pooling": "mean", "normalize": False})
    want = offline.embed(["weather?"], adapters="s1", pooling="mean", normalize=False)[0].embedding
    assert max(abs(a - b) for a, b in zip(mean.data[0].embedding, want)) < 1e-4
    raw = client.with_raw_response.embeddings.create(model="s0", input="weather?", encoding_format="base64").http_response
    packed = base64.b64decode(raw.json()["data"][0]["embedding"])
    floats, want = struct.unpack(f"<{len(packed) // 4}f", packed), offline.embed(["weather?"], adapters="s0")[0].embedding
    assert len(floats) == len(want) and max(abs(a - b) for a, b in zip(floats, want)) < 1e-5


@pytest.mark.parametrize("kwargs, words", [
    ({"dimensions": 8}, "dimensions: this model's embeddings have"),
    ({"extra_body": {"pooling": "cls"}}, "pooling"),
    ({"extra_body": {"temperature": 0}}, "temperature"),
    ({"input": []}, "input must not be empty"),
])
def test_embedding_fields_the_server_cannot_honour_are_400s(client, kwargs, words):
    with pytest.raises(openai.BadRequestError, match=words):
        client.embeddings.create(**{"model": "s0", "input": "x", **kwargs})
