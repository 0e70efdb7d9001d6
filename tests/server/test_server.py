"""`loramux serve` as users run it (a subprocess on a loopback port), driven by the official openai
client and httpx. Greedy answers are checked against the offline LLM on the same weights."""
import concurrent.futures
import os
import shutil
import signal
import threading
import time

import httpx
import openai
import pytest

from conftest import save_peft_adapter
from loramux import LoRAConfig, SamplingParams
from loramux.llm import LLM
from support.serving import (CHAT_TEMPLATE, MAX_MODEL_LEN, NO_KEEPALIVE, engine_pid, make_files, metric, openai_client,
                     paused_while_running, start_server, stop, wait_until)

KEY = "test-key"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory)


@pytest.fixture(scope="module")
def server(files):
    proc, url = start_server(files, "--api-key", KEY)
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60, limits=NO_KEEPALIVE) as c:
        yield c


@pytest.fixture(scope="module")
def offline(files):
    """The oracle: the offline LLM on the same checkpoint and adapters, one request at a time."""
    llm = LLM(model=files["model"], lora=LoRAConfig(max_loras=4, max_cpu_loras=16, max_lora_rank=32), dtype="float32",
              kv_cache_memory=2**23, max_model_len=MAX_MODEL_LEN)
    llm.tokenizer.chat_template = CHAT_TEMPLATE
    for name, path in {**files["served"], **files["runtime"]}.items():
        assert llm.load_adapter(f"{name}={path}")

    def alone(prompt, adapter, max_tokens=8, chat=False, **sampling):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, **sampling)
        run = llm.chat if chat else llm.generate
        return run(prompt, params, adapters=adapter, use_tqdm=False)[0].text

    return alone


