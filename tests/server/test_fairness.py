"""One client's heavy requests — long prompts with prompt logprobs, n = 4, echo with logprobs — must not hold
another client's ordinary requests. With chunked prefill (the default) and the step bound (a step at most ~2x a
decode step), the bystander's median latency over 20 requests stays within 4x of the idle server's median
over 20 before and 20 after, and its p95 within 7x (here 1.4-3.6x and 1.9-5.7x over a dozen runs; bound off
4.8-6.7x and 6.7-10x; unchunked ~25x). Against the idle median: on 2 cores shared by the engine, the front end
and this client, one idle sample or one spike moves a p95 of 10 or 20 by half the margin. (A model large
enough that a long prompt's prefill costs real time here; see benchmarks/README.md for the default model.)"""
import concurrent.futures
import statistics
import time

import httpx
import pytest

from support.serving import NO_KEEPALIVE, make_files, start_server, stop

LONG = 1500


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    files = make_files(tmp_path_factory, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    proc, url = start_server(files, "--max-model-len", "2048")
    yield url
    stop(proc)


def bystander(client: httpx.Client, url: str) -> float:
    started = time.monotonic()
    response = client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "how are you", "max_tokens": 8,
                                                        "temperature": 0, "ignore_eos": True}, timeout=120)
    assert response.status_code == 200, response.text
    return time.monotonic() - started


def heavy(url: str, i: int) -> int:
    prompt = [(7 * i + j) % 90 + 3 for j in range(LONG)]
    body = ({"prompt": prompt, "n": 4, "prompt_logprobs": 5, "max_tokens": 16} if i % 2 else
            {"prompt": prompt, "echo": True, "logprobs": 5, "max_tokens": 8})
    with httpx.Client(limits=NO_KEEPALIVE, timeout=300) as client:
        return client.post(f"{url}/v1/completions", json={"model": "tiny", "temperature": 0, **body}).status_code


def test_heavy_requests_keep_a_bystanders_latency_within_4x_of_idle(server):
    client = httpx.Client()  # one connection, as a chat client keeps: its own overhead is not what is measured
    bystander(client, server)  # warm
    idle = [bystander(client, server) for _ in range(20)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        load = [pool.submit(heavy, server, i) for i in range(6)]
        time.sleep(0.3)  # the heavy prompts are queued and prefilling
        during = []
        while not all(f.done() for f in load) and len(during) < 20:
            during.append(bystander(client, server))
            time.sleep(0.05)
        assert [f.result() for f in load] == [200] * 6
    idle = statistics.median(idle + [bystander(client, server) for _ in range(20)])  # before and after: this
    # machine's speed drifts (the same idle request took 18-36 ms between runs), so the baseline spans the load
    during.sort()
    p50, p95 = statistics.median(during), during[int(0.95 * (len(during) - 1))]
    print(f"\nbystander latency: idle p50 {idle * 1000:.0f} ms; beside heavy requests p50 {p50 * 1000:.0f} ms, "
          f"p95 {p95 * 1000:.0f} ms, worst {during[-1] * 1000:.0f} ms of {len(during)}")
    assert len(during) >= 10 and p50 <= 4 * idle and p95 <= 7 * idle
