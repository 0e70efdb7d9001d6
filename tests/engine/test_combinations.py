"""Weighted combinations of loaded adapters in one request ({name: weight}), each row as HF + PEFT's
add_weighted_adapter(..., combination_type="cat") runs it alone (fp32), beside single adapters and base rows:
different ranks, rsLoRA first (PEFT then scales the combination by sqrt(r)) or not, negative weights, parts that
target different modules. What cannot be combined is refused naming why."""
import copy

import pytest
import torch

from conftest import hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from loramux import LoRAConfig, SamplingParams
from loramux.llm import LLM

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def peft_combination(base, parts: dict[str, tuple[str, float]]):
    """PEFT's model with the cat combination of parts ({name: (dir, weight)}, in order) active."""
    from peft import PeftModel

    names = list(parts)
    model = PeftModel.from_pretrained(copy.deepcopy(base), parts[names[0]][0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(parts[name][0], adapter_name=name)
    model.add_weighted_adapter(names, [w for _, w in parts.values()], "combo", combination_type="cat")
    model.set_adapter("combo")
    return model.eval()


def peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("combos")
    base = tiny_llama()
    adapters = {
        "a": save_peft_adapter(base, root / "a", seed=1, r=4, lora_alpha=8),
        "b": save_peft_adapter(base, root / "b", seed=2, r=8, lora_alpha=16, use_rslora=True),
        "c": save_peft_adapter(base, root / "c", seed=3, r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    }
    llm = LLM(model=save_checkpoint(base, root / "model"), dtype="float32", kv_cache_memory=2**23, max_model_len=64,
              lora=LoRAConfig(max_loras=4, max_lora_rank=16))
    for name, path in adapters.items():
        assert llm.load_adapter(name, path)
    return base, adapters, llm


COMBOS = [{"a": 0.5, "b": 1.0}, {"b": 0.7, "a": -0.3}, {"a": 1.0, "c": 2.0}]


def test_combinations_give_peft_cat_tokens_beside_single_adapters_and_base_rows(setup):
    base, adapters, llm = setup
    rows = [COMBOS[0], "a", None, COMBOS[1], COMBOS[2], "b"]
    prompts = [[5 + i, 9, 14, 3 + 2 * i] for i in range(len(rows))]
    outs = llm.generate(prompts, GREEDY, adapters=rows)
    for prompt, row, out in zip(prompts, rows, outs):
        if isinstance(row, dict):
            model = peft_combination(base, {name: (adapters[name], w) for name, w in row.items()})
            assert out.token_ids == peft_greedy(model, prompt, GREEDY.max_tokens), row
            assert out.adapter == "&".join(f"{n}*{float(w)!r}" for n, w in row.items())
        else:
            assert out.token_ids == hf_greedy(base, adapters.get(row), prompt, GREEDY.max_tokens), row
    assert sorted(llm.loras) == ["a", "b", "c"]  # combinations are derived, not listed


def test_a_combination_follows_a_part_reloaded_in_place(setup, tmp_path):
    base, adapters, llm = setup
    prompt, combo = [7, 8, 9, 10], {"c": 1.5, "a": 0.5}
    first = llm.generate([prompt], GREEDY, adapters=[combo])[0].token_ids
    new_a = save_peft_adapter(base, tmp_path / "a2", seed=9, r=4, lora_alpha=8)
    assert llm.load_adapter("a", new_a, replace=True)
    try:
        second = llm.generate([prompt], GREEDY, adapters=[combo])[0].token_ids
        model = peft_combination(base, {"c": (adapters["c"], 1.5), "a": (new_a, 0.5)})
        assert second == peft_greedy(model, prompt, GREEDY.max_tokens) and second != first
    finally:
        assert llm.load_adapter("a", adapters["a"], replace=True)


@pytest.mark.parametrize("combo, words", [
    ({"a": 1.0, "ghost": 1.0}, "unknown adapter"),
    ({"a": float("nan"), "b": 1.0}, "finite number"),
    ({"a": 1e6}, "at most 100"),
    ({f"x{i}": 1.0 for i in range(9)}, "1 to 8 adapters"),
    ({"a": 1.0, "b": 1.0, "c": 1.0, "a2": 1.0}, "unknown adapter"),
    ({}, "1 to 8 adapters"),
])
def test_what_cannot_be_combined_is_refused_naming_why(setup, combo, words):
    _, _, llm = setup
    with pytest.raises(ValueError, match=words):
        llm.generate([[1, 2, 3]], GREEDY, adapters=[combo])


def test_a_combination_over_the_slot_rank_or_with_dora_is_refused(setup, tmp_path):
    base, adapters, _ = setup
    from engine.test_dora import save_dora_adapter

    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**22,
              max_model_len=64, lora=LoRAConfig(max_loras=2, max_lora_rank=8))
    assert llm.load_adapter("a", adapters["a"]) and llm.load_adapter("b", adapters["b"])
    assert llm.load_adapter("d", save_dora_adapter(base, tmp_path / "d", 4, r=4))
    with pytest.raises(ValueError, match="rank 12 .* above max_lora_rank=8"):
        llm.generate([[1, 2, 3]], GREEDY, adapters=[{"a": 1.0, "b": 1.0}])
    with pytest.raises(ValueError, match="'d' cannot be part of a combination: it uses DoRA"):
        llm.generate([[1, 2, 3]], GREEDY, adapters=[{"a": 1.0, "d": 1.0}])
