"""DoRA, aLoRA and a weighted combination in ONE batch with plain LoRA (rsLoRA among them) and base rows, on a
dense base and on a GGUF kept quantized (its dequantized weights the oracle's base): every row's prompt logprobs
and greedy tokens are HF + PEFT's for its adapter alone (fp32)."""
import copy

import pytest
import torch

from conftest import save_peft_adapter
from engine.test_combinations import peft_combination, peft_greedy
from engine.test_dora import save_dora_adapter
from models.test_quantized import dense_or_gguf
from loramux import LoRAConfig, SamplingParams
from loramux.llm import LLM

INVOKE = [17, 42, 99]
PAIR = {"plain": 0.5, "rslora": 1.5}


def _adapters(base, root) -> dict[str, str]:
    return {"plain": save_peft_adapter(base, root / "plain", seed=1, r=4, lora_alpha=8),
            "rslora": save_peft_adapter(base, root / "rslora", seed=2, r=4, lora_alpha=8, use_rslora=True),
            "dora": save_dora_adapter(base, root / "dora", 3, r=4),
            "intrinsic": save_peft_adapter(base, root / "intrinsic", seed=4, r=4, alora_invocation_tokens=INVOKE,
                                           task_type="CAUSAL_LM")}


@pytest.fixture(scope="module", params=["dense", "gguf"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"kinds-{request.param}")
    model, reference = dense_or_gguf(request.param, root)
    adapters = _adapters(reference, root)
    llm = LLM(model=model, dtype="float32", kv_cache_memory=2**24, max_model_len=64,
              lora=LoRAConfig(max_loras=6, max_lora_rank=8))
    for name, path in adapters.items():
        result = llm.load_adapter(name, path)
        assert result, result.message
    return reference, adapters, llm


ROWS = ["dora", PAIR, "intrinsic", None, "rslora", "plain", "intrinsic"]
PROMPTS = [[5, 9, 14, 3, 7], [6, 8, 10, 12], [5, 9, 14] + INVOKE + [30], [5, 9, 14, 3], [11, 12, 13, 14],
           [7, 7, 21, 40], INVOKE + [4, 4]]


def _oracle(reference, adapters, row):
    from peft import PeftModel

    if isinstance(row, dict):
        return peft_combination(reference, {name: (adapters[name], w) for name, w in row.items()})
    if row is None:
        return reference
    return PeftModel.from_pretrained(copy.deepcopy(reference), adapters[row]).eval()


def test_every_kind_in_one_batch_gives_peft_logprobs_and_tokens(setup):
    reference, adapters, llm = setup
    scored = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), adapters=ROWS)
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), adapters=ROWS)
    for prompt, row, out, tokens in zip(PROMPTS, ROWS, scored, greedy):
        model = _oracle(reference, adapters, row)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        expected = logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs.logprobs), expected, atol=1e-4, rtol=1e-4,
                                   msg=str(row))
        assert tokens.token_ids == peft_greedy(model, prompt, 6), row
