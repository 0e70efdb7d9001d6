"""200 concurrent streaming clients over 10 adapters against `loramux serve`: every request is served or
refused with the documented backpressure (429 + Retry-After), clients that leave mid-stream free their
sequences and KV blocks, and the gauges come back to zero. (A slow end-to-end test.)"""
import asyncio
import json
import statistics
import time

import httpx
import pytest

from support.serving import make_files, metric, start_server, stop, wait_until

pytestmark = pytest.mark.slow
CLIENTS = 200
LONG = 2000  # a leaving client's request: long enough that it cannot end before its client reads two chunks


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    files = make_files(tmp_path_factory, max_position_embeddings=LONG + 16)  # (a busy client reads late)
    proc, url = start_server(files, "--max-pending-requests", "160", "--max-num-seqs", "32", "--max-model-len", str(LONG + 16))
    allowed = files["allowed"]
    for i, runtime in enumerate(["new", "other", "v2", "new", "other"]):
        response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": f"r{i}", "lora_path": f"{allowed}/{runtime}"})
        assert response.status_code == 200, response.text
    yield url
    stop(proc)


async def one_client(http: httpx.AsyncClient, i: int) -> dict:
    model = [f"s{k}" for k in range(5)] + [f"r{k}" for k in range(5)]
    leaves = i % 10 == 7  # some clients go away after two chunks of a long request
    body = {"model": model[i % 10], "prompt": f"c{i}", "max_tokens": LONG if leaves else 24, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start, first, chunks, tokens = time.monotonic(), None, 0, None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"status": response.status_code, "retry_after": response.headers.get("retry-after"),
                    "error": response.json()["error"]["message"]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                continue
            first = first or time.monotonic()
            chunks += 1
            if leaves and chunks == 2:
                break
    return {"status": 200, "ttft": (first or time.monotonic()) - start, "tokens": tokens, "left": leaves}


async def crowd(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=CLIENTS + 10)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        return await asyncio.gather(*(one_client(http, i) for i in range(CLIENTS)))


def test_200_streaming_clients_get_their_tokens_or_a_429_and_leave_nothing_behind(server):
    results = asyncio.run(crowd(server))
    served = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] != 200]
    assert all(r["status"] == 429 and int(r["retry_after"]) >= 1 and "busy" in r["error"] for r in refused), refused[:3]
    assert len(served) >= 160 and all(r["left"] or r["tokens"] == 24 for r in served)
    ttft = sorted(r["ttft"] for r in served)
    p99 = ttft[int(0.99 * (len(ttft) - 1))]
    print(f"\n200 clients: {len(served)} served, {len(refused)} got 429; TTFT p50 {statistics.median(ttft):.2f} s, "
          f"p99 {p99:.2f} s")
    wait_until(lambda: metric(server, "loramux:num_requests_running") == 0 and metric(server, "loramux:num_requests_waiting") == 0
               and metric(server, "loramux:kv_cache_usage_perc") == 0 and metric(server, "loramux:pending_requests") == 0,
               30, "every sequence and KV block freed")
    # every served request ended once in the engine: run to its length, or cut short when its client left
    aborted = metric(server, 'loramux:engine_finished_requests_total{reason="abort"}')
    ended = metric(server, 'loramux:engine_finished_requests_total{reason="length"}')
    assert aborted >= 1 and aborted + ended == len(served), (aborted, ended, len(served))
