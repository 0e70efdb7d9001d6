"""Many tenants, served: throughput and latency as the number of distinct adapters grows, with adapters
registered up front or loaded on their first request through a resolver, and vLLM-CPU's `vllm serve` on the
same workloads, each driven by vLLM's load generator (`vllm bench serve`) in one run.

Model: the embedded default as an HF checkpoint (SmolLM2-135M-Instruct, --dtype bfloat16), rank-8 PEFT
adapters on all 7 projections (8 distinct weight sets, hard-linked into as many adapter directories as a run
needs: every directory is its own adapter to both servers). Workload: --requests random prompts of
--prompt-len tokens + --new-tokens new ones, --concurrency in flight, each request's adapter drawn at random
among the run's. Runs:
  loramux 8 / 128 / 1000         registered at start (`--lora-modules`); the host tier holds all of them up to
                                 128, --host-loras of the 1000 (the others are read back when asked for)
  loramux 1000, on demand        nothing registered: `--lora-resolver-dir`, a host tier of --host-loras
  loramux 1000, slow store       the example store plugin (examples/store_resolver.py) with a --store-delay-s
                                 copy per adapter (a stand-in for a network store), host tier of --host-loras
  vllm 8 / 1000                  `vllm serve --enable-lora --lora-modules ...` (--max-cpu-loras as many)
Then the registry at scale: --registry adapters (rank 1, q_proj: small files) loaded on demand, one request
each, and `/v1/models`' latency and the HTTP front end's memory before and after.

  .venv/bin/python benchmarks/multitenant.py [--vllm-venv /tmp/vllm-cpu-venv]     # ~30 min on 2 cores
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served import VLLM_CPU_ENV, bench_serve, check_load_generator, free_port, print_rows, serve, stop  # noqa: E402
from throughput import cpu_load, write_adapter  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
RUNS = ("loramux 8", "loramux 128", "loramux 1000", "loramux 1000, on demand", "loramux 1000, slow store",
        "vllm 8", "vllm 1000")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-loras", type=int, default=32, help="device slots, on both servers")
    parser.add_argument("--host-loras", type=int, default=64, help="the host tier of the on-demand runs")
    parser.add_argument("--store-delay-s", type=float, default=0.3)
    parser.add_argument("--registry", type=int, default=10_000)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    parser.add_argument("--vllm-venv", default="/tmp/vllm-cpu-venv")
    parser.add_argument("--quiet", action="store_true")
    return parser.parse_args(argv)


def adapter_dirs(root: str, weights: list[str], count: int, prefix: str) -> dict[str, str]:
    """`count` adapter directories under root, hard-linking the files of `weights` round robin."""
    found = {}
    for i in range(count):
        source, target = weights[i % len(weights)], os.path.join(root, f"{prefix}{i}")
        os.makedirs(target, exist_ok=True)
        for name in os.listdir(source):
            if not os.path.exists(os.path.join(target, name)):
                os.link(os.path.join(source, name), os.path.join(target, name))
        found[f"{prefix}{i}"] = target
    return found


def start(run: str, args, model: str, adapters: dict[str, str], root: str):
    port, side, count = free_port(), run.split()[0], int(run.split()[1].rstrip(","))
    common = ["--port", str(port), "--dtype", args.dtype, "--served-model-name", "base", "--max-loras",
              str(args.max_loras), "--max-lora-rank", "8", "--max-num-seqs", str(args.concurrency), "--max-model-len",
              str(args.prompt_len + args.new_tokens + 16)]
    lora = ["--lora-modules", *[f"{n}={p}" for n, p in adapters.items()]]
    if side == "vllm":
        env = {**os.environ, **VLLM_CPU_ENV}
        cmd = [os.path.join(args.vllm_venv, "bin", "vllm"), "serve", model, *common, "--enable-lora",
               "--max-cpu-loras", str(max(count, args.max_loras)), *lora]
        return serve(cmd, port, timeout_s=1200, env=env)
    cmd = [sys.executable, "-m", "loramux", "serve", "--model", model, *common, "--log-level", "warning"]
    env = None
    if "on demand" in run:
        cmd += ["--lora-resolver-dir", root, "--max-cpu-loras", str(max(args.host_loras, args.max_loras))]
    elif "slow store" in run:
        env = {**os.environ, "PYTHONPATH": EXAMPLES, "ADAPTER_STORE": root, "ADAPTER_STORE_DELAY_S": str(args.store_delay_s)}
        cmd += ["--lora-resolver", "store_resolver:StoreResolver", "--max-cpu-loras",
                str(max(args.host_loras, args.max_loras))]
    else:
        host = count if count <= 128 else args.host_loras
        cmd += ["--max-cpu-loras", str(max(host, args.max_loras)), *lora]
    return serve(cmd, port, timeout_s=1200, env=env)


def run_one(run: str, args, model: str, adapters: dict[str, str], root: str, workdir: str) -> dict:
    proc, url = start(run, args, model, adapters, root)
    try:
        bench = argparse.Namespace(vllm_venv=args.vllm_venv, quiet=args.quiet, prompt_len=args.prompt_len,
                                   new_tokens=args.new_tokens)
        bench_serve(bench, url, model, list(adapters)[:8], workdir, f"{run}-warmup", ["--num-prompts", "8"])
        return bench_serve(bench, url, model, list(adapters), workdir, run,
                           ["--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency)])
    finally:
        stop(proc)


def registry(args, model: str, root: str, weights: str) -> dict:
    """--registry adapters loaded on demand (one request each): /v1/models' latency and the front end's memory."""
    names = adapter_dirs(root, [weights], args.registry, "r")
    port = free_port()
    proc, url = serve([sys.executable, "-m", "loramux", "serve", "--model", model, "--port", str(port), "--dtype",
                       args.dtype, "--max-lora-rank", "8", "--lora-resolver-dir", root, "--log-level", "warning"], port)
    try:
        found = {"adapters": args.registry, "before": _registry_state(url, proc.pid)}
        body = {"prompt": "hi", "max_tokens": 1, "temperature": 0}
        started = time.monotonic()
        with httpx.Client(base_url=url, timeout=600) as http, concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda n: http.post("/v1/completions", json={**body, "model": n}).status_code, names))
        found["load_s"] = time.monotonic() - started
        found["ok"] = codes.count(200)
        found["after"] = _registry_state(url, proc.pid)
        return found
    finally:
        stop(proc)


def _registry_state(url: str, server_pid: int) -> dict:
    with httpx.Client(base_url=url, timeout=60) as http:
        times, count = [], 0
        for _ in range(20):
            started = time.perf_counter()
            count = len(http.get("/v1/models").json()["data"])
            times.append(time.perf_counter() - started)
    return {"models": count, "v1_models_p50_ms": 1000 * statistics.median(times),
            "frontend_rss_mb": _rss_mb(_child(server_pid, "loramux-http"))}


def _child(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        for child in f.read().split():
            with open(f"/proc/{child}/comm") as c:
                if c.read().strip() == name:
                    return int(child)
    raise LookupError(name)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def main(argv=None) -> None:
    args = parse_args(argv)
    check_load_generator(args)
    from transformers import AutoConfig

    from loramux.models.loader import default_model_path

    model = default_model_path()
    workdir = tempfile.mkdtemp(prefix="loramux-multitenant-")
    hf_config = AutoConfig.from_pretrained(model)
    weights = [write_adapter(os.path.join(workdir, "weights", f"w{i}"), hf_config, 8, seed=i) for i in range(8)]
    report = {"model": os.path.basename(model), "dtype": args.dtype, "requests": args.requests,
              "max_loras": args.max_loras, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "concurrency": args.concurrency,
              "host_loras": args.host_loras, "store_delay_s": args.store_delay_s, "load_before": cpu_load(), "runs": {}}
    for run in args.runs:
        count = int(run.split()[1].rstrip(","))
        root = os.path.join(workdir, run.replace(" ", "_").replace(",", ""))
        adapters = adapter_dirs(root, weights, count, "t")
        report["runs"][run] = run_one(run, args, model, adapters, root, workdir)
    if args.registry:
        small = write_adapter(os.path.join(workdir, "weights", "small"), hf_config, 1, seed=99, projections=("q_proj",))
        report["registry"] = registry(args, model, os.path.join(workdir, "registry"), small)
    report["load_after"] = cpu_load()
    report["ratios"] = ratios(report["runs"])
    print_report(report)


def ratios(runs: dict) -> dict:
    found, tput = {}, {run: r["output_throughput"] for run, r in runs.items()}
    pairs = [("loramux 1000", "loramux 8"), ("loramux 1000, on demand", "loramux 1000"),
             ("loramux 1000, slow store", "loramux 1000"), ("loramux 8", "vllm 8"), ("loramux 1000", "vllm 1000"),
             ("loramux 1000, slow store", "vllm 1000")]
    for a, b in pairs:
        if a in tput and b in tput:
            found[f"{a} / {b}: throughput"] = tput[a] / tput[b]
    for a in ("loramux 1000, on demand", "loramux 1000, slow store"):
        if a in runs and "loramux 1000" in runs:
            found[f"{a} / loramux 1000: TPOT p99"] = runs[a]["p99_tpot_ms"] / runs["loramux 1000"]["p99_tpot_ms"]
    return found


def print_report(report: dict) -> None:
    print_rows(report["runs"], report["ratios"])
    if "registry" in report:
        r = report["registry"]
        print(f"registry: {r['ok']}/{r['adapters']} loaded on demand in {r['load_s']:.0f} s; /v1/models "
              f"{r['before']['v1_models_p50_ms']:.1f} -> {r['after']['v1_models_p50_ms']:.1f} ms, front end "
              f"{r['before']['frontend_rss_mb']:.0f} -> {r['after']['frontend_rss_mb']:.0f} MB")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
