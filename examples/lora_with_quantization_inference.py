"""LoRA adapters over quantized bases (vLLM's lora_with_quantization_inference example, on loramux): QLoRA's
case, an adapter trained on a 4-bit base served on that base, kept 4-bit, beside the base model's own rows.

With no arguments it runs the embedded default (SmolLM2-135M-Instruct) and its demo adapters on three bases:
  gguf-q4_1       the default as shipped (a Q4_1 GGUF, kept as stored)
  bitsandbytes    NF4 quantized at load (`quantization="bitsandbytes"`, vLLM's spelling: what
                  bitsandbytes' load_in_4bit makes)
  int4            group-wise int4 quantized at load (the int4 kernel GPTQ and AWQ checkpoints run on)
and, with `--model NAME=DIR` (repeatable), pre-quantized checkpoints as their tools save them: a GPTQ or AWQ
directory, or one saved by transformers with BitsAndBytesConfig(load_in_4bit=True) (NF4 or FP4, double
quantization or not), each with `--adapter DIR`s trained for it (default: the demo adapters).

    .venv/bin/python examples/lora_with_quantization_inference.py
    .venv/bin/python examples/lora_with_quantization_inference.py --model gptq=/models/llama-gptq \\
        --adapter /adapters/llama-lora
"""
from __future__ import annotations

import argparse
import os

from loramux import LLM, LoRAConfig, SamplingParams
from loramux.models.loader import weight_formats

ADAPTERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adapters")
BASES = {"gguf-q4_1": dict(quantization=None), "bitsandbytes": dict(quantization="bitsandbytes"),
         "int4": dict(quantization="int4", quantization_group_size=32)}


def run(label: str, model: str | None, adapters: dict[str, str], quantization: str | None = None, **kwargs) -> None:
    """One base with its adapters: the same prompt on the base model and on each adapter, in one batch."""
    llm = LLM(model=model, quantization=quantization, lora=LoRAConfig(max_loras=len(adapters), max_lora_rank=16),
              adapters=adapters, max_model_len=256, **kwargs)
    formats = weight_formats(llm.engine.runner.model)
    rows, params = [None, *adapters], SamplingParams(max_tokens=20, temperature=0)
    if llm.tokenizer.chat_template:  # as a chat: the demo adapters were trained on the chat template
        outputs = llm.chat([[{"role": "user", "content": "Tell me about the sea."}]] * len(rows), params, adapters=rows)
    else:
        outputs = llm.generate(["Tell me about the sea."] * len(rows), params, adapters=rows)
    print(f"== {label}: {formats}")
    for adapter, output in zip(rows, outputs):
        print(f"  {adapter or 'base':<8} {output.text.strip()!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                        help="a pre-quantized checkpoint (GPTQ, AWQ or bitsandbytes 4-bit) instead of the default's bases")
    parser.add_argument("--adapter", action="append", default=[], metavar="DIR", help="an adapter trained for --model")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    if args.model:
        adapters = {f"adapter{i}": path for i, path in enumerate(args.adapter)}
        for spec in args.model:
            label, _, path = spec.partition("=")
            run(label, path, adapters, dtype=args.dtype)
        return
    adapters = {name: os.path.join(ADAPTERS, name) for name in ("pirate", "french")}
    for label, options in BASES.items():
        run(label, None, adapters, dtype=args.dtype, **options)


if __name__ == "__main__":
    main()
