"""Throughput of loramux against its peers, in one run, on SmolLM2-135M-Instruct (the embedded default).

Workload: 32 requests x (64 prompt + 64 new tokens), greedy, ignore_eos; 8 random adapters
of ranks 8/16 on all 7 projections. Rows:
  loramux base / single adapter / 8 mixed adapters / 32 distinct adapters (max_loras=32)
  (--batch-invariant: also 8 mixed adapters with EngineConfig.batch_invariant, in the same rounds)
  (--dora: 8 mixed DoRA adapters, the same A and B as the 8 with magnitude vectors, and the 8 plain ones, on one
   engine of 16 slots of their own: mixed8_dora against mixed8_lora on the same engine, in the same rounds)
  (--combinations: 8 weighted pairs of rank-8 adapters (PEFT's cat: rank 16) against 8 rank-16 adapters, on
   one engine of 16 slots of their own: mixed8_pairs against mixed8_r16, in the same rounds)
  HF base (transformers generate) / HF PEFT mixed (generate(adapter_names=...))
Prints tokens/s, the ratios (ours / peer) and one JSON line. Every row first runs once untimed (warm-up:
caches, and each case's adapters loaded into device slots, as a serving engine keeps them resident),
then is timed --repeats times (rows of one engine interleaved round by round); it reports its best run
and its median run, and ratios of both, peers included; for rows of one engine also the median of the
per-round ratios ("paired": both rows of a round ran under the same machine conditions). The JSON line
keeps every run.
The machine's load is recorded: on 2 cores, any other busy process distorts every number.

  .venv/bin/python benchmarks/throughput.py [--dtypes float32 bfloat16] [--skip-hf]
  .venv/bin/python benchmarks/throughput.py --sweep [--chart throughput.png]   (= `loramux bench`)

--sweep measures loramux alone: tokens/s against batch size for base / one adapter / mixed adapters,
and against the number of distinct adapters in a batch of 32; it prints a table, writes a PNG chart
and one JSON line.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace

import torch
from safetensors.torch import save_file

from loramux import LoRAConfig
from loramux.llm import LLM
from loramux.models.llama import head_dim_of
from loramux.models.loader import default_model_path
from loramux.sampling_params import SamplingParams, StructuredOutputsParams

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def scratch_dir(prefix: str) -> str:
    """A new working directory for a benchmark's adapters and datasets, removed when the process exits (with a
    thousand adapters it holds GBs)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def write_adapter(path: str, hf_config, rank: int, seed: int, projections: tuple[str, ...] | None = None) -> str:
    """A random PEFT adapter on all 7 projections (or those named), in PEFT's own file format."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, head_dim = hf_config.hidden_size, hf_config.intermediate_size, head_dim_of(hf_config)
    kv = hf_config.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for block, names in PROJECTIONS.items():
            for name in names if projections is None else [n for n in names if n in projections]:
                n_in, n_out = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": [n for names in PROJECTIONS.values() for n in names if n in (projections or names)],
              "lora_dropout": 0.0}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def write_dora_adapter(path: str, lora_dir: str, model_path: str) -> str:
    """The adapter at lora_dir as a DoRA adapter: each module's magnitude vector that of PEFT's start (the
    norm of W + s B A per output row, from the model's own weights) moved by up to 5%."""
    from safetensors.torch import load_file

    with open(os.path.join(lora_dir, "adapter_config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(lora_dir, "adapter_model.safetensors"))
    weights = load_file(os.path.join(model_path, "model.safetensors"))
    gen, scaling = torch.Generator().manual_seed(len(path)), config["lora_alpha"] / config["r"]
    for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
        module = key.removesuffix(".lora_A.weight")
        w = weights[module.removeprefix("base_model.model.") + ".weight"].float()
        norm = (w + scaling * tensors[f"{module}.lora_B.weight"] @ tensors[key]).norm(dim=1)
        tensors[f"{module}.lora_magnitude_vector"] = norm * (0.95 + 0.1 * torch.rand(norm.shape, generator=gen))
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({**config, "use_dora": True}, f)
    return path


def pair_combinations(names: list[str]) -> list[dict[str, float]]:
    """8 distinct weighted pairs of `names` (4 of them: each ordered pair of neighbours, and of those two apart)."""
    k = len(names)
    return [{names[i]: 0.5, names[(i + step) % k]: 1.0} for step in (1, 2) for i in range(k)][:8]


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def cpu_load() -> float:
    return os.getloadavg()[0]


def run_loramux(path, dtype, adapter_dirs, prompts, params, max_loras, batch_invariant=False, device="cpu"):
    max_len = len(prompts[0]) + params.max_tokens
    llm = LLM(model=path, lora=LoRAConfig(max_loras=max_loras, max_cpu_loras=max(32, max_loras), max_lora_rank=16),
              dtype=dtype, max_num_seqs=len(prompts), max_model_len=max(256, max_len), batch_invariant=batch_invariant,
              device=device)
    for name, adapter_dir in adapter_dirs.items():
        assert llm.load_adapter(f"{name}={adapter_dir}"), name
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)  # warm-up
    return llm


def rounds(cases: dict, run, repeats: int) -> tuple[dict, dict]:
    """Time run(case) for every case, round by round (drift hits all cases alike), after one untimed warm-up
    round: {label: [seconds]}, first outputs."""
    seconds, outputs = {label: [] for label in cases}, {}
    for case in cases.values():
        run(case)
    for _ in range(repeats):
        for label, case in cases.items():
            out, s = timed(lambda: run(case))
            seconds[label].append(s)
            outputs.setdefault(label, out)
    return seconds, outputs


JSON_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4096}}, "required": ["text"]}
"""The constrained rows' schema: a JSON string longer than any run, so they generate all their tokens too."""


