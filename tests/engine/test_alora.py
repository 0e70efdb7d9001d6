"""Activated LoRA (PEFT's alora_invocation_tokens) in mixed batches: a row's tokens before the last occurrence of
its adapter's invocation sequence in its prompt run on the base model, those from it on (and every generated
token) on the adapter; without the invocation the whole request is the base model's. Each row gives HF + PEFT's
prompt logprobs and greedy tokens for that adapter alone (fp32), beside plain LoRA and base rows. The blocks
before the invocation are the base model's, so they are shared with base-model requests in the prefix cache."""
import pytest

from conftest import assert_prompt_logprobs_equal_peft, hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from loramux import LoRAConfig, SamplingParams
from loramux.config import DEFAULT_TARGET_MODULES
from loramux.llm import LLM

INVOKE = [17, 42, 99]
CONVERSATION = [5, 9, 14, 3, 7, 7, 21, 40, 2, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19, 20, 22]  # 22 tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("alora")
    base = tiny_llama()
    adapters = {"intrinsic": save_peft_adapter(base, root / "intrinsic", seed=1, r=8, alora_invocation_tokens=INVOKE,
                                               task_type="CAUSAL_LM"),  # (PEFT runs aLoRA only as a causal LM)
                "plain": save_peft_adapter(base, root / "plain", seed=2, r=8)}
    llm = LLM(model=save_checkpoint(base, root / "model"), dtype="float32", kv_cache_memory=2**23, max_model_len=96,
              block_size=4, lora=LoRAConfig(max_loras=2, max_lora_rank=8))
    for name, path in adapters.items():
        result = llm.load_adapter(name, path)
        assert result, result.message
    return base, adapters, llm


PROMPTS = {
    "middle": CONVERSATION[:9] + INVOKE + [30, 31],
    "at_start": INVOKE + CONVERSATION[:6],
    "at_end": CONVERSATION[:10] + INVOKE,
    "twice": CONVERSATION[:4] + INVOKE + CONVERSATION[4:9] + INVOKE + [33],  # the last occurrence counts
    "absent": CONVERSATION[:12],  # the whole request on the base model
}


def test_alora_rows_give_peft_logprobs_and_tokens_beside_lora_and_base_rows(setup):
    base, adapters, llm = setup
    rows = [("intrinsic", p) for p in PROMPTS.values()] + [("plain", PROMPTS["middle"]), (None, PROMPTS["middle"])]
    prompts, names = [p for _, p in rows], [n for n, _ in rows]
    scored = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), adapters=names)
    for (name, prompt), out in zip(rows, scored):
        assert_prompt_logprobs_equal_peft(out, base, adapters.get(name), prompt, msg=str((name, prompt)))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for (name, prompt), out in zip(rows, llm.generate(prompts, greedy, adapters=names)):
        assert out.token_ids == hf_greedy(base, adapters.get(name), prompt, 6), (name, prompt)


def test_the_blocks_before_the_invocation_are_shared_with_base_model_requests(setup):
    """A base-model turn, then the intrinsic on the same conversation: only the blocks from the invocation on are
    computed (the conversation's 5 full blocks of 4 are cached); the reverse order shares them too. A plain
    adapter shares nothing with the base model."""
    base, adapters, llm = setup
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first = llm.generate([CONVERSATION], params, adapters=[None])[0]
    intrinsic = llm.generate([CONVERSATION + INVOKE + [30]], params, adapters=["intrinsic"])[0]
    assert first.num_cached_tokens == 0 and intrinsic.num_cached_tokens == 20
    assert intrinsic.token_ids == hf_greedy(base, adapters["intrinsic"], CONVERSATION + INVOKE + [30], 2)
    plain = llm.generate([CONVERSATION], params, adapters=["plain"])[0]
    assert plain.num_cached_tokens == 0
    llm.reset_prefix_cache()
    other = [c + 50 for c in CONVERSATION]
    llm.generate([other + INVOKE], params, adapters=["intrinsic"])
    assert llm.generate([other], params, adapters=[None])[0].num_cached_tokens == 20


@pytest.mark.parametrize("kind, words", [("embedding", "it has LoRA on model.embed_tokens"),
                                         ("dora", "it uses DoRA too"), ("bad_tokens", "alora_invocation_tokens must be")])
def test_what_alora_cannot_run_with_is_refused_naming_it(setup, tmp_path, kind, words):
    """(PEFT itself builds neither an aLoRA embedding nor aLoRA with DoRA: the configs are written here.)"""
    import json

    from conftest import save_distinct_adapter
    from engine.test_dora import save_dora_adapter

    base, _, _ = setup
    path = save_dora_adapter(base, tmp_path / "x", 5, r=4) if kind == "dora" else \
        save_distinct_adapter(base, tmp_path / "x", 5, r=4, target_modules=["q_proj", "embed_tokens"])
    config_path = tmp_path / "x" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["alora_invocation_tokens"] = [1.5] if kind == "bad_tokens" else INVOKE
    config_path.write_text(json.dumps(config))
    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**22,
              max_model_len=64, lora=LoRAConfig(max_loras=1, max_lora_rank=8,
                                                target_modules=(*DEFAULT_TARGET_MODULES, "embed_tokens")))
    result = llm.load_adapter("x", path)
    assert not result and words in result.message, result.message


@pytest.mark.parametrize("combo", [{"intrinsic": 0.5, "plain": 1.0}, {"plain": 1.0, "intrinsic": 0.5}])
def test_a_combination_takes_its_activation_from_its_first_part_as_peft_does(setup, combo, tmp_path):
    """PEFT's add_weighted_adapter gives the combination its first part's config, invocation included: with the
    aLoRA first the whole combination acts from the invocation on; with it second its part acts on every token."""
    import copy

    import torch
    from peft import PeftModel

    base, adapters, _ = setup
    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**23,
              max_model_len=96, block_size=4, lora=LoRAConfig(max_loras=2, max_lora_rank=16))  # ranks 8 + 8
    for name, path in adapters.items():
        assert llm.load_adapter(name, path)
    names = list(combo)
    model = PeftModel.from_pretrained(copy.deepcopy(base), adapters[names[0]], adapter_name=names[0])
    model.load_adapter(adapters[names[1]], adapter_name=names[1])
    model.add_weighted_adapter(names, list(combo.values()), "combo", combination_type="cat")
    model.set_adapter("combo")
    prompts = [PROMPTS["middle"], PROMPTS["absent"]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), adapters=[combo] * 2)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(6):
                ids = torch.cat([ids, model.eval()(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert out.token_ids == ids[0, len(prompt):].tolist(), (combo, prompt)
