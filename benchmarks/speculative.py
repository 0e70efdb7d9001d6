"""Speculative decoding (n-gram prompt lookup) at batch 1, with an adapter: loramux with speculation against the
same engine without it, and against llama.cpp with its prompt lookup (`LlamaPromptLookupDecoding`) and without,
on the same GGUF, in one run.

Four prompts a user would send, chat-formatted, greedy, each answer up to --max-tokens (ending at EOS):
  edit      fix the spelling in a pasted paragraph and write it out again (the answer repeats the prompt)
  document  answer from a pasted document, quoting it
  code      a change to a pasted function, the whole function written again
  fresh     a short story (nothing to look up: speculation must cost nothing)
Phases, interleaved (each repeat runs each phase once, so a slow spell of the machine falls on all alike):
  spec          loramux, --speculative-config (default: ngram, 5 tokens, lookup 2..4), the adapter on
  plain         the same engine with speculation switched off
  llama_lookup  llama-cpp-python with LlamaPromptLookupDecoding (its defaults: n-grams of 2, 10 tokens)
  llama         llama-cpp-python alone
Decode tok/s = tokens after the first / time after the first (each engine's own tokens: llama.cpp's numerics
differ, so its answers may differ a little). llama.cpp runs the base model (it takes adapters only as GGUF);
latency.py shows the adapter's own cost. Then --batch: 32 mixed-adapter requests of random prompts (low
acceptance) offline, speculation on against off (with disable_by_batch_size raised past 32 so it is really on).
Prints the ratios the targets use and one JSON line.

  .venv/bin/python benchmarks/speculative.py [--skip-llama-cpp] [--batch]
  .venv/bin/python benchmarks/speculative.py --model ~/.cache/loramux/bench-quantized/model-q4_k_m.gguf \\
      --config-dir ~/.cache/loramux/bench-quantized/hf   # quantized.py's 1.7B (random weights)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency import gguf_of  # noqa: E402
from throughput import cpu_load, scratch_dir, write_adapter  # noqa: E402

from loramux import LoRAConfig  # noqa: E402
from loramux.llm import LLM  # noqa: E402
from loramux.models.loader import default_gguf_path, default_model_path  # noqa: E402
from loramux.sampling_params import SamplingParams  # noqa: E402

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its "
             "lamp turned slowly, sending a beam of light across the dark water so that the fishing boats could "
             "find there way home. The keeper, a quiet man named Thomas, climbed the hundred and twelve steps twice "
             "a day to clean the lenses and wind the clockwork that kept the lamp turning. In winter the storms were "
             "so strong that the hole tower seemed to shake, but the light never went out. When the town finaly "
             "replaced the lamp with an automatic one, Thomas stayed on to look after the building and to tell "
             "visitors about the ships that had been saved by its light.")
DOCUMENT = ("Returns policy. Items bought in our stores or online can be returned within 30 days of delivery for a "
            "full refund, provided they are unused and in their original packaging. Sale items can be returned "
            "within 14 days and are refunded as store credit only. To return an online order, print the prepaid "
            "label from your account page and drop the parcel at any post office; refunds are issued to the "
            "original payment method within 5 business days of the parcel reaching our warehouse. Gift cards, "
            "personalised items and opened software cannot be returned. If an item arrives damaged, contact "
            "customer service within 48 hours with a photo of the damage and we will send a replacement at no cost.")
CODE = '''def summarize(orders):
    total = 0
    count = 0
    largest = None
    for order in orders:
        if order["status"] != "paid":
            continue
        total += order["amount"]
        count += 1
        if largest is None or order["amount"] > largest["amount"]:
            largest = order
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average, "largest": largest}
'''
PROMPTS = {
    "edit": f"Fix the spelling mistakes in this paragraph and write the whole paragraph out again, changing nothing "
            f"else:\n\n{PARAGRAPH}",
    "document": f"{DOCUMENT}\n\nUsing only the document above, what are the rules for returning sale items and "
                f"damaged items? Quote the document's sentences.",
    "code": f"{CODE}\nRename the variable `total` to `revenue` in this function. Write the whole function again.",
    "fresh": "Write a short story about a cat who learns to fly.",
}


def chat_prompt(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def loramux_once(llm: LLM, prompt: list[int], adapter: str | None, max_tokens: int) -> tuple[float, float, int]:
    """One greedy request through the step loop: (time to first token, decode tok/s after it, tokens)."""
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0), adapter)
    first = last = None
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = len(out.token_ids)
        last = time.perf_counter()
        first = first or last
    return first - start, (tokens - 1) / (last - first), tokens


def llama_cpp_once(model, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    model.reset()
    start = time.perf_counter()
    first, tokens = None, 0
    for tokens, token in enumerate(model.generate(prompt, temp=0.0), start=1):  # greedy
        first = first or time.perf_counter()
        if token == model.token_eos() or tokens == max_tokens:
            break
    return first - start, (tokens - 1) / (time.perf_counter() - first), tokens


def with_speculation(llm: LLM, on: bool):
    """Switch the engine's speculation on or off (the same engine and process for both)."""
    scheduler = llm.engine.core.scheduler
    speculator = llm.engine.core.speculator
    scheduler.speculator = speculator if on else None
    return llm


