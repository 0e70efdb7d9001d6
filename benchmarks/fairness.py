"""A bystander's latency while another client sends heavy requests, through `loramux serve` on the embedded
default model, with the defaults (chunked prefill, the step bound) against the same server with both off.

The heavy client: --heavy-n requests of n=8 on a 2,001-token prompt with prompt_logprobs, and as many with
echo + logprobs 20 on a 4,051-token prompt, all at once. The bystander: a short chat request (16 tokens)
every --interval seconds, timed end to end. Each configuration gets its own server; the bystander's idle
latency is measured on it first. Prints each phase's p50 / p95 / worst and their ratios to idle, then one
JSON line.

--tenants: two tenants instead, on one server with a tenants file and on one without (tenants off: both
clients' requests share one queue). Tenant A floods: --flood concurrent requests of a --flood-prompt-token
prompt, each sent again as it finishes, far past what 2 cores serve. Tenant B sends one short chat request at a
time (streamed: its time to first token is timed), first idle, then beside the flood, then beside the heavy
requests above (A's, n = 8, prompt logprobs, echo). Prints B's TTFT p50 / p95 and their ratios to idle.

  .venv/bin/python benchmarks/fairness.py            # ~8 min on 2 cores
  .venv/bin/python benchmarks/fairness.py --tenants  # ~4 min
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time

import tempfile
import threading

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served import free_port, serve  # noqa: E402
from throughput import cpu_load  # noqa: E402

CONFIGS = {"defaults": [], "unchunked, no step bound": ["--no-enable-chunked-prefill", "--prefill-slowdown-cap", "none"]}


def start(extra: list[str]):
    port = free_port()
    return serve([sys.executable, "-m", "loramux", "serve", "--port", str(port), "--max-model-len", "4608",
                  "--log-level", "warning", *extra], port)


_CLIENTS: dict[tuple[str, str | None], httpx.Client] = {}


def _client(url: str, key: str | None) -> httpx.Client:
    """The bystander's one client, its connection kept open between requests, as an OpenAI client's is (a new
    httpx client per request costs ~17 ms of the client's own set-up, which a latency must not include)."""
    if (url, key) not in _CLIENTS:
        _CLIENTS[url, key] = httpx.Client(base_url=url, timeout=600, headers=_auth(key))
    return _CLIENTS[url, key]


def bystander(url: str, key: str | None = None) -> float:
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hello, how are you today?"}],
            "max_tokens": 16, "temperature": 0}
    client = _client(url, key)
    started = time.monotonic()
    response = client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return time.monotonic() - started


def ttft(url: str, key: str | None) -> float:
    """Tenant B's short chat request, streamed: seconds to its first token."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hello, how are you today?"}],
            "max_tokens": 16, "temperature": 0, "stream": True}
    client = _client(url, key)
    started = time.monotonic()
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        first, lines = None, response.iter_lines()
        for line in lines:
            if line.startswith("data: {") and any(c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                first = time.monotonic() - started
                break
        for _ in lines:  # the rest of the answer
            pass
    return first


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def heavy(url: str, i: int, key: str | None = None) -> int:
    words = [f"word{(i * 7919 + j) % 1000}" for j in range(5000)]
    if i % 2:
        body = {"prompt": " ".join(words[:2000]), "n": 8, "prompt_logprobs": 5, "max_tokens": 16}
    else:
        body = {"prompt": " ".join(words[:4050]), "echo": True, "logprobs": 20, "max_tokens": 1}
    body["prompt"] = _tokens(url, body["prompt"], 2001 if i % 2 else 4051, key)
    response = httpx.post(f"{url}/v1/completions", json={"model": "SmolLM2-135M-Instruct", "temperature": 0.7,
                                                         **body}, timeout=1800, headers=_auth(key))
    return response.status_code


def _tokens(url: str, text: str, count: int, key: str | None = None) -> list[int]:
    ids = httpx.post(f"{url}/tokenize", json={"model": "SmolLM2-135M-Instruct", "prompt": text},
                     headers=_auth(key)).json()["tokens"]
    return (ids * (count // len(ids) + 1))[:count]


def phase(url: str, args) -> dict:
    bystander(url)
    idle = [bystander(url) for _ in range(args.idle)]
    with concurrent.futures.ThreadPoolExecutor(2 * args.heavy_n) as pool:
        load = [pool.submit(heavy, url, i) for i in range(2 * args.heavy_n)]
        time.sleep(1.0)
        during = []
        while not all(f.done() for f in load):
            during.append(bystander(url))
            time.sleep(args.interval)
        codes = [f.result() for f in load]
    during.sort()
    return {"idle_p50": statistics.median(idle), "p50": statistics.median(during),
            "p95": during[int(0.95 * (len(during) - 1))], "worst": during[-1], "samples": len(during),
            "heavy_status": codes}


TENANT_KEYS = {"A": "tenant-a-key", "B": "tenant-b-key"}


def tenants_file() -> str:
    from loramux.server.http.tenants import key_hash

    path = os.path.join(tempfile.mkdtemp(prefix="fairness-"), "tenants.toml")
    with open(path, "w") as f:
        for name, key in TENANT_KEYS.items():
            f.write(f'[tenants.{name}]\nkeys = ["sha256:{key_hash(key)}"]\nmodels = ["SmolLM2-135M-Instruct"]\n')
    return path


def flood(url: str, key: str | None, stop: threading.Event, prompt_tokens: int, i: int) -> None:
    """One of tenant A's flood: a long prompt, again and again until `stop`."""
    prompt = _tokens(url, " ".join(f"flood{(i * 31 + j) % 997}" for j in range(prompt_tokens)), prompt_tokens, key)
    with httpx.Client(timeout=1800, headers=_auth(key)) as client:
        while not stop.is_set():
            client.post(f"{url}/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": prompt,
                                                       "max_tokens": 16, "temperature": 0.7})