@pytest.mark.parametrize("model", ["tiny", "s0", "s3"])
def test_completions_and_chat_streamed_and_not(client, offline, model):
    adapter = None if model == "tiny" else model
    out = client.completions.create(model=model, prompt="hello there", max_tokens=8, temperature=0)
    assert out.choices[0].text == offline("hello there", adapter)
    assert out.usage.prompt_tokens == len("hello there") and out.usage.completion_tokens == 8
    streamed = client.completions.create(model=model, prompt="hello there", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == offline(messages, adapter, chat=True)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8


def test_n_seed_and_stop(client, offline):
    out = client.completions.create(model="s1", prompt="abc", max_tokens=6, n=3, temperature=1.0, seed=5)
    again = client.completions.create(model="s1", prompt="abc", max_tokens=6, n=3, temperature=1.0, seed=5)
    assert [c.text for c in out.choices] == [c.text for c in again.choices] and len(out.choices) == 3
    full = offline("abc", "s1", max_tokens=8)
    stopped = client.completions.create(model="s1", prompt="abc", max_tokens=8, temperature=0, stop=[full[3:5]])
    assert stopped.choices[0].text == full[: full.index(full[3:5])] and stopped.choices[0].finish_reason == "stop"


def test_models_lists_base_and_adapters_like_vllm(client):
    cards = {m.id: m for m in client.models.list().data}
    assert cards["tiny"].parent is None
    assert cards["s2"].parent == "tiny" and cards["s2"].root.endswith("s2")


def test_unknown_model_is_404_with_openai_error(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert "nope" in err.value.message


def test_auth_limits_and_health(server, http):
    assert httpx.get(f"{server}/health").status_code == 200  # no key needed
    assert httpx.get(f"{server}/v1/models").status_code == 401
    assert http.get("/version").json()["version"]
    cases = [
        ({"model": "tiny", "prompt": "x", "n": 99}, "n must be between"),
        ({"model": "tiny", "prompt": "x", "stop": list("abcdef")}, "at most 4 stop"),
        ({"model": "tiny", "prompt": "x" * 60, "max_tokens": 10}, "maximum context length is 64"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature"),
        ({"model": "tiny"}, "prompt"),
    ]
    for body, words in cases:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400 and words in response.json()["error"]["message"], body
    json_type = {"content-type": "application/json"}
    big = http.post("/v1/completions", content=b"{" + b" " * (2 << 20) + b"}", headers=json_type)
    assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
    # no Content-Length (chunked): counted as it arrives; just over the default 1 MiB, so that the client has
    # sent it all when the answer comes
    chunked = http.post("/v1/completions", content=(b" " * (64 << 10) for _ in range(17)), headers=json_type)
    assert chunked.status_code == 413 and "limit" in chunked.json()["error"]["message"]
    assert "transfer-encoding" in chunked.request.headers and "content-length" not in chunked.request.headers


def test_runtime_load_use_unload_reload(files, http, client, offline):
    allowed = files["allowed"]
    load = http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": f"{allowed}/new"})
    assert load.status_code == 200, load.text
    first = client.completions.create(model="fresh", prompt="hey", max_tokens=8, temperature=0).choices[0].text
    assert first == offline("hey", "new")
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="fresh", prompt="hey", max_tokens=8)
    # Same name, new weights: the old ones are never served again.
    shutil.rmtree(f"{allowed}/swap", ignore_errors=True)
    shutil.copytree(f"{allowed}/v2", f"{allowed}/swap")
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": f"{allowed}/swap"}).status_code == 200
    second = client.completions.create(model="fresh", prompt="hey", max_tokens=8, temperature=0).choices[0].text
    assert second == offline("hey", "v2") and second != first
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"}).status_code == 200


def test_a_dora_adapter_loads_at_runtime_and_answers_as_offline(files, http, client):
    """DoRA through the server's own load route, in a batch beside a plain adapter: each answer the offline
    engine's (held to HF + PEFT in tests/engine/test_dora.py)."""
    from conftest import tiny_llama
    from engine.test_dora import save_dora_adapter
    from support.serving import offline_llm

    path = save_dora_adapter(tiny_llama(), os.path.join(files["allowed"], "dora"), seed=11)
    load = http.post("/v1/load_lora_adapter", json={"lora_name": "dora", "lora_path": path})
    assert load.status_code == 200, load.text
    try:
        llm = offline_llm(files, {"dora": path, "s0": files["served"]["s0"]})
        params = SamplingParams(max_tokens=8, temperature=0)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            served = list(pool.map(lambda m: client.completions.create(model=m, prompt="hey", max_tokens=8,
                                                                       temperature=0).choices[0].text, ["dora", "s0"]))
        assert served == [llm.generate("hey", params, adapters=m, use_tqdm=False)[0].text for m in ("dora", "s0")]
    finally:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "dora"}).status_code == 200


def test_an_alora_intrinsic_after_a_base_model_turn_reads_its_blocks_from_the_cache(files, http, client):
    """An aLoRA adapter loaded at runtime: asked (token ids as the prompt) after the base model answered the same
    conversation, it reads the conversation's blocks from the cache and answers as the offline engine does (held
    to PEFT in tests/engine/test_alora.py)."""
    from conftest import tiny_llama
    from support.serving import offline_llm

    path = save_peft_adapter(tiny_llama(), os.path.join(files["allowed"], "intrinsic"), seed=13, r=8,
                             alora_invocation_tokens=[17, 42, 99], task_type="CAUSAL_LM")
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "intrinsic", "lora_path": path}).status_code == 200
    try:
        conversation = [(7 * i + 3) % 128 for i in range(40)]  # 2 full blocks of 16 before its last token, and more
        base = client.completions.create(model="tiny", prompt=conversation, max_tokens=2, temperature=0)
        asked = client.completions.create(model="intrinsic", prompt=conversation + [17, 42, 99, 5], max_tokens=6,
                                          temperature=0)
        assert base.usage.prompt_tokens_details.cached_tokens == 0
        assert asked.usage.prompt_tokens_details.cached_tokens == 32
        llm = offline_llm(files, {"intrinsic": path})
        expected = llm.generate([conversation + [17, 42, 99, 5]], SamplingParams(max_tokens=6, temperature=0),
                                adapters="intrinsic", use_tqdm=False)[0].text
        assert asked.choices[0].text == expected
    finally:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "intrinsic"}).status_code == 200