def phases_for(args, llm: LLM, prompt: list[int], adapter: str | None) -> dict:
    phases = {"spec": lambda: loramux_once(with_speculation(llm, True), prompt, adapter, args.max_tokens),
              "plain": lambda: loramux_once(with_speculation(llm, False), prompt, adapter, args.max_tokens)}
    if not args.skip_llama_cpp:
        lookup, plain = args.llama_models
        phases["llama_lookup"] = lambda: llama_cpp_once(lookup, prompt, args.max_tokens)
        phases["llama"] = lambda: llama_cpp_once(plain, prompt, args.max_tokens)
    return phases


def interleaved(phases: dict, repeats: int) -> dict:
    for run in phases.values():  # warm-up
        run()
    runs = {name: [] for name in phases}
    for _ in range(repeats):
        for name, run in phases.items():
            runs[name].append(run())
    return {name: {"ttft_ms": statistics.median(t for t, _, _ in r) * 1000,
                   "decode_tok_s": statistics.median(d for _, d, _ in r), "tokens": r[-1][2],
                   "runs_decode_tok_s": [round(d, 1) for _, d, _ in r]} for name, r in runs.items()}


def llama_models(gguf: str, context: int):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = torch.get_num_threads()
    lookup = Llama(model_path=gguf, n_threads=threads, n_ctx=context, verbose=False,
                   draft_model=LlamaPromptLookupDecoding())
    return lookup, Llama(model_path=gguf, n_threads=threads, n_ctx=context, verbose=False)


