"""Offline multi-LoRA throughput, loramux against vLLM on the same model, adapters and prompts, in one run
(on a CPU, against vLLM's CPU build).

Cases, each over the same --requests prompts of --prompt-len random tokens + --new-tokens new ones (greedy,
ignore_eos), on one engine per side with 32 LoRA slots of rank 16:
  base      no adapter
  single    every request on one adapter
  mixed8    8 adapters, interleaved
  mixed32   32 adapters, one per request (with 32 requests)
Adapters: rank 16 on all 7 projections, random. The model: the embedded SmolLM2-135M (default), or a random
checkpoint of a published shape (--shape llama-1b: Llama-3.2-1B's, llama-8b: Llama-3.1-8B's; tiny: a 2-layer
stand-in for the scripts' own tests; vocabulary 49152, SmolLM2's tokenizer), made once under ~/.cache/loramux/bench-vs-vllm. loramux runs in this process,
then vLLM in its own venv's Python (benchmarks/vllm_offline.py): each side's best of --repeats rounds,
after a warm-up run. Prints tok/s, ratios and one JSON line.

  .venv/bin/python benchmarks/vs_vllm.py                                  # CPU, vLLM's CPU build
  .venv/bin/python benchmarks/vs_vllm.py --device cuda --shape llama-1b --requests 256 \\
      --vllm-python /path/to/vllm-venv/bin/python                        # a GPU, `pip install vllm` there
"""
from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import cpu_load, write_adapter  # noqa: E402

SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),  # smoke tests of the scripts
}
CACHE = os.path.expanduser("~/.cache/loramux/bench-vs-vllm")


def make_files(args, adapters: int = 32) -> tuple[str, dict[str, str]]:
    """The model (--model, --shape's random checkpoint, or the embedded default) and 32 adapters, made once."""
    from transformers import AutoConfig

    from loramux.models.loader import default_model_path

    root = os.path.join(args.workdir, args.shape or os.path.basename((args.model or "smollm2-135m").rstrip("/")))
    model = args.model or (default_model_path() if args.shape is None else
                           _make_model(os.path.join(root, "model"), SHAPES[args.shape], args.tokenizer))
    config = AutoConfig.from_pretrained(model)
    dirs = {f"a{i}": os.path.join(root, "adapters", f"a{i}") for i in range(adapters)}
    for i, (name, path) in enumerate(dirs.items()):
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            write_adapter(path, config, 16, seed=i)
    return model, dirs


def _make_model(path: str, shape: dict, tokenizer: str | None) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from loramux.models.loader import default_model_path

    print(f"making a random checkpoint under {path} ...", flush=True)
    torch.manual_seed(0)
    config = LlamaConfig(**shape, vocab_size=49152, bos_token_id=1, eos_token_id=2, max_position_embeddings=8192)
    # Initialised where it is fastest: an 8B model's random init takes minutes on a CPU, seconds on a GPU.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    source = tokenizer or default_model_path()  # SmolLM2's tokenizer
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(source, name), path)
    return path


def workload(args, vocab: int) -> tuple[list[list[int]], dict[str, list]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    cases = {"base": [None] * args.requests, "single": ["a0"] * args.requests,
             "mixed8": [f"a{i % 8}" for i in range(args.requests)],
             "mixed32": [f"a{i % 32}" for i in range(args.requests)]}
    return prompts, cases


def run_loramux(args, model: str, adapters: dict, prompts, cases) -> dict[str, list[float]]:
    from loramux import LLM, LoRAConfig, SamplingParams

    llm = LLM(model=model, dtype=args.dtype, device=args.device, max_num_seqs=args.requests,
              max_model_len=args.prompt_len + args.new_tokens + 16,
              lora=LoRAConfig(max_loras=32, max_cpu_loras=32, max_lora_rank=16), enforce_eager=args.enforce_eager)
    for name, path in adapters.items():
        assert llm.load_adapter(f"{name}={path}"), name
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)

    def run(case: str) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, adapters=cases[case], use_tqdm=False)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)

    run("base")  # warm-up
    tok_s = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case in cases:
            tok_s[case].append(run(case))
    del llm
    gc.collect()
    return tok_s


def run_vllm(args, model: str, adapters: dict, prompts, cases) -> dict[str, list[float]]:
    job = {"model": model, "dtype": args.dtype, "max_loras": 32, "max_rank": 16, "max_num_seqs": args.requests,
           "max_model_len": args.prompt_len + args.new_tokens + 16, "prompts": prompts, "new_tokens": args.new_tokens,
           "cases": cases, "adapters": adapters, "repeats": args.repeats, "eager": args.device == "cpu"}
    env = dict(os.environ)
    if args.device == "cpu":  # both cores for its compute threads, and a KV cache that fits this machine
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_KVCACHE_SPACE="2")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_offline.py")
    done = subprocess.run([args.vllm_python, script], input=json.dumps(job), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"vLLM failed:\n{done.stderr[-4000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"tok_s"')]  # vLLM prints too
    if not lines:
        sys.exit(f"vLLM printed no result:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(lines[-1])["tok_s"]


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--model", default=None, help="an HF directory instead (both sides must load it)")
    parser.add_argument("--workdir", default=CACHE, help="where the random checkpoint and adapters are kept")
    parser.add_argument("--tokenizer", default=None,
                        help="a directory with SmolLM2's tokenizer files for --shape (default: the embedded model's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-python", default="/tmp/vllm-cpu-venv/bin/python",
                        help="the Python of a venv with vLLM (on a CPU: bash benchmarks/vllm_cpu_venv.sh)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="loramux's decode without CUDA graphs")
    args = parser.parse_args(argv)
    model, adapters = make_files(args)
    from transformers import AutoConfig

    prompts, cases = workload(args, AutoConfig.from_pretrained(model).vocab_size)
    report = {"model": args.shape or os.path.basename(model.rstrip("/")), "device": args.device, "dtype": args.dtype,
              "requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "enforce_eager": args.enforce_eager,
              "load_before": cpu_load(), "loramux": run_loramux(args, model, adapters, prompts, cases)}
    if not args.skip_vllm:
        report["vllm"] = run_vllm(args, model, adapters, prompts, cases)
    report["load_after"] = cpu_load()
    print_report(report)


def print_report(report: dict) -> None:
    sides = [s for s in ("loramux", "vllm") if s in report]
    best = {s: {case: max(runs) for case, runs in report[s].items()} for s in sides}
    print(f"\n{report['model']} {report['dtype']} on {report['device']}: {report['requests']} requests x "
          f"({report['prompt_len']} + {report['new_tokens']}); load average {report['load_before']:.2f} -> "
          f"{report['load_after']:.2f}; output tok/s, best of {len(report['loramux']['base'])}")
    print(f"{'case':<10}" + "".join(f"{s:>10}" for s in sides) + ("   loramux/vllm" if len(sides) == 2 else ""))
    ratios = {}
    for case in best["loramux"]:
        row = f"{case:<10}" + "".join(f"{best[s][case]:>10.1f}" for s in sides)
        if len(sides) == 2:
            ratios[f"{case} loramux/vllm"] = best["loramux"][case] / best["vllm"][case]
            row += f"{ratios[f'{case} loramux/vllm']:>14.2f}x"
        print(row)
    for side in sides:
        ratios[f"{side} mixed8/base"] = best[side]["mixed8"] / best[side]["base"]
        print(f"  {side} mixed8/base {ratios[f'{side} mixed8/base']:.2f}")
    report["best"], report["ratios"] = best, ratios
    print(json.dumps(report))


if __name__ == "__main__":
    main()
