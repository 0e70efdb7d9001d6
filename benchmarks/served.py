"""`loramux serve` started for a benchmark and driven by vLLM's load generator (`vllm bench serve`), shared by
serving.py, scaleout.py, latency.py, prefix.py and multitenant.py."""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def workload_parser(doc: str) -> argparse.ArgumentParser:
    """The served workload's options (serving.py's by default) and the load generator's venv."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--vllm-venv", default="/tmp/vllm-cpu-venv", help="a venv with vLLM (for `vllm bench serve`)")
    parser.add_argument("--quiet", action="store_true")
    return parser


def check_load_generator(args) -> None:
    if not os.path.exists(os.path.join(args.vllm_venv, "bin", "vllm")):
        sys.exit(f"no `vllm` in {args.vllm_venv}: build the load generator's venv first (benchmarks/README.md)")


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
    return serve(cmd, port)


def serve(cmd: list[str], port: int, timeout_s: float = 600, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Start `cmd` (a `loramux serve`, or a peer's server, listening on `port`) and wait until /health answers
    200."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd[:3])} exited during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{' '.join(cmd[:3])} did not start")


VLLM_CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}  # both cores; 2 GiB of KV cache


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM a server, then SIGKILL it if it has not exited within a minute."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench_serve(args, url, path, adapters, workdir, label, extra, dataset: list[str] | None = None) -> dict:
    """One `vllm bench serve` run; its result JSON, with its percentiles under our names. dataset: its dataset
    options (default: random prompts of --prompt-len tokens, --new-tokens new ones)."""
    tool = os.path.join(args.vllm_venv, "bin", "vllm")
    dataset = dataset or ["--dataset-name", "random", "--random-input-len", str(args.prompt_len),
                          "--random-output-len", str(args.new_tokens)]
    cmd = [tool, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", "base", "--tokenizer", path, *dataset, "--ignore-eos", "--temperature", "0",
           *(["--lora-modules", *adapters, "--lora-assignment", "random"] if adapters else []), "--seed", "0",
           "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", workdir, "--result-filename", f"{label}.json", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL if args.quiet else None)
    with open(os.path.join(workdir, f"{label}.json")) as f:
        raw = json.load(f)
    return {"output_throughput": raw["output_throughput"], "duration_s": raw["duration"],
            "completed": raw["completed"], "failed": raw.get("failed", 0), "request_rate": raw.get("request_rate"),
            "request_throughput": raw["request_throughput"], "request_goodput": raw.get("request_goodput"),
            **{f"p{q}_{m}_ms": raw[f"p{q}_{m}_ms"] for q in (50, 99) for m in ("ttft", "tpot", "itl", "e2el")}}


def print_rows(rows: dict[str, dict], ratios: dict[str, float], label: str = "run") -> None:
    """A table of bench_serve results (label -> result): throughput, TTFT and TPOT; then the ratios."""
    width = max([len(label), *map(len, rows)]) + 2
    print(f"\n{label:<{width}}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}")
    for name, r in rows.items():
        print(f"{name:<{width}}{r['output_throughput']:>10.1f}{r['p50_ttft_ms']:>10.0f}{r['p99_ttft_ms']:>10.0f}"
              f"{r['p50_tpot_ms']:>10.1f}{r['p99_tpot_ms']:>10.1f}")
    for name, value in ratios.items():
        print(f"{name:<60}{value:>8.2f}x")