def test_a_weighted_combination_of_adapters_in_one_request(files, http, client):
    """`adapters` beside `model` (the base model's name): the offline engine's answer for the same combination
    (held to PEFT's add_weighted_adapter in tests/engine/test_combinations.py); what cannot be combined, a part
    nobody has included, is a 400."""
    from support.serving import offline_llm

    combo = {"s1": 0.5, "s0": 1.0}
    llm = offline_llm(files, {name: files["served"][name] for name in combo})
    expected = llm.generate("hey", SamplingParams(max_tokens=8, temperature=0), adapters=combo, use_tqdm=False)[0].text
    answer = client.completions.create(model="tiny", prompt="hey", max_tokens=8, temperature=0,
                                       extra_body={"adapters": combo})
    assert answer.choices[0].text == expected and answer.choices[0].text != llm.generate("hey", SamplingParams(
        max_tokens=8, temperature=0), adapters="s0", use_tqdm=False)[0].text
    cases = [("s0", {"s1": 1.0}, 400, "names the base model"), ("tiny", {"ghost": 1.0}, 400, "ghost"),
             ("tiny", {"s0": 1e6}, 400, "at most 100"), ("tiny", {"s3": 1.0, "s4": 1.0}, 400, "above max_lora_rank=32")]
    for model, adapters, status, words in cases:
        response = http.post("/v1/completions", json={"model": model, "prompt": "hey", "max_tokens": 2,
                                                      "adapters": adapters})
        assert response.status_code == status and words in response.text, (adapters, response.text)
    text = http.get("/metrics").text  # one label for every combination, whatever its weights
    assert 'model="combination"' in text and 'model="s1*0.5&s0*1.0"' not in text


def test_admin_error_codes(files, http):
    allowed, root = files["allowed"], files["root"]
    os.symlink(files["served"]["s0"], f"{allowed}/escape")
    os.makedirs(f"{allowed}/pickled", exist_ok=True)
    shutil.copy(f"{allowed}/new/adapter_config.json", f"{allowed}/pickled/")
    open(f"{allowed}/pickled/adapter_model.bin", "wb").close()
    cases = [
        ({"lora_name": "s0", "lora_path": f"{allowed}/new"}, 400, "already been loaded"),
        ({"lora_name": "x", "lora_path": f"{allowed}/missing"}, 400, "does not exist"),
        ({"lora_name": "x", "lora_path": str(root / "s1")}, 400, "outside the allowed"),
        ({"lora_name": "x", "lora_path": f"{allowed}/../s1"}, 400, "outside the allowed"),
        ({"lora_name": "x", "lora_path": f"{allowed}/escape"}, 400, "outside the allowed"),
        ({"lora_name": "x", "lora_path": f"{allowed}/pickled"}, 400, "only safetensors"),
        ({"lora_name": "x", "lora_path": f"{allowed}/huge"}, 400, "above max_lora_rank=32"),
    ]
    for body, status, words in cases:
        response = http.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == status and words in response.json()["error"]["message"], (body, response.text)
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "ghost"})
    assert response.status_code == 404 and "ghost" in response.json()["error"]["message"]
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "s0", "lora_int_id": 1})  # vLLM's id: refused
    assert response.status_code == 400 and "lora_int_id" in response.json()["error"]["message"]
    assert "s0" in [m["id"] for m in http.get("/v1/models").json()["data"]]  # and nothing was unloaded