def tenant_phases(url: str, keys: dict, args) -> dict:
    """B's TTFT idle, beside A's flood, and beside A's heavy requests."""
    ttft(url, keys["B"])
    idle = [ttft(url, keys["B"]) for _ in range(args.idle)]
    found = {"idle_p50": statistics.median(idle)}
    stop = threading.Event()
    threads = [threading.Thread(target=flood, args=(url, keys["A"], stop, args.flood_prompt_tokens, i), daemon=True)
               for i in range(args.flood)]
    for t in threads:
        t.start()
    time.sleep(args.flood_warmup)
    during = sorted(ttft(url, keys["B"]) for _ in range(args.tenant_samples))
    stop.set()
    found["flood"] = {"p50": statistics.median(during), "p95": during[int(0.95 * (len(during) - 1))],
                      "worst": during[-1], "samples": len(during)}
    for t in threads:
        t.join()
    with concurrent.futures.ThreadPoolExecutor(2 * args.heavy_n) as pool:
        load = [pool.submit(heavy, url, i, keys["A"]) for i in range(2 * args.heavy_n)]
        time.sleep(1.0)
        during = []
        while not all(f.done() for f in load):
            during.append(ttft(url, keys["B"]))
            time.sleep(args.interval)
    during.sort()
    found["heavy"] = {"p50": statistics.median(during), "p95": during[int(0.95 * (len(during) - 1))],
                      "worst": during[-1], "samples": len(during)}
    return found


def run_tenants(args, report: dict) -> None:
    """Tenants on (a tenants file: A and B are each their own fair share) against off (no file, no keys: one
    queue for both)."""
    for name, extra, keys in (("tenants on", ["--tenants", tenants_file()], TENANT_KEYS),
                              ("tenants off", [], {"A": None, "B": None})):
        proc, url = start(extra)
        try:
            report["phases"][name] = result = tenant_phases(url, keys, args)
        finally:
            proc.terminate()
            proc.wait(60)
        idle = result["idle_p50"]
        for load in ("flood", "heavy"):
            r = result[load]
            print(f"{name:<12} B's TTFT idle {idle * 1000:5.0f} ms | beside A's {load:<5} p50 {r['p50'] * 1000:6.0f} "
                  f"({r['p50'] / idle:5.1f}x) p95 {r['p95'] * 1000:6.0f} ({r['p95'] / idle:5.1f}x) worst "
                  f"{r['worst'] * 1000:6.0f} ms, {r['samples']} samples")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heavy-n", type=int, default=2, help="requests of each heavy kind")
    parser.add_argument("--idle", type=int, default=8)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--tenants", action="store_true", help="the two-tenant runs instead")
    parser.add_argument("--flood", type=int, default=64, help="tenant A's concurrent requests")
    parser.add_argument("--flood-prompt-tokens", type=int, default=1024)
    parser.add_argument("--flood-warmup", type=float, default=10.0, help="seconds of flood before B is timed")
    parser.add_argument("--tenant-samples", type=int, default=20)
    args = parser.parse_args()
    report = {"load_before": cpu_load(), "phases": {}}
    if args.tenants:
        run_tenants(args, report)
        report["load_after"] = cpu_load()
        print(json.dumps(report))
        return
    for name, extra in CONFIGS.items():
        proc, url = start(extra)
        try:
            report["phases"][name] = result = phase(url, args)
        finally:
            proc.terminate()
            proc.wait(60)
        idle = result["idle_p50"]
        print(f"{name:<28} idle {idle * 1000:6.0f} ms | beside heavy p50 {result['p50'] * 1000:6.0f} "
              f"({result['p50'] / idle:4.1f}x) p95 {result['p95'] * 1000:6.0f} ({result['p95'] / idle:4.1f}x) worst "
              f"{result['worst'] * 1000:6.0f} ms ({result['worst'] / idle:4.1f}x), {result['samples']} samples")
    report["load_after"] = cpu_load()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
