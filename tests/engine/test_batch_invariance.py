"""EngineConfig.batch_invariant: a request's greedy tokens are the same alone and in any batch, in bfloat16
too. Without it, the test prints how many of its request/batch pairs differ (CPU-dependent: 5 of 6 on a 2-core
AVX2 CPU; fp32 hides such differences, bf16 rounds them into different tokens). ~30 s."""
import pytest
import torch

from conftest import hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from loramux import LoRAConfig, SamplingParams
from loramux.llm import LLM


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("inv")
    base = tiny_llama(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    adapters = {f"a{i}": save_peft_adapter(base, root / f"a{i}", seed=i, r=8) for i in range(3)}
    return base, save_checkpoint(base, root / "model"), adapters


def make(path, adapters, dtype, **kw):
    llm = LLM(model=path, lora=LoRAConfig(max_loras=4, max_lora_rank=8), dtype=dtype, kv_cache_memory=2**25,
              max_model_len=256, **kw)
    for name, adapter in adapters.items():
        assert llm.load_adapter(name, adapter)
    return llm


def prompts(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(torch.randint(3, 40, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def differing_pairs(llm) -> list[tuple[int, int]]:
    """The (request, batch size) pairs whose greedy tokens in a batch differ from the request's alone."""
    params = SamplingParams(max_tokens=56, temperature=0, ignore_eos=True)
    inputs, names, differ = prompts(40), [None, "a0", "a1", "a2"], []
    for target in (1, 2):
        alone = llm.generate([inputs[target]], params, adapters=names[target], use_tqdm=False)[0].token_ids
        for size in (2, 13, 32):  # prefilled together with others, decoded in batches of every size
            batch = [inputs[target]] + inputs[4:4 + size - 1]
            mates = [names[target]] + [names[j % 4] for j in range(size - 1)]
            if llm.generate(batch, params, adapters=mates, use_tqdm=False)[0].token_ids != alone:
                differ.append((target, size))
    return differ


def test_bf16_tokens_do_not_depend_on_batch_mates(model):
    _, path, adapters = model
    without = differing_pairs(make(path, adapters, "bfloat16"))  # the figure the mode exists for (CPU-dependent)
    print(f"\nbf16 without batch_invariant: {len(without)} of 6 request/batch pairs differ from the request alone")
    assert differing_pairs(make(path, adapters, "bfloat16", batch_invariant=True)) == []


def test_fp32_batch_invariant_mode_still_equals_hf_peft(model):
    base, path, adapters = model
    llm = make(path, adapters, "float32", batch_invariant=True)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    inputs, rows = prompts(6, seed=3), ["a0", None, "a1", "a2", "a0", None]
    outs = llm.generate(inputs, params, adapters=rows, use_tqdm=False)
    for prompt, row, out in zip(inputs, rows, outs):
        assert out.token_ids == hf_greedy(base, adapters.get(row), prompt, 10)


def test_a_backend_that_is_not_batch_invariant_is_refused():
    from loramux.config import EngineConfig

    with pytest.raises(ValueError, match="not batch-invariant"):
        EngineConfig(batch_invariant=True, lora_backend="cpu")
    with pytest.raises(ValueError, match="not batch-invariant"):
        EngineConfig(batch_invariant=True, attention_backend="cpu")
