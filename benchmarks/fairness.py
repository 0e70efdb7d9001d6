"""A bystander's latency while another client sends heavy requests, through `loramux serve` on the embedded
default model, with the defaults (chunked prefill, the step bound) against the same server with both off.

The heavy client: --heavy-n requests of n=8 on a 2,001-token prompt with prompt_logprobs, and as many with
echo + logprobs 20 on a 4,051-token prompt, all at once. The bystander: a short chat request (16 tokens)
every --interval seconds, timed end to end. Each configuration gets its own server; the bystander's idle
latency is measured on it first. Prints each phase's p50 / p95 / worst and their ratios to idle, then one
JSON line.

  .venv/bin/python benchmarks/fairness.py            # ~10 min on 2 cores
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served import free_port, serve  # noqa: E402
from throughput import cpu_load  # noqa: E402

CONFIGS = {"defaults": [], "unchunked, no step bound": ["--no-enable-chunked-prefill", "--prefill-slowdown-cap", "none"]}


def start(extra: list[str]):
    port = free_port()
    return serve([sys.executable, "-m", "loramux", "serve", "--port", str(port), "--max-model-len", "4608",
                  "--log-level", "warning", *extra], port)


def bystander(url: str) -> float:
    started = time.monotonic()
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hello, how are you today?"}],
            "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return time.monotonic() - started


def heavy(url: str, i: int) -> int:
    words = [f"word{(i * 7919 + j) % 1000}" for j in range(5000)]
    if i % 2:
        body = {"prompt": " ".join(words[:2000]), "n": 8, "prompt_logprobs": 5, "max_tokens": 16}
    else:
        body = {"prompt": " ".join(words[:4050]), "echo": True, "logprobs": 20, "max_tokens": 1}
    body["prompt"] = _tokens(url, body["prompt"], 2001 if i % 2 else 4051)
    response = httpx.post(f"{url}/v1/completions", json={"model": "SmolLM2-135M-Instruct", "temperature": 0.7,
                                                         **body}, timeout=1800)
    return response.status_code


def _tokens(url: str, text: str, count: int) -> list[int]:
    ids = httpx.post(f"{url}/tokenize", json={"model": "SmolLM2-135M-Instruct", "prompt": text}).json()["tokens"]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heavy-n", type=int, default=2, help="requests of each heavy kind")
    parser.add_argument("--idle", type=int, default=8)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()
    report = {"load_before": cpu_load(), "phases": {}}
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
