"""A DoRA adapter (PEFT's use_dora=True) served in one batch with a LoRA adapter and the base model, on the
embedded default (SmolLM2-135M-Instruct, its Q4_1 GGUF kept quantized), and checked against HF transformers +
PEFT running the DoRA adapter alone on the same weights (the GGUF dequantized into an HF checkpoint, once).

The DoRA adapter is made here with PEFT, small and at random (a trained one loads the same way), in a
temporary directory; the LoRA adapter is the demo `pirate` in examples/adapters.

    .venv/bin/python examples/dora_inference.py
"""
from __future__ import annotations

import os
import tempfile

import torch

from loramux import LLM, LoRAConfig, SamplingParams
from loramux.models.loader import default_model_path

ADAPTERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adapters")
PROMPT = "Tell me about the sea."


def make_dora_adapter(hf_model, path: str) -> str:
    """PEFT's DoRA on the attention projections, its B and magnitudes moved off their no-op start."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, use_dora=True, target_modules=["q_proj", "v_proj", "o_proj"])
    model = get_peft_model(hf_model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
            elif "lora_magnitude_vector" in name:
                p.mul_(torch.empty_like(p).uniform_(0.9, 1.1))
    model.save_pretrained(path)
    return path


def peft_greedy(hf_model, adapter: str, ids: list[int], n: int) -> list[int]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_model, adapter).eval()
    out = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            out = torch.cat([out, model(out).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out[0, len(ids):].tolist()


def main() -> None:
    from transformers import AutoModelForCausalLM

    dequantized = default_model_path()

    def hf_model():
        return AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()

    with tempfile.TemporaryDirectory() as tmp:
        dora = make_dora_adapter(hf_model(), os.path.join(tmp, "dora"))
        llm = LLM(adapters={"dora": dora, "pirate": os.path.join(ADAPTERS, "pirate")},
                  lora=LoRAConfig(max_loras=2, max_lora_rank=16), dtype="float32")
        ids = llm.engine.chat_ids([{"role": "user", "content": PROMPT}])
        greedy = SamplingParams(max_tokens=16, temperature=0)
        rows = ["dora", "pirate", None]
        outs = llm.generate([ids] * len(rows), greedy, adapters=rows)  # one batch
        for row, out in zip(rows, outs):
            print(f"{row or 'base':<7} {out.text.strip()!r}")
        expected = peft_greedy(hf_model(), dora, ids, len(outs[0].token_ids))
        same = outs[0].token_ids == expected
        print(f"DoRA row equals HF + PEFT alone: {same}")
        if not same:
            raise SystemExit(f"loramux {outs[0].token_ids} != PEFT {expected}")


if __name__ == "__main__":
    main()
