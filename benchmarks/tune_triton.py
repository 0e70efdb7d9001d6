"""Measure the Triton kernels' tiles and splits on this GPU and write the table loramux reads on it
(loramux/ops/tuned/<gpu>.json; ops/triton_tiles.py), as vLLM's kernel tuning scripts write its configs.

For each token count (the LoRA op, on a layer's qkv and down shapes) and each batch size (decode attention at
--context positions), every candidate in a small grid is timed against the defaults; its output must equal
the defaults' within the dtype's tolerance or it is dropped. The fastest candidate is kept only where it beats
the defaults by more than --min-gain (noise keeps the defaults). Prints a table and one JSON line with each
size's gain.

  python benchmarks/tune_triton.py --device cuda --shape llama-1b            # writes the table
  python benchmarks/tune_triton.py --device cuda --shape llama-8b --dry-run  # measures only
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_vllm import SHAPES  # noqa: E402

from loramux.ops import LoRAMapping, attention_triton, lora_triton, triton_tiles  # noqa: E402
from loramux.ops.triton_tiles import AttentionTiles, LoRATiles  # noqa: E402

NO_SPLIT = 1 << 30  # a split_min_k / split_min_len no reduction reaches


def lora_candidates(quick: bool, tokens: int) -> list[LoRATiles]:
    if quick:
        return [LoRATiles(), LoRATiles(split_min_k=NO_SPLIT)]
    grid = itertools.product((16, 32) if tokens >= 32 else (16,), (64, 128), (64, 128), (4, 8), (128, 256, 512, NO_SPLIT))
    return [LoRATiles(m, n, k, w, s) for m, n, k, w, s in grid]


def attention_candidates(quick: bool) -> list[AttentionTiles]:
    if quick:
        return [AttentionTiles(), AttentionTiles(split_min_len=NO_SPLIT)]
    return [AttentionTiles(n, w, s) for n, w, s in itertools.product((32, 64, 128), (4, 8), (64, 128, 256, 512, NO_SPLIT))]


def timed(fn, device: str) -> float:
    """Seconds a call takes: triton's do_bench on a GPU (median of many, caches flushed), one call elsewhere."""
    if device.startswith("cuda"):
        import triton.testing
        return triton.testing.do_bench(fn, warmup=5, rep=25) / 1000
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def lora_case(shape: dict, tokens: int, rank: int, slots: int, dtype, device: str):
    """The qkv and down projections' LoRA calls for `tokens` tokens over `slots` adapters: [(fn of tiles, split)]."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    cases = []
    for n_in, out_slices in ((hidden, (hidden, kv, kv)), (inter, (hidden,))):
        a = torch.randn(slots, len(out_slices) * rank, n_in, dtype=dtype, device=device) * 0.02
        b = torch.randn(slots, sum(out_slices), rank, dtype=dtype, device=device) * 0.02
        x = torch.randn(tokens, n_in, dtype=dtype, device=device)
        mapping = LoRAMapping.from_slots([t % slots for t in range(tokens)], device)
        ranks = torch.full((slots,), rank, device=device)

        def run(tiles, x=x, a=a, b=b, mapping=mapping, ranks=ranks, slices=out_slices, n_in=n_in, tokens=tokens):
            y = torch.zeros(tokens, sum(slices), dtype=dtype, device=device)
            split = lora_triton.split_k(tiles, tokens, slots, len(slices), n_in, device)
            lora_triton.launch(y, x, a, b, mapping, slices, ranks, tiles, split)
            return y
        cases.append(run)
    return cases


def attention_case(shape: dict, batch: int, context: int, dtype, device: str, block_size: int = 16):
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    width = -(-context // block_size)
    k = torch.randn(batch * width * block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    tables = torch.arange(batch * width, device=device, dtype=torch.int64).view(batch, width)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
    lens = torch.full((batch,), context, device=device, dtype=torch.int64)

    def run(tiles):
        split = attention_triton.split_kv(tiles, batch, kv_heads, width * block_size, device)
        return attention_triton.launch(q, k, v, tables, lens, block_size, head_dim**-0.5, tiles, split)
    return [run]


def tune(cases, candidates, default, device: str, tol: float, min_gain: float) -> tuple[dict, float]:
    """(the fields of the best candidate that differ from the defaults, or {} where none gains > min_gain;
    the default's time over the kept one's)."""
    expected = [case(default) for case in cases]

    def total(tiles) -> float | None:
        for case, want in zip(cases, expected):
            if not torch.allclose(case(tiles).float(), want.float(), atol=tol, rtol=tol):
                return None
        return sum(timed(lambda c=case: c(tiles), device) for case in cases)

    base = total(default)
    times = {tiles: total(tiles) for tiles in candidates}
    best = min((t, tiles) for tiles, t in times.items() if t is not None)
    if base / best[0] <= 1 + min_gain:
        return {}, 1.0
    fields = {f.name: getattr(best[1], f.name) for f in dataclasses.fields(best[1])
              if getattr(best[1], f.name) != getattr(default, f.name)}
    return fields, base / best[0]


def write(table: dict, path: str, dry_run: bool) -> None:
    if not dry_run:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({kind: sizes for kind, sizes in table.items() if sizes}, f, indent=1, sort_keys=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--min-gain", type=float, default=0.05, help="keep a candidate only this much faster (0.05: 5%%)")
    p.add_argument("--quick", action="store_true", help="two candidates a size (split or not): a smoke test")
    p.add_argument("--out", default=str(triton_tiles.TUNED_DIR), help="the table's directory")
    p.add_argument("--dry-run", action="store_true", help="measure and print; write nothing")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    dtype, shape = getattr(torch, args.dtype), SHAPES[args.shape]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    table, gains = {"lora": {}, "attention": {}}, {"lora": {}, "attention": {}}
    path = os.path.join(args.out, f"{triton_tiles.gpu_name(args.device) or 'cpu'}.json")
    for tokens in args.tokens:
        cases = lora_case(shape, tokens, args.rank, args.slots, dtype, args.device)
        fields, gain = tune(cases, lora_candidates(args.quick, tokens), LoRATiles(), args.device, tol, args.min_gain)
        table["lora"][str(tokens)], gains["lora"][tokens] = fields, round(gain, 3)
        print(f"LoRA       {tokens:5d} tokens: {gain:5.2f}x the defaults with {fields or 'the defaults'}")
        write(table, path, args.dry_run)  # after every size: a run cut short keeps what it measured
    for batch in args.batches:
        cases = attention_case(shape, batch, args.context, dtype, args.device)
        fields, gain = tune(cases, attention_candidates(args.quick), AttentionTiles(), args.device, tol, args.min_gain)
        table["attention"][str(batch)], gains["attention"][batch] = fields, round(gain, 3)
        print(f"attention  batch {batch:4d}: {gain:5.2f}x the defaults with {fields or 'the defaults'}")
        write(table, path, args.dry_run)
    name = os.path.basename(path)[:-len(".json")]
    result = {"benchmark": "tune_triton", "device": name, "shape": args.shape, "dtype": args.dtype,
              "table": None if args.dry_run else path, "gain": gains}
    print(f"table: {path}" if not args.dry_run else "dry run: nothing written")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
