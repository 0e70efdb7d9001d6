"""`loramux run-batch`: an OpenAI batch file whose lines name different adapters and endpoints, answered by a
server of the given flags; the answers equal the offline engine's; a run stopped part way (its output cut, its
last line torn) resumes with the lines it lacks; a bad file stops before anything runs, naming the line."""
import json
import subprocess
import sys

import pytest

from loramux import SamplingParams
from support.serving import MAX_MODEL_LEN, make_files, offline_llm

pytestmark = pytest.mark.slow
PROMPT = "kites"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory)


def run_batch(files, source, target) -> subprocess.CompletedProcess:
    modules = [f"{name}={path}" for name, path in files["served"].items()]
    cmd = [sys.executable, "-m", "loramux", "run-batch", "-i", str(source), "-o", str(target), "--model", files["model"],
           "--dtype", "float32", "--max-loras", "4", "--max-lora-rank", "32", "--max-model-len", str(MAX_MODEL_LEN),
           "--served-model-name", "tiny", "--log-level", "warning", "--lora-modules", *modules]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def batch_lines() -> list[dict]:
    greedy = {"max_tokens": 6, "temperature": 0}
    return [line("c0", "/v1/completions", {"model": "s0", "prompt": PROMPT, **greedy}),
            line("c1", "/v1/completions", {"model": "s1", "prompt": PROMPT, **greedy}),
            line("base", "/v1/completions", {"model": "tiny", "prompt": PROMPT, **greedy}),
            line("chat", "/v1/chat/completions", {"model": "s2", "messages": [{"role": "user", "content": "hi"}],
                                                  **greedy}),
            line("resp", "/v1/responses", {"model": "s3", "input": "hi", "max_output_tokens": 6, "temperature": 0}),
            line("emb", "/v1/embeddings", {"model": "s4", "input": [PROMPT, "hi"]}),
            line("bad", "/v1/completions", {"model": "s0", "prompt": PROMPT, "max_tokens": -1})]


def test_a_mixed_batch_is_answered_and_resumes_after_an_interruption(files, tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in batch_lines()))
    first = run_batch(files, source, target)
    assert first.returncode == 0, first.stderr[-3000:]
    out = {r["custom_id"]: r for r in map(json.loads, target.read_text().splitlines())}
    assert set(out) == {x["custom_id"] for x in batch_lines()}
    llm = offline_llm(files, files["served"])
    params = SamplingParams(max_tokens=6, temperature=0)
    for custom_id, adapter in (("c0", "s0"), ("c1", "s1"), ("base", None)):
        expected = llm.generate([PROMPT], params, adapters=adapter, use_tqdm=False)[0].text
        assert out[custom_id]["response"]["status_code"] == 200
        assert out[custom_id]["response"]["body"]["choices"][0]["text"] == expected
    assert out["chat"]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert out["resp"]["response"]["body"]["object"] == "response"
    vectors = [d["embedding"] for d in out["emb"]["response"]["body"]["data"]]
    offline = [o.embedding for o in llm.embed([PROMPT, "hi"], adapters="s4")]
    assert max(abs(a - b) for v, w in zip(vectors, offline, strict=True) for a, b in zip(v, w, strict=True)) < 1e-5
    assert out["bad"]["response"]["status_code"] == 400 and "max_tokens" in json.dumps(out["bad"]["response"]["body"])
    kept = target.read_text().splitlines()[:3]  # the run stopped after three answers, mid-way through a fourth
    target.write_text("".join(k + "\n" for k in kept) + '{"id": "batch_req_torn", "custom_')
    second = run_batch(files, source, target)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "3 answered already, 4 to run" in second.stderr
    lines = target.read_text().splitlines()
    assert lines[:3] == kept and len(lines) == 7
    again = {r["custom_id"]: r for r in map(json.loads, lines)}
    assert set(again) == set(out) and again["c0"]["response"]["body"]["choices"] == out["c0"]["response"]["body"]["choices"]


@pytest.mark.parametrize("text, words", [
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n' * 2, "line 2: custom_id 'a' is used twice"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/files", "body": {}}\n', "line 1: method must be POST and url"),
    ('not json\n', "line 1: not JSON"),
])
def test_a_bad_batch_file_stops_before_anything_runs(files, tmp_path, text, words):
    source = tmp_path / "in.jsonl"
    source.write_text(text)
    result = run_batch(files, source, tmp_path / "out.jsonl")
    assert result.returncode != 0 and words in result.stderr and not (tmp_path / "out.jsonl").exists()


def test_an_inherited_listening_socket_is_served_on_and_anything_else_is_refused():
    """run-batch opens its server's socket and hands it over (--listen-fd): no other process can take the port
    in between, as one did when the server was told a port picked earlier."""
    import os
    import socket

    from loramux.config import ServerConfig
    from loramux.server.supervisor import listening_socket

    with socket.create_server(("127.0.0.1", 0)) as listening:
        got = listening_socket(ServerConfig(listen_fd=listening.fileno()))
        assert got.getsockname() == listening.getsockname()
        got.detach()  # (the fd is listening's to close)
    with socket.socket() as unbound:
        with pytest.raises(ValueError, match="not a listening TCP socket"):
            listening_socket(ServerConfig(listen_fd=unbound.fileno()))
        assert unbound.fileno() >= 0  # left open: still the caller's
    read, write = os.pipe()
    try:
        with pytest.raises(ValueError, match="not an open socket"):
            listening_socket(ServerConfig(listen_fd=read))
    finally:
        os.close(read), os.close(write)
