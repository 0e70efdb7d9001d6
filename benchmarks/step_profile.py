"""One decode step of loramux under torch.profiler: the top kernels by device time, the kernels a step
launches, and the step's wall time against the time its kernels run (a step whose wall time is mostly not
kernel time is bound by host work: launches, new tensors, syncs).

Workload: --batch requests of --prompt-len random tokens on --adapters' adapters (mixed, round robin; none:
the base model), prefilled first, then --steps decode steps profiled. Prints a table and one JSON line.

  python benchmarks/step_profile.py --device cuda --model DIR --adapters DIR_OF_ADAPTER_DIRS
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loramux import LLM, LoRAConfig, SamplingParams  # noqa: E402

TOP = 12


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapters", default=None, help="a directory of adapter directories (8 are used)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    return parser.parse_args(argv)


def engine_with_batch(args):
    """An engine whose --batch requests are all past their prefill: the next steps are decode steps."""
    names = sorted(os.listdir(args.adapters))[:8] if args.adapters else []
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.batch,
              max_model_len=args.prompt_len + 4 * args.steps + 16,
              lora=LoRAConfig(max_loras=8, max_cpu_loras=8, max_lora_rank=16) if names else None)
    for name in names:
        assert llm.load_adapter(f"{name}={os.path.join(args.adapters, name)}"), name
    engine, rng = llm.engine, random.Random(0)
    vocab = engine.core.runner.model.config.vocab_size
    params = SamplingParams(max_tokens=4 * args.steps, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
        engine.add_request(prompt, params, names[i % len(names)] if names else None)
    while engine.core.scheduler.waiting or any(s.is_prefilling for s in engine.core.scheduler.running):
        engine.step()
    for _ in range(2):  # warm: the decode shapes compiled and cached
        engine.step()
    return llm, names


def profile(engine, steps: int, device: str):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - start
    return prof, wall


def summary(prof, wall: float, steps: int) -> dict:
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    device_us = sum(by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP]
    return {"step_ms": 1e3 * wall / steps, "kernel_ms_per_step": device_us / 1e3 / steps,
            "kernels_per_step": len(kernels) / steps,
            "kernel_share_of_wall": device_us / 1e6 / wall if wall else 0.0,
            "top_kernels_ms_per_step": [(name[:80], us / 1e3 / steps) for name, us in top]}


def main(argv=None) -> None:
    args = parse_args(argv)
    llm, names = engine_with_batch(args)
    prof, wall = profile(llm.engine, args.steps, args.device)
    found = summary(prof, wall, args.steps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP))
    print(f"decode step, batch {args.batch}, {len(names) or 'no'} adapters: {found['step_ms']:.2f} ms wall, "
          f"{found['kernel_ms_per_step']:.2f} ms of kernels ({found['kernels_per_step']:.0f} launches, "
          f"{100 * found['kernel_share_of_wall']:.0f}% of the wall time)")
    for name, ms in found["top_kernels_ms_per_step"]:
        print(f"  {ms:8.3f} ms  {name}")
    print(json.dumps({"model": os.path.basename(args.model.rstrip("/")), "device": args.device, "dtype": args.dtype,
                      "batch": args.batch, "adapters": len(names), **found}))


if __name__ == "__main__":
    main()
