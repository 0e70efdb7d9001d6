"""Quantized bases: loramux on a 1B-class model as bf16, int8, NF4 (bitsandbytes' format) and Q4_K_M, against
llama.cpp on the same Q4_K_M GGUF file and transformers + bitsandbytes on the same NF4 weights, in one run.

The model: SmolLM2-1.7B's shape (hidden 2048, 24 layers, 32 heads, intermediate 8192, tied 49152-token
vocabulary; 1.71B parameters) with random weights, SmolLM2's tokenizer. Made once under --workdir: an HF
checkpoint (bf16 safetensors), an F16 GGUF written with gguf-py (metadata as llama.cpp's converter writes it),
and llama.cpp's own Q4_K_M quantization of it (`llama_model_quantize`, Q4_K with Q6_K for some tensors).
Phases, each in its own process (resident memory is per process):
  bf16       loramux, the HF checkpoint in bfloat16
  int8       the same with --quantization int8 (per output channel; bf16 activations)
  nf4        the HF checkpoint with --quantization bitsandbytes (NF4, blocks of 64, as bitsandbytes' load_in_4bit;
             kept 4-bit; bf16 activations)
  q4_k_m     loramux on the Q4_K_M file, kept as stored (bf16 activations)
  llama_cpp  llama-cpp-python on the Q4_K_M file (one sequence: batch-1 decode and prefill)
  hf_bnb     transformers + bitsandbytes (its CPU backend) on the checkpoint loaded with load_in_4bit (NF4,
             bf16 compute): what a QLoRA user runs; decode at batch 1 and 32
  baseline   a process that imports torch and loramux and loads no model
For each loramux phase: decode tok/s at batch 1, 8 and 32 (--prompt-len prompts, --new-tokens greedy tokens,
the decode steps timed after the prefill), prefill tok/s of one --prefill-len prompt, the weights' bytes and
the process's resident memory (against the file, the KV cache and the LoRA slot buffers, allocated for
max_loras=8 x rank 16 at start); q4_k_m and bf16 also with 8 random rank-16 adapters mixed at batch 32.
Prints ratios for the targets and one JSON line.

  .venv/bin/python benchmarks/quantized.py [--workdir DIR] [--phases baseline bf16 nf4 hf_bnb ...]

Needs llama-cpp-python (`pip install llama-cpp-python`, a ~10 minute build; on a CPU with AMX, llama.cpp's AMX
path crashed here: build it with CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON ... -DGGML_AMX_INT8=OFF", see
benchmarks/README.md). The files take ~6 GB and ~5 minutes to make, once.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
             rms_norm_eps=1e-5, rope_theta=130000.0)
PHASES = ("baseline", "bf16", "int8", "nf4", "q4_k_m", "llama_cpp", "hf_bnb")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- the files ----------------------------------------------------------------------------------------------
def make_files(workdir: str, phases) -> dict:
    """The checkpoint, and the Q4_K_M file when a phase reads it (llama.cpp's quantizer makes it)."""
    paths = {"hf": os.path.join(workdir, "hf"), "f16": os.path.join(workdir, "model-f16.gguf"),
             "q4_k_m": os.path.join(workdir, "model-q4_k_m.gguf")}
    if not os.path.isfile(os.path.join(paths["hf"], "model.safetensors")):
        _make_hf(paths["hf"])
    if not os.path.isfile(paths["q4_k_m"]) and {"q4_k_m", "llama_cpp"} & set(phases):
        if not os.path.isfile(paths["f16"]):
            _write_f16_gguf(paths["hf"], paths["f16"])
        _quantize(paths["f16"], paths["q4_k_m"])
        os.remove(paths["f16"])
    return paths


def _make_hf(path: str) -> None:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from loramux.models.loader import default_model_path

    torch.manual_seed(0)
    print("making a random 1.7B checkpoint ...", flush=True)
    config = LlamaConfig(**{k: v for k, v in SHAPE.items() if k != "rope_theta"}, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": SHAPE["rope_theta"]})
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    source = default_model_path()  # SmolLM2's tokenizer
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(source, name), path)


def _write_f16_gguf(hf_path: str, path: str) -> None:
    """The checkpoint as llama.cpp's converter writes it: q/k rows permuted, SmolLM2's vocabulary and chat
    template copied from the embedded default's GGUF."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    from loramux.models.loader import default_gguf_path

    print("writing the F16 GGUF ...", flush=True)
    source = gguf.GGUFReader(default_gguf_path())
    writer = gguf.GGUFWriter(path, "llama")
    for field in source.fields.values():
        if field.name.startswith(("tokenizer.", "general.name")):
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    writer.add_context_length(SHAPE["max_position_embeddings"])
    writer.add_embedding_length(SHAPE["hidden_size"])
    writer.add_block_count(SHAPE["num_hidden_layers"])
    writer.add_feed_forward_length(SHAPE["intermediate_size"])
    writer.add_head_count(SHAPE["num_attention_heads"])
    writer.add_head_count_kv(SHAPE["num_key_value_heads"])
    writer.add_rope_freq_base(SHAPE["rope_theta"])
    writer.add_layer_norm_rms_eps(SHAPE["rms_norm_eps"])
    writer.add_vocab_size(SHAPE["vocab_size"])
    writer.add_rope_dimension_count(SHAPE["hidden_size"] // SHAPE["num_attention_heads"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, SHAPE["num_hidden_layers"])
    heads = SHAPE["num_attention_heads"]
    with safe_open(os.path.join(hf_path, "model.safetensors"), "pt") as f:
        for hf_name in f.keys():
            module, _, suffix = hf_name.rpartition(".")
            a = f.get_tensor(hf_name).float().numpy()
            if ".q_proj." in hf_name or ".k_proj." in hf_name:
                a = a.reshape(heads, 2, a.shape[0] // heads // 2, a.shape[1]).swapaxes(1, 2).reshape(a.shape)
            writer.add_tensor(f"{names.get_name(module)}.{suffix}", a.astype(np.float32 if a.ndim == 1 else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _quantize(source: str, target: str) -> None:
    import llama_cpp

    print("quantizing to Q4_K_M with llama.cpp ...", flush=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = os.cpu_count() or 2
    if llama_cpp.llama_model_quantize(source.encode(), target.encode(), params) != 0:
        raise RuntimeError("llama.cpp could not quantize the file")


# ---- one phase, in its own process ----------------------------------------------------------------------
def run_phase(name: str, paths: dict, args) -> dict:
    if name == "baseline":
        import torch  # noqa: F401

        import loramux.llm  # noqa: F401

        return {"rss_mb": rss_mb()}
    if name == "llama_cpp":
        return _llama_cpp(paths["q4_k_m"], args)
    if name == "hf_bnb":
        return _hf_bnb(paths["hf"], args)
    return _loramux(name, paths, args)


def _loramux(name: str, paths: dict, args) -> dict:
    from throughput import write_adapter
    from transformers import AutoConfig

    from loramux import LoRAConfig
    from loramux.llm import LLM

    model = paths["q4_k_m"] if name == "q4_k_m" else paths["hf"]
    kv_tokens = 32 * (args.prompt_len + args.new_tokens) + args.prefill_len + 64
    kv_bytes = 2 * SHAPE["num_hidden_layers"] * kv_tokens * SHAPE["hidden_size"] * 2
    quantization = {"int8": "int8", "nf4": "bitsandbytes"}.get(name)
    llm = LLM(model=model, lora=LoRAConfig(max_loras=8, max_lora_rank=16), dtype="bfloat16", max_num_seqs=32,
              quantization=quantization, max_model_len=args.prefill_len + 16, kv_cache_memory=kv_bytes)
    slots = llm.engine.adapters.slot_bytes
    out = {"weight_mb": llm.engine.core.runner.weight_bytes / 2**20, "kv_mb": kv_bytes / 2**20,
           "lora_slots_mb": slots / 2**20, "rss_mb": rss_mb(), "file_mb": _size_mb(model)}
    out["prefill_tok_s"] = _prefill(llm, args)
    for batch in (1, 8, 32):
        out[f"decode_b{batch}_tok_s"] = _decode(llm, batch, args)
    out["rss_run_mb"] = rss_mb()  # after prefill and decode, before any adapter is loaded
    if name in ("bf16", "nf4", "q4_k_m"):
        hf_config = AutoConfig.from_pretrained(paths["hf"])
        names = [f"a{i}" for i in range(8)]
        for i, adapter in enumerate(names):
            path = write_adapter(os.path.join(args.workdir, "adapters", adapter), hf_config, 16, seed=i)
            assert llm.load_adapter(adapter, path)
        out["decode_b32_mixed8_tok_s"] = _decode(llm, 32, args, [names[i % 8] for i in range(32)])
    out["rss_after_mb"] = rss_mb()
    return out


def _size_mb(path: str) -> float:
    if os.path.isfile(path):
        return os.path.getsize(path) / 2**20
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")) / 2**20


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, SHAPE["vocab_size"]) for _ in range(length)] for _ in range(n)]


def _prefill(llm, args) -> float:
    from loramux.sampling_params import SamplingParams

    engine, params = llm.engine, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    best = 0.0
    for prompt in _prompts(3, args.prefill_len, seed=1):  # the first one warms up
        engine.add_request(prompt, params, None)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        best = max(best, args.prefill_len / (time.perf_counter() - start))
    return best


def _decode(llm, batch: int, args, adapters: list | None = None) -> float:
    """Tokens/s of the decode steps of `batch` requests running together (their prefill step not timed)."""
    from loramux.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(_prompts(batch, args.prompt_len, seed=batch)):
        engine.add_request(prompt, params, adapters[i] if adapters else None)
    engine.step()  # every prompt prefilled in one step (the budget holds them all)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.delta_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - start)


def _hf_bnb(path: str, args) -> dict:
    """transformers + bitsandbytes: greedy decode tok/s at batch 1 and 32 (generate's steps after the first)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu",
                                                 dtype=torch.bfloat16).eval()
    out = {"rss_mb": rss_mb(), "file_mb": _size_mb(path)}
    for batch in (1, 32):
        ids = torch.tensor(_prompts(batch, args.prompt_len, seed=batch))
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm up; prefill + 1 step
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
            steps = time.perf_counter() - start - prefill
        out[f"decode_b{batch}_tok_s"] = batch * (args.new_tokens - 1) / steps
    out["rss_run_mb"] = out["rss_after_mb"] = rss_mb()
    return out


def _llama_cpp(path: str, args) -> dict:
    import llama_cpp

    model = llama_cpp.Llama(model_path=path, n_threads=os.cpu_count() or 2, n_ctx=args.prefill_len + 64,
                            n_batch=args.prefill_len, verbose=False)
    out = {"rss_mb": rss_mb(), "file_mb": _size_mb(path)}
    best = 0.0
    for prompt in _prompts(3, args.prefill_len, seed=1):
        model.reset()
        start = time.perf_counter()
        model.eval(prompt)
        best = max(best, args.prefill_len / (time.perf_counter() - start))
    out["prefill_tok_s"] = best
    rates = []
    for prompt in _prompts(3, args.prompt_len, seed=1):
        model.reset()
        n, first = 0, None
        for _token in model.generate(prompt, temp=0.0):
            n += 1
            if n == 1:
                first = time.perf_counter()
            if n == args.new_tokens:
                break
        rates.append((n - 1) / (time.perf_counter() - first))
    out["decode_b1_tok_s"] = max(rates)
    out["rss_after_mb"] = rss_mb()
    return out


# ---- the run ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=os.path.expanduser("~/.cache/loramux/bench-quantized"))
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=17)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    parser.add_argument("--skip-llama-cpp", action="store_true", help="--phases without llama_cpp")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # (a child process)
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    paths = make_files(args.workdir, [args.phase] if args.phase else args.phases)
    if args.phase:
        print(json.dumps(run_phase(args.phase, paths, args)))
        return
    from throughput import cpu_load

    report = {"model": "SmolLM2-1.7B shape, random weights", "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "prefill_len": args.prefill_len, "load_before": cpu_load()}
    for phase in args.phases:
        if phase == "llama_cpp" and args.skip_llama_cpp:
            continue
        print(f"phase {phase} ...", flush=True)
        child = subprocess.run([sys.executable, __file__, "--phase", phase, "--workdir", args.workdir, "--phases", phase,
                                "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
                                "--prefill-len", str(args.prefill_len)], check=True, capture_output=True, text=True)
        report[phase] = json.loads(child.stdout.strip().splitlines()[-1])
    report["load_after"] = cpu_load()
    report["ratios"] = ratios(report)
    print_report(report)


def ratios(report: dict) -> dict:
    out, bf16, base = {}, report.get("bf16"), report.get("baseline", {}).get("rss_mb")
    for name in ("nf4", "q4_k_m"):
        q = report.get(name)
        if q is None or bf16 is None:
            continue
        out[f"{name}/bf16 decode b1"] = q["decode_b1_tok_s"] / bf16["decode_b1_tok_s"]
        out[f"{name} mixed8 b32 / bf16 base b32"] = q["decode_b32_mixed8_tok_s"] / bf16["decode_b32_tok_s"]
        if base is not None:  # the GGUF file is its weights; the NF4 run quantizes a bf16 checkpoint at load
            size, what = (q["file_mb"], "file") if name == "q4_k_m" else (q["weight_mb"], "weights")
            out[f"{name} (rss - baseline) / ({what} + kv + lora slots)"] = \
                (q["rss_run_mb"] - base) / (size + q["kv_mb"] + q["lora_slots_mb"])
    if "nf4" in report and "hf_bnb" in report:
        for batch in (1, 32):
            out[f"nf4/transformers+bitsandbytes decode b{batch}"] = \
                report["nf4"][f"decode_b{batch}_tok_s"] / report["hf_bnb"][f"decode_b{batch}_tok_s"]
    if "llama_cpp" in report and "q4_k_m" in report:
        q4 = report["q4_k_m"]
        lc = report["llama_cpp"]
        out["q4_k_m/llama_cpp decode b1"] = q4["decode_b1_tok_s"] / lc["decode_b1_tok_s"]
        out["q4_k_m/llama_cpp prefill"] = q4["prefill_tok_s"] / lc["prefill_tok_s"]
    return out


def print_report(report: dict) -> None:
    print(f"\n{report['model']}; decode: {report['prompt_len']} prompt + {report['new_tokens']} new tokens a request; "
          f"prefill: {report['prefill_len']} tokens; load average {report['load_before']:.2f} -> {report['load_after']:.2f}")
    if "baseline" in report:
        print(f"baseline process (torch + loramux imported): {report['baseline']['rss_mb']:.0f} MB resident")
    cols = ("decode_b1_tok_s", "decode_b8_tok_s", "decode_b32_tok_s", "decode_b32_mixed8_tok_s", "prefill_tok_s")
    print(f"{'phase':<10}{'b1':>8}{'b8':>8}{'b32':>8}{'b32 mix8':>10}{'prefill':>9}{'weights':>9}{'file':>8}{'rss':>8}  (tok/s, MB; rss: "
          "after the runs, before adapters)")
    for phase in ("bf16", "int8", "nf4", "q4_k_m", "llama_cpp", "hf_bnb"):
        if phase not in report:
            continue
        r = report[phase]
        cells = "".join(f"{r[c]:>{10 if c.endswith('mixed8_tok_s') else 8 if c != 'prefill_tok_s' else 9}.1f}"
                        if c in r else f"{'-':>{10 if c.endswith('mixed8_tok_s') else 8 if c != 'prefill_tok_s' else 9}}"
                        for c in cols)
        print(f"{phase:<10}{cells}{r.get('weight_mb', float('nan')):>9.0f}{r['file_mb']:>8.0f}"
              f"{r.get('rss_run_mb', r['rss_after_mb']):>8.0f}")
    for label, value in report["ratios"].items():
        print(f"  {label:<42}{value:6.2f}x")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