def test_32_concurrent_requests_with_load_and_unload_in_the_middle(files, http, client, offline):
    """32 clients keep requests going back to back; the admin calls are made once the first answer is
    back and the clients stop only after them, so requests are in flight on both sides of the calls
    whatever the speed of the machine (a fixed sleep was not: 32 tiny requests can finish in 0.1 s)."""
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "tmp", "lora_path": f"{files['allowed']}/other"}).status_code == 200
    models = ["tiny", "s0", "s1", "s2", "s3"]
    jobs = [(models[i % 5], f"q{i} says") for i in range(32)]
    first_answer, admin_done = threading.Event(), threading.Event()

    def ask_until_admin_done(job):
        model, prompt = job
        answers = []  # (start, end, text)
        while not admin_done.is_set() or len(answers) < 2:
            start = time.monotonic()
            text = client.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0).choices[0].text
            answers.append((start, time.monotonic(), text))
            first_answer.set()
        return answers

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(ask_until_admin_done, job) for job in jobs]
        assert first_answer.wait(120)
        calls_start = time.monotonic()
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "mid", "lora_path": f"{files['allowed']}/new"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "tmp"}).status_code == 200
        calls_end = time.monotonic()
        admin_done.set()
        runs = [f.result(timeout=120) for f in futures]
    spans = [(start, end) for answers in runs for start, end, _ in answers]
    assert any(start < calls_start and end > calls_end for start, end in spans), "no request spanned the admin calls"
    for (model, prompt), answers in zip(jobs, runs):
        expected = offline(prompt, None if model == "tiny" else model, max_tokens=48)
        assert [text for _, _, text in answers] == [expected] * len(answers), (model, prompt)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mid"}).status_code == 200


def test_unloading_an_adapter_in_use_keeps_its_running_request_exact(http, client, offline):
    """End to end: the running request finishes with the right weights; the adapter is gone after.
    (That the unload waits for it is checked step by step in test_engine_core_proc.py: over SSE the client
    may still be reading buffered chunks when the engine has finished and unloaded.)"""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = iter(client.completions.create(model="s4", prompt="w", max_tokens=48, temperature=0, stream=True))
        text = next(stream).choices[0].text  # the request is running now
        unload = pool.submit(http.post, "/v1/unload_lora_adapter", json={"lora_name": "s4"})
        text += "".join(chunk.choices[0].text for chunk in stream)
        assert unload.result(timeout=60).status_code == 200
    assert text == offline("w", "s4", max_tokens=48)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="s4", prompt="x", max_tokens=2)


def test_metrics_in_prometheus_format(files, http, client):
    client.completions.create(model="s0", prompt="m", max_tokens=2)
    load = http.post("/v1/load_lora_adapter", json={"lora_name": "timed", "lora_path": f"{files['allowed']}/new"})
    assert load.status_code == 200 and http.post("/v1/unload_lora_adapter", json={"lora_name": "timed"}).status_code == 200
    text = http.get("/metrics").text
    for name in ("loramux:request_success_total", "loramux:generation_tokens_total",
                 "loramux:time_to_first_token_seconds_bucket", "loramux:num_requests_running",
                 'loramux:lora_requests_info{max_lora="4"', "loramux:lora_loads_total",
                 'loramux:lora_adapter_resident{adapter="s0",pinned="false",tier="device"} 1.0',
                 'loramux:lora_adapter_resident{adapter="s0",pinned="false",tier="host"} 1.0',
                 'loramux:lora_load_seconds_count{source="runtime"}',
                 'loramux:lora_load_seconds_count{source="registered"} 5.0'):  # the five given at start
        assert name in text, name


def test_a_quantized_base_serves_adapters_and_reports_its_weight_bytes(files, server, http):
    proc, url = start_server(files, "--quantization", "int4", "--quantization-group-size", "32")
    try:
        plain, quantized = metric(server, "loramux:model_weight_bytes", http.headers), metric(url, "loramux:model_weight_bytes")
        assert 0 < quantized < plain * 0.75  # the head stays plain; every other projection is int4
        body = {"model": "s1", "prompt": "quant", "max_tokens": 8, "temperature": 0}
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        llm = LLM(model=files["model"], lora=LoRAConfig(max_loras=1, max_lora_rank=32), dtype="float32",
                  quantization="int4", quantization_group_size=32, kv_cache_memory=2**22, max_model_len=MAX_MODEL_LEN)
        assert llm.load_adapter("s1", files["served"]["s1"])
        assert text == llm.generate("quant", SamplingParams(max_tokens=8, temperature=0), adapters="s1")[0].text
    finally:
        stop(proc)


