"""Embeddings per adapter: --texts short texts over --adapters adapters (rank 8 on all 7 projections), each text with
one adapter (round robin), in one run:

  loramux          LLM.embed, one call: the adapters mixed in its batches
  hf_peft          HF transformers + PEFT: every adapter loaded in one PeftModel; per adapter, set_adapter and
                   batched forwards (--hf-batch texts, left-padded), the last token's hidden state
  vllm             vLLM-CPU's pooling runner with LoRA (`vllm serve --runner pooling --enable-lora`), /v1/embeddings
                   per adapter, --vllm-concurrency at once; if it does not start or answer, the reason is printed

All pool the last token's last-layer hidden state and normalize it; the vectors of loramux and HF + PEFT are
compared (the lowest cosine similarity). Model: the embedded default as an HF checkpoint (SmolLM2-135M-Instruct).

  .venv/bin/python benchmarks/embeddings.py [--vllm-venv /tmp/vllm-cpu-venv | --skip-vllm]     # ~5 min on 2 cores
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from served import VLLM_CPU_ENV, free_port, serve, stop  # noqa: E402
from throughput import cpu_load, scratch_dir, write_adapter  # noqa: E402

TOPICS = ["kites", "bread", "rivers", "chess", "volcanoes", "jazz", "satellites", "gardens", "trains", "coral reefs"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--vllm-venv", default="/tmp/vllm-cpu-venv")
    parser.add_argument("--vllm-concurrency", type=int, default=16)
    parser.add_argument("--skip-vllm", action="store_true")
    return parser.parse_args(argv)


def texts_of(count: int) -> list[str]:
    return [f"Note {i}: a short remark about {TOPICS[i % len(TOPICS)]}, number {i * 7 % 13}." for i in range(count)]


def run_loramux(model, dtype, dirs, texts, names) -> tuple[float, list]:
    from loramux import LoRAConfig
    from loramux.llm import LLM

    llm = LLM(model=model, lora=LoRAConfig(max_loras=len(dirs), max_lora_rank=8), dtype=dtype, max_num_seqs=256,
              max_model_len=128)
    for name, path in dirs.items():
        assert llm.load_adapter(name, path)
    llm.embed(texts[:16], adapters=names[:16], use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outs = llm.embed(texts, adapters=names, use_tqdm=False)
    return time.perf_counter() - started, [o.embedding for o in outs]


def run_hf_peft(model, dtype, dirs, texts, names, batch) -> tuple[float, list]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    base = AutoModelForCausalLM.from_pretrained(model, torch_dtype=getattr(torch, dtype)).eval()
    items = list(dirs.items())
    peft = PeftModel.from_pretrained(base, items[0][1], adapter_name=items[0][0])
    for name, path in items[1:]:
        peft.load_adapter(path, adapter_name=name)
    vectors = [None] * len(texts)

    def embed(name, rows):
        peft.set_adapter(name)
        for start in range(0, len(rows), batch):
            chunk = rows[start:start + batch]
            enc = tokenizer([texts[i] for i in chunk], return_tensors="pt", padding=True)
            with torch.no_grad():
                hidden = peft.base_model.model.model(**enc).last_hidden_state[:, -1].float()
            for i, v in zip(chunk, torch.nn.functional.normalize(hidden, dim=-1)):
                vectors[i] = v.tolist()

    embed(items[0][0], list(range(8)))  # warm-up
    started = time.perf_counter()
    for name, _ in items:
        embed(name, [i for i, n in enumerate(names) if n == name])
    return time.perf_counter() - started, vectors


def run_vllm(args, model, dirs, texts, names) -> dict:
    port = free_port()
    cmd = [os.path.join(args.vllm_venv, "bin", "vllm"), "serve", model, "--runner", "pooling", "--port", str(port),
           "--dtype", args.dtype, "--enable-lora", "--max-loras", str(len(dirs)), "--max-lora-rank", "8",
           "--max-model-len", "128", "--lora-modules", *[f"{n}={p}" for n, p in dirs.items()]]
    try:
        proc, url = serve(cmd, port, timeout_s=900, env={**os.environ, **VLLM_CPU_ENV})
    except (RuntimeError, TimeoutError, OSError) as e:
        return {"error": f"did not start: {e}"}
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            probe = client.post("/v1/embeddings", json={"model": names[0], "input": texts[0]})
            if probe.status_code != 200:
                return {"error": f"/v1/embeddings with an adapter: {probe.status_code} {probe.text[:300]}"}
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.vllm_concurrency) as pool:
                answers = list(pool.map(lambda i: client.post("/v1/embeddings", json={"model": names[i],
                                                                                     "input": texts[i]}),
                                        range(len(texts))))
            seconds = time.perf_counter() - started
        failed = sum(a.status_code != 200 for a in answers)
        return {"seconds": seconds, "texts_per_s": len(texts) / seconds, "failed": failed}
    finally:
        stop(proc)


def cosine_floor(a: list, b: list) -> float:
    return min(float(torch.dot(torch.tensor(x), torch.tensor(y))) for x, y in zip(a, b))


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoConfig

    from loramux.models.loader import default_model_path

    model, workdir = default_model_path(), scratch_dir("loramux-embeddings-")
    hf_config = AutoConfig.from_pretrained(model)
    dirs = {f"a{i}": write_adapter(os.path.join(workdir, f"a{i}"), hf_config, 8, seed=i) for i in range(args.adapters)}
    texts = texts_of(args.texts)
    names = [f"a{i % args.adapters}" for i in range(args.texts)]
    report = {"model": os.path.basename(model), "dtype": args.dtype, "texts": args.texts, "adapters": args.adapters,
              "load_before": cpu_load(), "runs": {}}
    ours_s, ours = run_loramux(model, args.dtype, dirs, texts, names)
    theirs_s, theirs = run_hf_peft(model, args.dtype, dirs, texts, names, args.hf_batch)
    report["runs"]["loramux"] = {"seconds": ours_s, "texts_per_s": args.texts / ours_s}
    report["runs"]["hf_peft"] = {"seconds": theirs_s, "texts_per_s": args.texts / theirs_s}
    report["cosine_min_loramux_hf_peft"] = cosine_floor(ours, theirs)
    if not args.skip_vllm:
        report["runs"]["vllm"] = run_vllm(args, model, dirs, texts, names)
    report["load_after"] = cpu_load()
    report["ratios"] = {f"loramux / {peer}": report["runs"]["loramux"]["texts_per_s"] / r["texts_per_s"]
                        for peer, r in report["runs"].items() if peer != "loramux" and "texts_per_s" in r}
    for run, r in report["runs"].items():
        print(f"{run:<10}", f"{r['texts_per_s']:.1f} texts/s" if "texts_per_s" in r else r.get("error"))
    for name, value in report["ratios"].items():
        print(f"  {name}: {value:.2f}x")
    print(f"  lowest cosine similarity, loramux vs HF + PEFT: {report['cosine_min_loramux_hf_peft']:.5f}")
    print(json.dumps({"benchmark": "embeddings", **report}))


if __name__ == "__main__":
    main()