def batch_phase(args, llm: LLM, vocab: int) -> dict:
    """32 random prompts over 8 adapters, sampled (temperature 1: little repeats, so most proposals fail),
    speculation on vs off; and the acceptance of the proposals made."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, vocab, (64,), generator=gen).tolist() for _ in range(32)]
    names = [f"b{i % 8}" for i in range(32)]
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=i, ignore_eos=True) for i in range(32)]
    stats = llm.engine.core.speculator.stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    speculator = llm.engine.core.speculator
    speculator.max_batch, default = 64, speculator.max_batch
    out = {}
    for _ in range(args.repeats):
        for label, on in (("batch_spec", True), ("batch_plain", False)):
            start = time.perf_counter()
            results = with_speculation(llm, on).generate(prompts, params, adapters=names, use_tqdm=False)
            out.setdefault(label, []).append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - start))
    speculator.max_batch = default
    result = {label: statistics.median(v) for label, v in out.items()}
    proposed, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    return {**result, "proposed_tokens": proposed, "acceptance": accepted / max(1, proposed)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF (default: the embedded SmolLM2's Q4_1)")
    parser.add_argument("--config-dir", default=None, help="HF directory with the config and tokenizer of --model")
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 5, '
                                                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    parser.add_argument("--dtype", default="auto", help="loramux's activations (auto: a GGUF's is float32)")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--batch", action="store_true", help="also the batch of 32 with low acceptance")
    parser.add_argument("--skip-prompts", action="store_true", help="only the batch of 32 (with --batch)")
    args = parser.parse_args(argv)

    from transformers import AutoConfig, AutoTokenizer

    hf_dir = args.config_dir or default_model_path()
    hf_config, tokenizer = AutoConfig.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(hf_dir)
    workdir = scratch_dir("loramux-speculative-")
    adapter = write_adapter(os.path.join(workdir, "a0"), hf_config, 16, seed=0)
    prompts = {name: chat_prompt(tokenizer, text) for name, text in PROMPTS.items()}
    context = max(map(len, prompts.values())) + args.max_tokens + 16
    llm = LLM(model=args.model, dtype=args.dtype, lora=LoRAConfig(max_loras=8, max_lora_rank=16), max_num_seqs=32,
              max_model_len=max(context, 160), speculative_config=args.speculative_config,
              enable_prefix_caching=False)  # each repeat prefills its prompt again, as llama.cpp does after reset()
    assert llm.load_adapter("a0", adapter)
    report = {"model": os.path.basename(args.model or default_gguf_path()), "adapter": "random, rank 16, 7 projections",
              "speculative_config": json.loads(args.speculative_config), "max_tokens": args.max_tokens, "dtype": args.dtype,
              "threads": torch.get_num_threads(), "load_before": cpu_load(), "prompts": {}}
    if not args.skip_llama_cpp and not args.skip_prompts:
        args.llama_models = llama_models(gguf_of(args.model), context)
    for name, prompt in ({} if args.skip_prompts else prompts).items():
        report["prompts"][name] = interleaved(phases_for(args, llm, prompt, "a0"), args.repeats)
        report["prompts"][name]["prompt_tokens"] = len(prompt)
        print(name, json.dumps(report["prompts"][name]), flush=True)
    if args.batch:
        for i in range(8):
            assert llm.load_adapter(f"b{i}", write_adapter(os.path.join(workdir, f"b{i}"), hf_config, 16, seed=i + 1))
        report["batch"] = batch_phase(args, llm, hf_config.vocab_size)
    report["spec_stats"] = {k: v for k, v in vars(llm.engine.core.speculator.stats).items() if k != "by_adapter"}
    report["load_after"] = cpu_load()
    report["ratios"] = ratios(report)
    print_report(report)


def ratios(report: dict) -> dict:
    out = {}
    for name, phases in report["prompts"].items():
        out[f"{name}: spec/plain"] = phases["spec"]["decode_tok_s"] / phases["plain"]["decode_tok_s"]
        if "llama_lookup" in phases:
            out[f"{name}: spec/llama_lookup"] = phases["spec"]["decode_tok_s"] / phases["llama_lookup"]["decode_tok_s"]
            out[f"{name}: llama_lookup/llama"] = phases["llama_lookup"]["decode_tok_s"] / phases["llama"]["decode_tok_s"]
    if "batch" in report:
        out["batch 32: spec/plain"] = report["batch"]["batch_spec"] / report["batch"]["batch_plain"]
        out["batch 32: acceptance"] = report["batch"]["acceptance"]
    return out


def print_report(report: dict) -> None:
    print(f"\n{report['model']} + {report['adapter']}, one request at a time, greedy, up to {report['max_tokens']} "
          f"tokens, {report['threads']} threads; load average {report['load_before']:.2f} -> {report['load_after']:.2f}")
    print(f"{'prompt':<10}{'phase':<14}{'TTFT ms':>10}{'decode tok/s':>14}{'tokens':>8}")
    for name, phases in report["prompts"].items():
        for phase in ("spec", "plain", "llama_lookup", "llama"):
            if phase in phases:
                p = phases[phase]
                print(f"{name:<10}{phase:<14}{p['ttft_ms']:10.1f}{p['decode_tok_s']:14.1f}{p['tokens']:8d}")
    for label, value in report["ratios"].items():
        print(f"  {label:<32}{value:6.2f}x")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
