"""`loramux serve` started for a benchmark and driven by vLLM's load generator (`vllm bench serve`), shared by
serving.py and latency.py. (Not named serving_*: tests/server/serving.py is a test helper module of that name,
and a benchmark script imported by a test must not collide with it in sys.modules.)"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, path, adapters) -> tuple[subprocess.Popen, str]:
    """path: the model (None: the embedded default, as `loramux serve` serves it); args.quantization if set."""
    port = free_port()
    model = [] if path is None else ["--model", path]
    quantization = [] if getattr(args, "quantization", None) is None else ["--quantization", args.quantization]
    cmd = [sys.executable, "-m", "loramux", "serve", *model, *quantization, "--port", str(port), "--dtype", args.dtype,
           "--max-loras", "8", "--max-lora-rank", "16", "--max-num-seqs", str(args.concurrency),
           "--max-model-len", str(args.prompt_len + args.new_tokens + 16), "--served-model-name", "base",
           "--log-level", "warning", "--lora-modules", *[f"{n}={p}" for n, p in adapters.items()], *args.serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("loramux serve exited during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("loramux serve did not start")


def bench_serve(args, url, path, adapters, workdir, label, extra) -> dict:
    """One `vllm bench serve` run; its result JSON, with its percentiles under our names."""
    tool = os.path.join(args.vllm_venv, "bin", "vllm")
    cmd = [tool, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", "base", "--tokenizer", path, "--dataset-name", "random", "--random-input-len",
           str(args.prompt_len), "--random-output-len", str(args.new_tokens), "--ignore-eos", "--temperature", "0",
           "--lora-modules", *adapters, "--lora-assignment", "random", "--seed", "0", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", workdir, "--result-filename", f"{label}.json", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL if args.quiet else None)
    with open(os.path.join(workdir, f"{label}.json")) as f:
        raw = json.load(f)
    return {"output_throughput": raw["output_throughput"], "duration_s": raw["duration"],
            "completed": raw["completed"], "request_rate": raw.get("request_rate"),
            **{f"p{q}_{m}_ms": raw[f"p{q}_{m}_ms"] for q in (50, 99) for m in ("ttft", "tpot", "itl", "e2el")}}