def test_a_dead_engine_gives_fast_503s(files):
    proc, url = start_server(files)
    try:
        os.kill(engine_pid(proc.pid), signal.SIGKILL)
        deadline = time.monotonic() + 10  # the server notices the death on its pipe, not at once
        while httpx.get(f"{url}/health").status_code != 503:
            assert time.monotonic() < deadline, "/health still says healthy 10 s after the engine died"
            time.sleep(0.05)
        # Refused at once, not after waiting on an engine: the answer names the engine's state as the front end
        # saw it on arrival (not running, exited, or restarting).
        response = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=60)
        message = response.json()["error"]["message"]
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        states = ("process is not running", "process exited", "is restarting")
        assert message.startswith("The engine is not available: the engine ") and any(s in message for s in states)
    finally:
        stop(proc)


COMPLETION_CASES = [
    ({"prompt": []}, "prompt must not be empty"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"prompt": "x", "seed": 2**64}, "seed must be an integer in"),
    ({"prompt": "x", "seed": -2**63 - 1}, "seed must be an integer in"),
    ({"prompt": "x", "temperature": "NaN"}, "temperature: Input should be a valid number"),  # no string coercion
    ({"prompt": [5, 999999]}, "prompt token ids must be integers in [0, 128)"),
    ({"prompt": "x", "stop": [""]}, "stop must be non-empty strings"),
    ({"prompt": ["a"] * 10, "n": 8}, "at most 64 per request"),
    ({"prompt": "x", "top_p": 0}, "top_p must be in (0, 1]"),
    ({"prompt": "x", "presence_penalty": 9}, "presence_penalty must be in [-2, 2]"),
]
CHAT_CASES = [
    ({"messages": [{"role": "banana", "content": "x"}]}, "got 'banana'"),
    ({"messages": [{"content": "x"}]}, "messages[0].role must be one of"),
    ({"messages": [{"role": "user"}]}, "has no 'content'"),
    ({"messages": [{"role": "user", "content": 5}]}, "a list of text parts, got int"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     "only text parts"),
    ({"messages": []}, "messages"),
]
RAW_CASES = [  # bodies json= cannot write
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": 1e400}', 400, "temperature must be a finite"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}', 400, "not valid Unicode"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "not valid Unicode"),
    ("/v1/completions", b"{not json", 400, "invalid request"),
    ("/v1/completions", b"[]", 400, "invalid request"),
    ("/v1/load_lora_adapter", b'{"lora_name": "x=/elsewhere/e", "lora_path": "/tmp"}', 400, "invalid adapter name"),
    ("/v1/load_lora_adapter", b'{"lora_name": "ok", "lora_path": "/tmp/a\\u0000b"}', 400, "NUL byte"),
]


def test_hostile_requests_get_a_400_naming_the_cause_and_change_nothing(http, client, offline):
    before = client.completions.create(model="s2", prompt="steady", max_tokens=8, temperature=0).choices[0].text
    for body, words in COMPLETION_CASES:
        response = http.post("/v1/completions", json={"model": "tiny", **body})
        assert response.status_code == 400 and words in response.json()["error"]["message"], (body, response.text)
    for body, words in CHAT_CASES:
        response = http.post("/v1/chat/completions", json={"model": "s0", **body})
        assert response.status_code == 400 and words in response.json()["error"]["message"], (body, response.text)
    for path, raw, status, words in RAW_CASES:
        response = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert response.status_code == status and words in response.json()["error"]["message"], (raw, response.text)
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        response = http.request(method, path)
        assert response.status_code == status and response.json()["error"]["message"], (path, response.text)
    assert httpx.get(f"{http.base_url}/health").status_code == 200
    assert client.completions.create(model="s2", prompt="steady", max_tokens=8, temperature=0).choices[0].text == before