def loramux_rows(path, dtype, adapter_dirs, prompts, params, repeats, batch_invariant=False, structured=False,
                 device="cpu", dora_dirs=None, combinations=False):
    """base / single / mixed8 (and mixed8 with batch_invariant, or with a quarter of its requests JSON-schema
    constrained, same rounds), then the 32-slot engine's rows."""
    n, eight = len(prompts), {k: adapter_dirs[k] for k in list(adapter_dirs)[:8]}
    engines = {"main": run_loramux(path, dtype, eight, prompts, params, 8, device=device)}
    mixed = [f"a{i % 8}" for i in range(n)]
    cases = {"base": ("main", None), "single": ("main", "a0"), "mixed8": ("main", mixed)}
    if batch_invariant:
        engines["invariant"] = run_loramux(path, dtype, eight, prompts, params, 8, batch_invariant=True, device=device)
        cases["mixed8_invariant"] = ("invariant", mixed)
    if dora_dirs:  # DoRA and plain twins on one engine (16 slots: none swapped), against each other
        engines["dora"] = run_loramux(path, dtype, eight | dora_dirs, prompts, params, 16, device=device)
        cases["mixed8_lora"] = ("dora", mixed)
        cases["mixed8_dora"] = ("dora", [f"d{i % 8}" for i in range(n)])
    if combinations:  # pairs of rank-8 adapters (a0, a2, ...) against single rank-16 ones (a1, a3, ...)
        pairs = pair_combinations([f"a{i}" for i in range(0, 32, 2)][:4])
        engines["combinations"] = run_loramux(path, dtype, adapter_dirs, prompts, params, 16, device=device)
        cases["mixed8_pairs"] = ("combinations", [pairs[i % 8] for i in range(n)])
        cases["mixed8_r16"] = ("combinations", [f"a{2 * (i % 8) + 1}" for i in range(n)])
    if structured:
        json_params = replace(params, structured_outputs=StructuredOutputsParams(json=json.dumps(JSON_TEXT)))
        cases["mixed8_json25"] = ("main", mixed, [json_params if i % 4 == 0 else params for i in range(n)])

    def generate(case):
        engine, adapters, case_params = (*case, params)[:3]
        outs = engines[engine].generate(prompts, case_params, adapters=adapters, use_tqdm=False)
        assert all(len(o.token_ids) == params.max_tokens for o in outs)  # every row generated all its tokens
        return [o.token_ids for o in outs]

    seconds, outputs = rounds(cases, generate, repeats)
    engines.clear()
    engines["max32"] = run_loramux(path, dtype, adapter_dirs, prompts, params, 32, device=device)
    more, _ = rounds({"single_max32": ("max32", "a0"), "distinct32": ("max32", [f"a{i}" for i in range(n)])},
                     generate, repeats)
    return seconds | more, outputs


