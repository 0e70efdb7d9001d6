"""Mixture-of-experts throughput: loramux on a small Qwen3-MoE-shaped model, base against 8 mixed
adapters that target the experts, against HF transformers and PEFT on the same weights, in one run.

The model: Qwen3-MoE's architecture with random weights (hidden 768, 12 layers, 12 heads / 4 KV heads of 64,
32 experts of intermediate 384, top-4 renormalized, tied 49152-token vocabulary; 0.40B parameters, 0.08B
active a token), SmolLM2's tokenizer, made once under --workdir. Adapters: 8 PEFT adapters of rank 16 on
q/k/v/o and, through PEFT's target_parameters, on every expert's gate_up_proj and down_proj (the form PEFT
0.21 writes for transformers 5's 3D experts), made with PEFT itself, random.
Workload: 32 requests x (64 random prompt tokens + 64 new tokens), greedy, ignore_eos. Rows:
  loramux base / mixed8 (request i uses adapter i % 8), the C++ fused-experts op (rounds interleaved)
  loramux base with moe_backend="torch" (the reference op the kernel replaces)
  HF base: transformers generate, batch 32
  HF PEFT: one adapter's 4 requests per generate call (PEFT's target_parameters layers refuse mixed-adapter
           batches: "does not support mixed batch inference"), --peft-adapters of the 8 (each is slow)
Every row runs once untimed first, then --repeats times; best and median tok/s, ratios, one JSON line; also
whether the base rows' greedy tokens are the same with either fused-experts op, and the share of PEFT's
requests whose greedy tokens the mixed8 row reproduces (fp32: all; bf16: rounding may flip a near tie).

  .venv/bin/python benchmarks/moe.py [--dtype bfloat16] [--repeats 3] [--skip-hf]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import cpu_load, rounds  # noqa: E402

SHAPES = {
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                  num_experts=32, num_experts_per_tok=4, moe_intermediate_size=384, intermediate_size=1536,
                  norm_topk_prob=True, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
                  rms_norm_eps=1e-6),
    # a smoke test's (tests/test_benchmark.py)
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                 norm_topk_prob=True, vocab_size=49152, max_position_embeddings=512, tie_word_embeddings=True,
                 rms_norm_eps=1e-6),
}
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def make_files(workdir: str, shape: dict, adapters: int = 8) -> tuple[str, dict[str, str]]:
    """The random model and its adapters, made once."""
    model_dir = os.path.join(workdir, "model")
    names = [f"a{i}" for i in range(adapters)]
    dirs = {name: os.path.join(workdir, "adapters", name) for name in names}
    if all(os.path.isfile(os.path.join(d, "adapter_config.json")) for d in dirs.values()):
        return model_dir, dirs
    model = _make_model(model_dir, shape)
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=16, lora_alpha=32, target_modules=ATTENTION, target_parameters=EXPERT_PARAMETERS)
    for i, name in enumerate(names):
        print(f"making adapter {name} ...", flush=True)
        peft = get_peft_model(model, config)
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for key, p in peft.named_parameters():
                if "lora_" in key:  # B starts at zero: give every adapter weights of its own
                    p.copy_(torch.randn(p.shape, generator=gen) * (0.02 if "lora_B" in key else 1 / p.shape[-1] ** 0.5))
        peft.save_pretrained(dirs[name])
        model = peft.unload()
    return model_dir, dirs


def _make_model(path: str, shape: dict):
    import shutil

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from loramux.models.loader import default_model_path

    print("making the random Qwen3-MoE-shaped model ...", flush=True)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, bos_token_id=1, eos_token_id=2)).eval()
    with torch.no_grad():  # transformers 5 starts the router at zero: every token would pick experts 0-3
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(path)
    source = default_model_path()  # SmolLM2's tokenizer
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(source, name), path)
    return model


def prompts_of(n: int, length: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def loramux_rows(model_dir, dtype, adapter_dirs, prompts, new_tokens, repeats) -> tuple[dict, dict]:
    from loramux import LoRAConfig, SamplingParams
    from loramux.llm import LLM

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engines = {}
    for backend in ("auto", "torch"):
        llm = LLM(model=model_dir, dtype=dtype, moe_backend=backend, max_num_seqs=len(prompts),
                  max_model_len=len(prompts[0]) + new_tokens + 64,
                  lora=LoRAConfig(max_loras=len(adapter_dirs), max_lora_rank=16, target_modules=(*ATTENTION, "experts")))
        if backend == "auto":
            for name, path in adapter_dirs.items():
                assert llm.load_adapter(name, path), name
        engines[backend] = llm
    mixed = [f"a{i % len(adapter_dirs)}" for i in range(len(prompts))]
    cases = {"base": ("auto", None), "mixed8": ("auto", mixed), "base_torch_op": ("torch", None)}

    def generate(case):
        engine, adapters = case
        outs = engines[engine].generate(prompts, params, adapters=adapters, use_tqdm=False)
        assert all(len(o.token_ids) == new_tokens for o in outs)
        return [o.token_ids for o in outs]

    return rounds(cases, generate, repeats)


def hf_rows(model_dir, dtype, adapter_dirs, prompts, new_tokens, repeats, peft_adapters) -> tuple[dict, dict]:
    """HF base and PEFT per adapter: ({label: [seconds]}, {request index: PEFT's greedy tokens})."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    def generate(m, ids):
        ids = torch.tensor(ids)
        return m.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)

    with torch.inference_mode():
        seconds, _ = rounds({"hf_base": None}, lambda _: generate(model, prompts), repeats)
        names = list(adapter_dirs)[:peft_adapters]
        peft = PeftModel.from_pretrained(model, adapter_dirs[names[0]], adapter_name=names[0])
        for name in names[1:]:
            peft.load_adapter(adapter_dirs[name], adapter_name=name)
        indices = {name: [i for i in range(len(prompts)) if i % len(adapter_dirs) == int(name[1:])] for name in names}

        def per_adapter(_):
            tokens = {}
            for name, rows in indices.items():
                peft.set_adapter(name)
                out = generate(peft, [prompts[i] for i in rows])[:, len(prompts[0]):].tolist()
                tokens |= dict(zip(rows, out))
            return tokens

        peft_s, outputs = rounds({"peft_per_adapter": None}, per_adapter, repeats)
    return seconds | peft_s, outputs["peft_per_adapter"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=os.path.expanduser("~/.cache/loramux/bench-moe"))
    parser.add_argument("--shape", default="small", choices=list(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peft-adapters", type=int, default=2, help="adapters the HF PEFT row runs (each is slow)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    model_dir, adapter_dirs = make_files(os.path.join(args.workdir, args.shape), SHAPES[args.shape])
    prompts = prompts_of(args.requests, args.prompt_len)
    model = "Qwen3-MoE shape (0.40B, 32 experts top-4)" if args.shape == "small" else f"Qwen3-MoE shape {args.shape}"
    report = {"model": f"{model}, random weights", "dtype": args.dtype,
              "requests": args.requests, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "load_before": cpu_load()}
    seconds, outputs = loramux_rows(model_dir, args.dtype, adapter_dirs, prompts, args.new_tokens, args.repeats)
    tokens = {label: args.requests * args.new_tokens for label in seconds}
    report["same_base_tokens"] = outputs["base"] == outputs["base_torch_op"]
    if not args.skip_hf:
        hf_seconds, peft_tokens = hf_rows(model_dir, args.dtype, adapter_dirs, prompts, args.new_tokens,
                                            args.repeats, args.peft_adapters)
        seconds |= hf_seconds
        tokens |= {"hf_base": args.requests * args.new_tokens, "peft_per_adapter": len(peft_tokens) * args.new_tokens}
        report["mixed8_rows_equal_to_peft"] = statistics.mean(outputs["mixed8"][i] == t for i, t in peft_tokens.items())
    report["load_after"] = cpu_load()
    report["seconds"] = seconds
    report["tok_s"] = {label: {"best": tokens[label] / min(s), "median": tokens[label] / statistics.median(s)}
                       for label, s in seconds.items()}
    report["paired_mixed8_over_base"] = statistics.median(m / b for m, b in zip(seconds["base"], seconds["mixed8"]))
    print_report(report)


def print_report(report: dict) -> None:
    tok_s = report["tok_s"]
    print(f"\n{report['model']}, {report['dtype']}; {report['requests']} requests x ({report['prompt_len']} prompt + "
          f"{report['new_tokens']} new tokens); load average {report['load_before']:.2f} -> {report['load_after']:.2f}")
    print(f"{'row':<20}{'best tok/s':>12}{'median':>10}")
    for label, r in tok_s.items():
        print(f"{label:<20}{r['best']:>12.1f}{r['median']:>10.1f}")
    ratios = {"mixed8 / base (paired)": report["paired_mixed8_over_base"],
              "base / base_torch_op": tok_s["base"]["median"] / tok_s["base_torch_op"]["median"]}
    if "hf_base" in tok_s:
        ratios["base / hf_base"] = tok_s["base"]["median"] / tok_s["hf_base"]["median"]
        ratios["mixed8 / peft_per_adapter"] = tok_s["mixed8"]["median"] / tok_s["peft_per_adapter"]["median"]
    report["ratios"] = ratios
    for label, value in ratios.items():
        print(f"  {label:<32}{value:7.2f}x")
    print(f"  base tokens equal with either fused-experts op: {report['same_base_tokens']}")
    if "mixed8_rows_equal_to_peft" in report:
        print(f"  mixed8 rows whose greedy tokens equal PEFT's (that adapter alone): "
              f"{report['mixed8_rows_equal_to_peft']:.0%}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