def test_what_users_send_that_used_to_fail_is_served(client, offline):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    out = client.chat.completions.create(model="s1", messages=parts, max_tokens=8, temperature=0)
    assert out.choices[0].message.content == offline([{"role": "user", "content": "hi"}], "s1", chat=True)
    tiny_t = client.completions.create(model="s1", prompt="ab", max_tokens=8, temperature=1e-40).choices[0].text
    assert tiny_t == offline("ab", "s1")  # below 1e-5: greedy (was NaN probabilities and a dead engine)
    seeded = client.completions.create(model="s1", prompt="ab", max_tokens=4, n=2, seed=2**63 - 1)
    assert len(seeded.choices) == 2  # seed + 1 wraps instead of overflowing
    default = client.completions.create(model="s1", prompt="ab", max_tokens=None, temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # null max_tokens: OpenAI's default


def test_streamed_and_plain_responses_agree_with_stop_strings_and_n(client, offline):
    full = offline("pq", "s3", max_tokens=12)
    stop = full[4:6]
    kwargs = dict(model="s3", prompt="pq", max_tokens=12, temperature=0, stop=[stop], n=2)
    plain = client.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    reasons = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert [c.text for c in plain.choices] == [texts[0], texts[1]] == [full[: full.index(stop)]] * 2
    assert reasons == {0: "stop", 1: "stop"} and all(c.finish_reason == "stop" for c in plain.choices)


@pytest.mark.parametrize("inplace", [True, False])
def test_hot_swaps_under_traffic_never_serve_a_mix(files, http, client, offline, inplace):
    """3 names swap between two weight sets while 8 clients send greedy requests: every answer is the old
    weights' or the new weights' answer. In place (load_inplace) there is no gap: no request gets a 404."""
    allowed = files["allowed"]
    sets = {f"h{i}": (a, b) for i, (a, b) in enumerate([("new", "other"), ("other", "v2"), ("v2", "new")])}
    for name, (first, _) in sets.items():
        assert http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"{allowed}/{first}"}).status_code == 200
    answers = {(w, p): offline(p, w, max_tokens=24) for w in ("new", "other", "v2") for p in ("a1", "b2")}
    done, results = threading.Event(), []

    def ask(i):
        while not done.is_set():
            name, prompt = f"h{i % 3}", ("a1", "b2")[i % 2]
            try:
                text = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
            except openai.NotFoundError:
                results.append((name, prompt, None))
                continue
            results.append((name, prompt, text))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i) for i in range(8)]
        for swap in range(6):
            for name, pair in sets.items():
                path = f"{allowed}/{pair[(swap + 1) % 2]}"
                if inplace:
                    response = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path,
                                                                        "load_inplace": True})
                else:
                    assert http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
                    response = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
                assert response.status_code == 200, response.text
            seen = len(results)
            deadline = time.monotonic() + 60
            while len(results) < seen + 8 and time.monotonic() < deadline:  # traffic between every two swaps
                time.sleep(0.01)
        done.set()
        for f in futures:
            f.result(timeout=120)
    assert len(results) >= 6 * 8
    print(f"\nhot swap ({'in place' if inplace else 'unload + load'}): 18 swaps, {len(results)} answers, "
          f"{sum(t is None for *_, t in results)} got 404")
    for name, prompt, text in results:
        if text is None:
            assert not inplace, f"{name} was unavailable during an in-place reload"
            continue
        assert text in {answers[w, prompt] for w in sets[name]}, (name, prompt, text)
    for name in sets:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200


def test_the_hostile_adapter_corpus_gets_400s_and_changes_nothing(files, http, client):
    from support.hostile_adapters import BAD_NAMES, build_corpus

    good = files["runtime"]["new"]
    cases = build_corpus(good, os.path.join(files["allowed"], "hostile"), str(files["root"] / "outside"))
    prompts = ["one", "two"]
    before = [client.completions.create(model=m, prompt=p, max_tokens=10, temperature=0).choices[0].text
              for m in ("tiny", "s0", "s3") for p in prompts]
    for case in cases:
        response = http.post("/v1/load_lora_adapter", json={"lora_name": f"bad-{case.id}", "lora_path": case.path})
        assert response.status_code == 400 and case.http in response.json()["error"]["message"], (case.id, response.text)
    for name in BAD_NAMES:
        response = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": good})
        assert response.status_code == 400 and "adapter name" in response.json()["error"]["message"], name
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": good})
    assert response.status_code == 400 and "base model" in response.json()["error"]["message"]
    assert not os.path.exists(files["root"] / "outside" / "pwned")
    ids = {m.id for m in client.models.list().data}
    assert not any(i.startswith("bad-") for i in ids) and httpx.get(f"{http.base_url}/health").status_code == 200
    after = [client.completions.create(model=m, prompt=p, max_tokens=10, temperature=0).choices[0].text
             for m in ("tiny", "s0", "s3") for p in prompts]
    assert after == before
    print(f"\nhostile corpus over HTTP: {len(cases)} adapters and {len(BAD_NAMES) + 1} names refused; outputs unchanged")


