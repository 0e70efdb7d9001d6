"""What activated LoRA (aLoRA) saves, measured: an intrinsic (an aLoRA adapter) asked after a long conversation
with the base model. Its prompt is the conversation, the invocation tokens and a short question; the
conversation's blocks are the base model's, so with them in the prefix cache (the base model just answered the
conversation) only the invocation and what follows are prefilled. Measured side by side in one run, each
repeat on a new conversation: the intrinsic's time to first token after the base-model turn ("cached") against
the same with the prefix cache emptied before it ("cold"), and a plain LoRA adapter after the same base-model
turn (it cannot reuse the base model's blocks). Prints the medians, the ratios and one JSON line.

  .venv/bin/python benchmarks/alora.py [--conversation 800] [--repeats 7] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import cpu_load, scratch_dir, write_adapter  # noqa: E402

from loramux import LoRAConfig, SamplingParams  # noqa: E402
from loramux.llm import LLM  # noqa: E402
from loramux.models.loader import default_model_path  # noqa: E402

INVOKE = [1001, 1002, 1003]  # the intrinsic's invocation tokens (ids inside any vocabulary this runs on)
QUESTION = [2001, 2002, 2003, 2004, 2005, 2006, 2007, 2008]


def write_alora_adapter(path: str, hf_config, invoke: list[int]) -> str:
    write_adapter(path, hf_config, 8, seed=11)
    config_path = os.path.join(path, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "alora_invocation_tokens": invoke}, f)
    return path


def ttft(llm: LLM, prompt: list[int], adapter: str | None) -> tuple[float, int]:
    """(seconds to the first token, how many prompt tokens the prefix cache gave)."""
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), adapters=[adapter],
                       use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def run(args) -> dict:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(args.config or default_model_path())
    vocab = hf_config.vocab_size
    invoke, question = [t % vocab for t in INVOKE], [t % vocab for t in QUESTION]
    work = scratch_dir("loramux-bench-alora-")
    llm = LLM(model=args.model, dtype=args.dtype, lora=LoRAConfig(max_loras=2, max_lora_rank=8),
              max_model_len=args.conversation + 64)
    assert llm.load_adapter("intrinsic", write_alora_adapter(os.path.join(work, "intrinsic"), hf_config, invoke))
    assert llm.load_adapter("plain", write_adapter(os.path.join(work, "plain"), hf_config, 8, seed=12))
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"cached": [], "cold": [], "plain_after_base": []}
    cached_tokens = []
    for r in range(args.repeats + 1):  # the first round warms up and is not counted
        conversation = torch.randint(10, vocab, (args.conversation,), generator=gen).tolist()
        tail = invoke + question
        ttft(llm, conversation, None)  # the base model's turn: its blocks go into the prefix cache
        cached, hit = ttft(llm, conversation + tail, "intrinsic")
        plain, _ = ttft(llm, conversation + tail, "plain")
        llm.reset_prefix_cache()
        cold, _ = ttft(llm, conversation + tail, "intrinsic")
        llm.reset_prefix_cache()
        if r:
            times["cached"].append(cached)
            times["cold"].append(cold)
            times["plain_after_base"].append(plain)
            cached_tokens.append(hit)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"benchmark": "alora", "model": os.path.basename((args.model or default_model_path()).rstrip("/")),
            "dtype": args.dtype, "conversation": args.conversation, "prompt": args.conversation + len(invoke) +
            len(question), "repeats": args.repeats, "cached_tokens": cached_tokens,
            "ttft_ms": {k: round(v * 1000, 2) for k, v in medians.items()},
            "runs_ms": {k: [round(s * 1000, 2) for s in v] for k, v in times.items()},
            "ratios": {"cached/cold": medians["cached"] / medians["cold"],
                       "cached/plain_after_base": medians["cached"] / medians["plain_after_base"]}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2's GGUF)")
    p.add_argument("--config", default=None, help="the model's HF config directory (default: the embedded one's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--conversation", type=int, default=800, help="the base-model conversation's tokens")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    load = cpu_load()
    result = run(args)
    result["load_before"], result["load_after"] = load, cpu_load()
    print(f"aLoRA intrinsic after a {args.conversation}-token base-model conversation ({result['prompt']}-token "
          f"prompt), {args.dtype}, median of {args.repeats}; cached tokens {result['cached_tokens']}")
    for label, ms in result["ttft_ms"].items():
        print(f"  TTFT {label:<18} {ms:8.1f} ms")
    for label, ratio in result["ratios"].items():
        print(f"  {label:<26} {ratio:.3f}x")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
