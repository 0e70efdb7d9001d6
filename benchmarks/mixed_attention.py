"""A mixed step's prompts that start in it: one SDPA call per prompt against one padded SDPA call for all of
them (the engine on a GPU), and on a CPU with the C++ kernel every token as a row of the paged decode op (the
engine there), per layer, in one run; prints ms per layer, the ratios per case, and one JSON line.

Cases: 128 and 16 prompts of 128 tokens (an offline step on a GPU, whose default budget is 16,384 tokens),
two unequal prompts (a served step) and one long prompt. Shape: Llama-3.2-1B's heads on a GPU (32 / 8 kv, head
dim 64), SmolLM2-135M's on a CPU (9 / 3), bf16.

  .venv/bin/python benchmarks/mixed_attention.py [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loramux.engine.model_runner import padding_indices  # noqa: E402
from loramux.layers.attention import Attention  # noqa: E402
from loramux.ops import attention_cpu  # noqa: E402

CASES = {"128x128": [128] * 128, "16x128": [128] * 16, "128+40": [128, 40], "200+16": [200, 16], "1x2048": [2048]}
BLOCK = 16
HEADS = {"cuda": (32, 8, 64), "cpu": (9, 3, 64)}


def time_case(attention: Attention, lengths: list[int], device: str, repeats: int) -> dict[str, float]:
    heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    torch.manual_seed(0)
    q = torch.randn(sum(lengths), heads, dim, dtype=torch.bfloat16, device=device)
    k, v = (torch.randn(sum(lengths), kv_heads, dim, dtype=torch.bfloat16, device=device) for _ in range(2))
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    pad, unpad = padding_indices(offsets[:-1], lengths, device)
    out = q.new_empty(sum(lengths), heads * dim)

    def per_prompt():
        for a, b in zip(offsets, offsets[1:]):
            out[a:b] = attention._sdpa_rows(q[a:b], k[a:b], v[a:b])

    def padded():
        out[:] = attention._padded(q, k, v, pad, unpad)

    ways = {"per_prompt": per_prompt, "padded": padded}
    if device == "cpu" and attention_cpu.available():
        ways["rows"] = decode_rows(q, k, v, lengths, out)
    per_prompt()
    expected = out.clone()
    for run in list(ways.values())[1:]:
        run()
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)  # the same attention every way
    best = {}
    for name, run in list(ways.items()) * 2:  # alternated, best of two
        for _ in range(3):
            run()
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        sync(device)
        ms = (time.perf_counter() - start) / repeats * 1000
        best[name] = min(best.get(name, ms), ms)
    return best


def decode_rows(q, k, v, lengths: list[int], out: torch.Tensor):
    """The C++ paged decode op over every token, as the engine runs a step on a CPU: the prompts' K/V in a
    paged cache (each prompt's blocks in a row), token i of a prompt a row with i + 1 keys."""
    blocks = [-(-n // BLOCK) for n in lengths]
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    cache_rows = torch.tensor([(b0 * BLOCK) + i for b0, n in zip(starts, lengths) for i in range(n)])
    k_cache, v_cache = (t.new_zeros(sum(blocks) * BLOCK, *t.shape[1:]) for t in (k, v))
    attention_cpu.store_kv_cpu(k_cache, v_cache, k, v, cache_rows)
    tables = torch.tensor([[b0 + j for j in range(max(blocks))] for b0 in starts]).clamp(max=sum(blocks) - 1)
    tables = tables.repeat_interleave(torch.tensor(lengths), dim=0)
    context = torch.tensor([i + 1 for n in lengths for i in range(n)])
    scale = q.shape[-1] ** -0.5

    def rows():
        out[:] = attention_cpu.decode_attention_cpu(q, k_cache, v_cache, tables, context, BLOCK, scale).flatten(1)

    return rows


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=sorted(HEADS))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    heads, kv_heads, dim = HEADS[args.device]
    attention = Attention(heads, kv_heads, dim, dim ** -0.5)
    result = {name: time_case(attention, CASES[name], args.device, args.repeats) for name in args.cases}
    ratios = {name: {f"{way} / per_prompt": ms / row["per_prompt"] for way, ms in row.items() if way != "per_prompt"}
              for name, row in result.items()}
    ways = list(next(iter(result.values())))
    print(f"ms per layer on {args.device}, {heads} heads / {kv_heads} kv, bf16 (best of 2 x {args.repeats})")
    print(f"{'case':10}" + "".join(f"{way:>12}" for way in ways) + "".join(f"{w + ' / per':>16}" for w in ways[1:]))
    for name, row in result.items():
        print(f"{name:10}" + "".join(f"{row[w]:12.3f}" for w in ways)
              + "".join(f"{row[w] / row['per_prompt']:16.2f}" for w in ways[1:]))
    print(json.dumps({"device": args.device, "heads": [heads, kv_heads, dim], "ms_per_layer": result, "ratios": ratios}))


if __name__ == "__main__":
    main()