def test_pin_and_unpin_routes(files, server, http, client):
    load = http.post("/v1/load_lora_adapter", json={"lora_name": "pinme", "lora_path": f"{files['allowed']}/new",
                                                    "pinned": True})
    assert load.status_code == 200
    pinned = lambda: metric(server, "loramux:num_pinned_adapters", http.headers)  # as the engine's cache says
    assert pinned() == 1
    host = metric(server, "loramux:lora_host_bytes", http.headers)
    assert host > 0 and metric(server, "loramux:lora_slot_bytes", http.headers) > 0
    assert http.post("/v1/unpin_lora_adapter", json={"lora_name": "pinme"}).status_code == 200
    assert pinned() == 0
    assert http.post("/v1/pin_lora_adapter", json={"lora_name": "pinme"}).status_code == 200
    assert pinned() == 1
    missing = http.post("/v1/pin_lora_adapter", json={"lora_name": "ghost"})
    assert missing.status_code == 404 and "ghost" in missing.json()["error"]["message"]
    assert client.completions.create(model="pinme", prompt="p", max_tokens=4, temperature=0).choices[0].text is not None
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "pinme"}).status_code == 200  # a pin ends with it
    assert pinned() == 0
    assert metric(server, "loramux:lora_host_bytes", http.headers) < host  # its weights left host memory


def test_reload_unload_load_while_the_first_version_runs_over_http(files, http, client, offline):
    """The six steps through the routes: R1 runs on x; x is reloaded in place, unloaded and loaded again (from
    another path) while R1 is paused mid-way; R2 on x gets the last load's tokens, R1 finishes on the first
    load's; x stays listed and served."""
    allowed = files["allowed"]
    load = lambda path, **kw: http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path, **kw})
    assert load(f"{allowed}/new").status_code == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream, first = paused_while_running(client, http, "x", check=lambda text: text == offline(
            "w", "new", max_tokens=56, ignore_eos=True))  # R1, frozen on x's first load
        try:
            assert load(f"{allowed}/other", load_inplace=True).status_code == 200
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
            assert load(f"{allowed}/v2").status_code == 200
            assert metric(http.base_url, "loramux:num_requests_running", http.headers) == 1  # R1, frozen
            again = load(f"{allowed}/v2")  # the same path again: a success (as MAX), nothing reloaded
            assert again.status_code == 200 and "already loaded" in again.text
            r2 = pool.submit(lambda: client.completions.create(model="x", prompt="hi", max_tokens=8, temperature=0))
        finally:
            assert http.post("/resume").json() == {"status": "resumed"}
        r1 = first + "".join(chunk.choices[0].text for chunk in stream)
        assert r2.result(timeout=60).choices[0].text == offline("hi", "v2")
    assert r1 == offline("w", "new", max_tokens=56, ignore_eos=True)
    assert "x" in [m.id for m in client.models.list().data]
    assert client.completions.create(model="x", prompt="hi", max_tokens=8, temperature=0).choices[0].text == \
        offline("hi", "v2")
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200