def hf_rows(path, dtype, adapter_dirs, prompts, new_tokens, repeats, device="cpu"):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()
    input_ids = torch.tensor(prompts, device=device)
    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        base_s, _ = rounds({"hf_base": None}, lambda _: model.generate(input_ids, **kwargs), repeats)
        names = [f"a{i}" for i in range(8)]
        peft = PeftModel.from_pretrained(model, adapter_dirs["a0"], adapter_name="a0")  # wraps `model` in place
        for name in names[1:]:
            peft.load_adapter(adapter_dirs[name], adapter_name=name)
        rows = [names[i % 8] for i in range(len(prompts))]
        mixed_s, out = rounds({"peft_mixed8": rows},
                              lambda r: peft.generate(input_ids=input_ids, adapter_names=r, **kwargs), repeats)
    return base_s | mixed_s, out["peft_mixed8"][:, input_ids.shape[1]:].tolist()


def sweep(path, dtype, adapter_dirs, prompts, params, batch_sizes, distinct_counts) -> dict:
    """tok/s of loramux alone: by batch size (base / single / mixed) and by distinct adapters."""
    llm = run_loramux(path, dtype, adapter_dirs, prompts, params, max(distinct_counts))
    names = list(adapter_dirs)

    def tok_s(batch, adapters):
        _, seconds = timed(lambda: llm.generate(prompts[:batch], params, adapters=adapters, use_tqdm=False))
        return batch * params.max_tokens / seconds

    by_batch = {b: {"base": tok_s(b, None), "single": tok_s(b, names[0]),
                    "mixed": tok_s(b, [names[i % min(8, b)] for i in range(b)])} for b in batch_sizes}
    batch = max(batch_sizes)
    by_distinct = {k: tok_s(batch, [names[i % k] for i in range(batch)]) for k in distinct_counts}
    return {"dtype": dtype, "by_batch": by_batch, "by_distinct": by_distinct, "batch_for_distinct": batch}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    by_batch = {int(b): row for b, row in result["by_batch"].items()}  # int keys, also when read back from JSON
    by_distinct = {int(k): v for k, v in result["by_distinct"].items()}
    sizes, counts = sorted(by_batch), sorted(by_distinct)
    for mode in ("base", "single", "mixed"):
        left.plot(sizes, [by_batch[b][mode] for b in sizes], marker="o", label=mode)
    left.set(xlabel="requests in the batch", ylabel="generated tokens/s", title="by batch size")
    left.legend()
    right.plot(counts, [by_distinct[k] for k in counts], marker="o", color="tab:red")
    right.set(xlabel="distinct adapters in the batch", ylabel="generated tokens/s",
              title=f"batch of {result['batch_for_distinct']}, by distinct adapters")
    for axis, ticks in ((left, sizes), (right, counts)):
        axis.set_xscale("log", base=2)
        axis.set_xticks(ticks, [str(t) for t in ticks])
        axis.set_ylim(bottom=0)
    fig.suptitle(f"loramux, {result['model']}, {result['dtype']}, {os.cpu_count()} CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_sweep(result: dict) -> None:
    print(f"\n{result['model']} ({result['dtype']}), {result['prompt_len']} prompt + {result['new_tokens']} new tokens, "
          f"load average {result['load_before']:.2f} -> {result['load_after']:.2f}")
    print(f"{'batch':>6}{'base':>10}{'single':>10}{'mixed':>10}   tok/s")
    for b, row in result["by_batch"].items():
        print(f"{b:>6}{row['base']:>10.1f}{row['single']:>10.1f}{row['mixed']:>10.1f}")
    print(f"{'distinct adapters':>18}{'tok/s':>10}   (batch {result['batch_for_distinct']})")
    for k, value in result["by_distinct"].items():
        print(f"{k:>18}{value:>10.1f}")
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--dtypes", nargs="+", default=None, help="default: float32 bfloat16 (sweep: bfloat16)")
    parser.add_argument("--device", default="cpu", help="where both loramux and the HF peers run (cpu, cuda)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true", help="only loramux rows (no peers, no ratios to them)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the best one is reported")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also mixed8 with EngineConfig.batch_invariant (its cost: mixed8_invariant/mixed8)")
    parser.add_argument("--structured", action="store_true",
                        help="also mixed8 with 25%% of the requests JSON-schema constrained (mixed8_json25/mixed8)")
    parser.add_argument("--dora", action="store_true",
                        help="also 8 mixed DoRA adapters of the same ranks (their cost: mixed8_dora/mixed8)")
    parser.add_argument("--combinations", action="store_true",
                        help="also 8 weighted pairs of rank-8 adapters against 8 rank-16 ones (mixed8_pairs/mixed8_r16)")
    parser.add_argument("--sweep", action="store_true", help="throughput curves and a PNG chart (loramux bench)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--distinct", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--chart", default="throughput.png", help="where --sweep writes its chart")
    args = parser.parse_args(argv)

    path = args.model or default_model_path()
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    requests = max(args.requests, *args.batch_sizes) if args.sweep else args.requests
    prompts = torch.randint(10, hf_config.vocab_size, (requests, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    workdir = scratch_dir("loramux-bench-")
    num_adapters = max(32, *args.distinct) if args.sweep else 32
    adapter_dirs = {f"a{i}": write_adapter(os.path.join(workdir, f"a{i}"), hf_config, (8, 16)[i % 2], seed=i)
                    for i in range(num_adapters)}
    report = {"model": os.path.basename(path.rstrip("/")), "device": args.device, "requests": requests,
              "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "load_before": cpu_load()}
    if args.sweep:
        dtype = (args.dtypes or ["bfloat16"])[0]
        report.update(sweep(path, dtype, adapter_dirs, prompts, params, args.batch_sizes, args.distinct))
        report["load_after"] = cpu_load()
        plot(report, args.chart)
        print_sweep(report)
        print(f"chart written to {args.chart}")
        return
    dtypes = args.dtypes or ["float32", "bfloat16"]
    tokens = requests * args.new_tokens
    for dtype in dtypes:
        dora_dirs = {f"d{i}": write_dora_adapter(os.path.join(workdir, f"d{i}"), adapter_dirs[f"a{i}"], path)
                     for i in range(8)} if args.dora else None
        seconds, our_tokens = loramux_rows(path, dtype, adapter_dirs, prompts, params, args.repeats,
                                           args.batch_invariant, args.structured, args.device, dora_dirs,
                                           args.combinations)
        if not args.skip_hf:
            peer_seconds, peft_tokens = hf_rows(path, dtype, adapter_dirs, prompts, args.new_tokens, args.repeats,
                                                args.device)
            seconds |= peer_seconds
        report[dtype] = {label: tokens / min(runs) for label, runs in seconds.items()}  # best run
        report[dtype]["median_tok_s"] = {label: statistics.median(tokens / s for s in runs)
                                         for label, runs in seconds.items()}
        report[dtype]["runs_tok_s"] = {label: [round(tokens / s, 1) for s in runs] for label, runs in seconds.items()}
        if not args.skip_hf:
            equal = sum(a == b for a, b in zip(our_tokens["mixed8"], peft_tokens))
            report[dtype]["greedy_rows_equal_to_peft"] = equal / len(prompts)
    report["load_after"] = cpu_load()
    print_report(report, dtypes)


def print_report(report: dict, dtypes: list[str]) -> None:
    print(f"\n{report['model']}, {report['requests']} requests x ({report['prompt_len']} prompt + {report['new_tokens']} new) "
          f"tokens, greedy; load average {report['load_before']:.2f} -> {report['load_after']:.2f}")
    print(f"{'dtype':<10}{'row':<18}{'tok/s: best':>12}{'median':>9}   all runs")
    for dtype in dtypes:
        for label, runs in report[dtype]["runs_tok_s"].items():
            median = report[dtype]["median_tok_s"][label]
            print(f"{dtype:<10}{label:<18}{report[dtype][label]:>12.1f}{median:>9.1f}   {runs}")
        if "greedy_rows_equal_to_peft" in report[dtype]:
            print(f"{dtype:<10}greedy rows equal to PEFT's: {report[dtype]['greedy_rows_equal_to_peft']:.0%}")
    report["ratios"] = ratios(dtypes, lambda dtype: report[dtype])
    report["ratios_median"] = ratios(dtypes, lambda dtype: report[dtype]["median_tok_s"])
    report["ratios_paired"] = paired_ratios(dtypes, lambda dtype: report[dtype]["runs_tok_s"])
    print(f"\nratios (ours / peer){'best':>32}{'median':>7}{'paired':>8}")
    for label, value in report["ratios"].items():
        paired = report["ratios_paired"].get(label)
        print(f"  {label:<44}{value:6.2f}x{report['ratios_median'][label]:7.2f}x" + (f"{paired:7.2f}x" if paired else ""))
    print(json.dumps(report))


# Rows that one engine runs in the same rounds, back to back: the ratio of each round compares them under
# the same machine conditions; the median of those per-round ratios is the least noisy of the three.
PAIRED = {"mixed8/base": ("mixed8", "base"), "distinct32/single(max_loras=32)": ("distinct32", "single_max32"),
          "mixed8_invariant/mixed8": ("mixed8_invariant", "mixed8"), "mixed8_json25/mixed8": ("mixed8_json25", "mixed8"),
          "mixed8_dora/mixed8_lora": ("mixed8_dora", "mixed8_lora"),
          "mixed8_pairs/mixed8_r16": ("mixed8_pairs", "mixed8_r16")}


def paired_ratios(dtypes: list[str], runs_of) -> dict:
    """{dtype:label: median over rounds of row / row} for the PAIRED rows that ran; runs_of(dtype) -> {row: [tok/s]}."""
    out = {}
    for dtype in dtypes:
        runs = runs_of(dtype)
        for label, (num, den) in PAIRED.items():
            if num in runs and den in runs:
                out[f"{dtype}:{label}"] = statistics.median(a / b for a, b in zip(runs[num], runs[den]))
    return out


def ratios(dtypes: list[str], tok_s) -> dict:
    """The targets' ratios from one statistic of the rows: tok_s(dtype) -> {label: tokens/s}."""
    out = {}
    for dtype in dtypes:
        r = tok_s(dtype)
        for label, (num, den) in PAIRED.items():
            if num in r and den in r:
                out[f"{dtype}:{label}"] = r[num] / r[den]
        if "peft_mixed8" in r:
            out[f"{dtype}:mixed8/peft_mixed8"] = r["mixed8"] / r["peft_mixed8"]
            out[f"{dtype}:base/hf_base"] = r["base"] / r["hf_base"]
    if all("peft_mixed8" in tok_s(d) for d in dtypes):
        best_dtype = lambda label: max(tok_s(d)[label] for d in dtypes)  # noqa: E731
        out["best:mixed8/peft_mixed8"] = best_dtype("mixed8") / best_dtype("peft_mixed8")
    return out


if __name__ == "__main__":
    main()
