"""Three kinds of adapter no other server batches, served in one batch with a plain LoRA adapter and the base
model on the embedded default (SmolLM2-135M-Instruct, its Q4_1 GGUF kept quantized), each row checked against
HF transformers + PEFT running that adapter alone on the same weights (the GGUF dequantized into an HF checkpoint,
once):
- a DoRA adapter (PEFT's use_dora=True);
- an activated LoRA (aLoRA: alora_invocation_tokens), asked after a base-model turn on the same conversation,
  so the conversation comes from the prefix cache;
- a weighted combination of the DoRA-free adapters, {"pirate": 0.5, "lora": 1.0} (PEFT's add_weighted_adapter,
  combination_type="cat").
The DoRA, aLoRA and second LoRA adapters are made here with PEFT, small and at random (trained ones load the same
way), in a temporary directory; `pirate` is the demo adapter in examples/adapters.

    .venv/bin/python examples/adapter_kinds.py
"""
from __future__ import annotations

import copy
import os
import tempfile

import torch

from loramux import LLM, LoRAConfig, SamplingParams
from loramux.models.loader import default_model_path

ADAPTERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adapters")
PROMPT = "Tell me about the sea."
INVOKE = "<|intrinsic|>"  # the aLoRA adapter's invocation: this text's token ids


def make_adapter(hf_model, path: str, **options) -> str:
    """A PEFT adapter on the attention projections, its B (and DoRA magnitudes) moved off their no-op start."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(len(path))
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM",
                        **options)
    model = get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
            elif "lora_magnitude_vector" in name:
                p.mul_(torch.empty_like(p).uniform_(0.9, 1.1))
    model.save_pretrained(path)
    return path


def peft_greedy(hf_model, adapters: dict[str, tuple[str, float]], ids: list[int], n: int) -> list[int]:
    """PEFT running one adapter ({name: (dir, 1.0)}) or the cat combination of several, greedy."""
    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(copy.deepcopy(hf_model), adapters[names[0]][0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name][0], adapter_name=name)
    if len(names) > 1:
        model.add_weighted_adapter(names, [w for _, w in adapters.values()], "combo", combination_type="cat")
        model.set_adapter("combo")
    out = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            out = torch.cat([out, model.eval()(out).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out[0, len(ids):].tolist()


def main() -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(lora=LoRAConfig(max_loras=6, max_lora_rank=24), dtype="float32")
        invoke = llm.engine.tokenizer.encode(INVOKE, add_special_tokens=False)
        paths = {"pirate": os.path.join(ADAPTERS, "pirate"),
                 "dora": make_adapter(hf_model, os.path.join(tmp, "dora"), use_dora=True),
                 "intrinsic": make_adapter(hf_model, os.path.join(tmp, "intrinsic"), alora_invocation_tokens=invoke),
                 "lora": make_adapter(hf_model, os.path.join(tmp, "lora"))}
        for name, path in paths.items():
            result = llm.load_adapter(name, path)
            assert result, result.message
        conversation = llm.engine.chat_ids([{"role": "user", "content": PROMPT}])
        greedy = SamplingParams(max_tokens=12, temperature=0)
        llm.generate([conversation], greedy, adapters=[None])  # a base-model turn: the conversation is cached
        pair = {"pirate": 0.5, "lora": 1.0}
        rows = [("dora", conversation), ("intrinsic", conversation + invoke), (pair, conversation),
                ("pirate", conversation), (None, conversation)]
        outs = llm.generate([p for _, p in rows], greedy, adapters=[a for a, _ in rows])  # one batch
        checked = []
        for (adapter, prompt), out in zip(rows, outs):
            label = adapter if not isinstance(adapter, dict) else "pair"
            print(f"{label or 'base':<9} {out.text.strip()!r} (cached prompt tokens: {out.num_cached_tokens})")
            if adapter in ("dora", "intrinsic") or label == "pair":
                parts = {adapter: (paths[adapter], 1.0)} if label != "pair" else \
                    {name: (paths[name], w) for name, w in adapter.items()}
                checked.append((label, out.token_ids == peft_greedy(hf_model, parts, prompt, len(out.token_ids))))
        for label, same in checked:
            print(f"{label} row equals HF + PEFT alone: {same}")
        if not all(same for _, same in checked):
            raise SystemExit("a row differs from HF + PEFT")


if __name__ == "__main__":
    main()