def test_pause_abort_and_wait_over_http(http, client, offline):
    """vLLM's /pause modes: abort ends the requests in flight (finish_reason "abort", with what they had);
    wait answers once they have finished; a request sent while paused runs after /resume. Needs the key."""
    assert httpx.post(f"{http.base_url}/pause").status_code == 401
    assert http.post("/pause", params={"mode": "later"}).status_code == 400
    chunks, first = paused_while_running(client, http, "s1")
    assert http.post("/pause", params={"mode": "abort"}).status_code == 200  # paused already: it ends now
    rest = list(chunks)
    text = first + "".join(c.choices[0].text for c in rest)
    assert rest[-1].choices[0].finish_reason == "abort"
    assert offline("w", "s1", max_tokens=56, ignore_eos=True).startswith(text)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(lambda: client.completions.create(model="s1", prompt="hi", max_tokens=8, temperature=0))
        assert http.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}  # already paused
        assert http.get("/is_paused").json() == {"is_paused": True}
        assert http.post("/resume").json() == {"status": "resumed"}
        assert held.result(timeout=60).choices[0].text == offline("hi", "s1")
    running = iter(client.completions.create(model="s2", prompt="w", max_tokens=40, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True}))
    first = next(running).choices[0].text  # in flight: the pause waits for it
    assert http.post("/pause", params={"mode": "wait"}).status_code == 200
    assert metric(http.base_url, "loramux:num_requests_running", http.headers) == 0
    rest = list(running)
    assert first + "".join(c.choices[0].text for c in rest) == offline("w", "s2", max_tokens=40, ignore_eos=True)
    assert rest[-1].choices[0].finish_reason == "length"
    assert http.post("/resume").status_code == 200 and http.get("/is_paused").json() == {"is_paused": False}


def test_a_stream_for_an_adapter_unloaded_before_it_starts_gets_404_not_200(files, http, client):
    """The same 404 a plain request gets: the stream's first output is awaited before its headers go out. The
    request is held by a pause while its adapter is unloaded, so it cannot start first."""
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": f"{files['allowed']}/new"}).status_code == 200
    assert http.post("/pause", params={"mode": "keep", "clear_cache": False}).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            stream = pool.submit(lambda: list(client.completions.create(model="y", prompt="w", max_tokens=4,
                                                                         stream=True)))
            wait_until(lambda: metric(http.base_url, "loramux:num_requests_waiting", http.headers) == 1, 60,
                       "the engine holds the request")
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "y"}).status_code == 200
        finally:
            assert http.post("/resume").status_code == 200
        with pytest.raises(openai.NotFoundError, match="y"):
            stream.result(timeout=60)


def test_cache_salt_splits_the_prefix_cache_between_clients(server, http, client):
    """vLLM's cache_salt: the same prompt and adapter share cached blocks only under the same salt (base model too)."""
    prompt = "a prompt two clients both send: " + "y" * 14  # 46 characters: 2 full blocks of 16 before the last
    for model in ("s1", "tiny"):
        def cached(salt):
            extra = {} if salt is None else {"cache_salt": salt}
            out = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
            return out.usage.prompt_tokens_details.cached_tokens

        assert cached("client-a") == 0 and cached("client-a") == 32  # a's own blocks
        assert cached("client-b") == 0 and cached(None) == 0  # not b's, nor an unsalted request's
        assert cached(None) == 32 and cached("client-b") == 32
    refused = http.post("/v1/completions", json={"model": "s1", "prompt": "x", "max_tokens": 1, "cache_salt": ""})
    assert refused.status_code == 400 and "cache_salt" in refused.json()["error"]["message"]


def test_prefix_cache_usage_metrics_and_reset(server, http, client):
    prompt = "the same system prompt, sent twice: " + "x" * 10  # 46 characters: 2 full blocks of 16 before the last
    first = client.completions.create(model="s1", prompt=prompt, max_tokens=4, temperature=0)
    hits = metric(server, "loramux:prefix_cache_hits_total", http.headers)
    second = client.completions.create(model="s1", prompt=prompt, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == 32 and second.choices[0].text == first.choices[0].text
    assert metric(server, "loramux:prefix_cache_hits_total", http.headers) == hits + 32
    assert metric(server, "loramux:prefix_cache_queries_total", http.headers) > 0
    other = client.completions.create(model="s2", prompt=prompt, max_tokens=4, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # another adapter reads nothing of s1's
    assert http.post("/reset_prefix_cache").status_code == 200
    third = client.completions.create(model="s1", prompt=prompt, max_tokens=4, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == 0
