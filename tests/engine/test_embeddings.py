"""Embeddings per adapter (SamplingParams.pooling, LLM.embed): each prompt's last-layer hidden states with its own
adapter, pooled (last token or mean) and normalized, equal to HF + PEFT's for that adapter alone (fp32), in a batch
that mixes adapters and generation; a prompt split into chunks and a prompt whose prefix is cached pool the same."""
import pytest
import torch
from peft import PeftModel

from conftest import hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from loramux import LoRAConfig, SamplingParams
from loramux.llm import LLM

PROMPTS = [[5, 9, 14, 3, 7], [7, 7, 21, 40, 2, 9, 11], list(range(3, 43))]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    base = tiny_llama()
    adapters = {f"a{i}": save_peft_adapter(base, root / f"a{i}", seed=30 + i, r=8) for i in range(2)}
    return base, save_checkpoint(base, root / "model"), adapters


def make_llm(model, adapters, **engine):
    llm = LLM(model=model, lora=LoRAConfig(max_loras=2, max_lora_rank=16), dtype="float32", kv_cache_memory=2**23,
              max_model_len=64, **engine)
    for name, path in adapters.items():
        assert llm.load_adapter(name, path)
    return llm


def peft_vector(base, path, prompt, pooling, normalize=True):
    """HF + PEFT: the model's last hidden state (after its final norm) for `prompt`, with the adapter alone."""
    model = PeftModel.from_pretrained(tiny_llama(), path).eval().base_model.model if path else base
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_each_row_of_a_mixed_batch_pools_as_peft_with_its_adapter_alone(setup, pooling):
    base, model, adapters = setup
    llm = make_llm(model, adapters, enable_chunked_prefill=True, max_num_batched_tokens=16)  # the long one: 3 chunks
    names = ["a0", None, "a1"]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    embed = SamplingParams(max_tokens=1, pooling=pooling)
    outs = llm.generate([*PROMPTS, PROMPTS[0]], [embed, embed, embed, greedy], adapters=[*names, "a1"])
    for out, prompt, name in zip(outs, PROMPTS, names):
        expected = peft_vector(base, adapters.get(name), prompt, pooling)
        assert out.finish_reason == "stop" and out.token_ids == [] and len(out.embedding) == 64
        torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=2e-5, rtol=0)
    assert outs[3].token_ids == hf_greedy(base, adapters["a1"], PROMPTS[0], 6)  # generation beside them


def test_unnormalized_vectors_and_a_cached_prefix(setup):
    base, model, adapters = setup
    llm = make_llm(model, adapters)
    for pooling in ("last", "mean"):
        raw = llm.embed([PROMPTS[2]], adapters="a0", pooling=pooling, normalize=False)[0].embedding
        torch.testing.assert_close(torch.tensor(raw), peft_vector(base, adapters["a0"], PROMPTS[2], pooling, False),
                                   atol=5e-5, rtol=1e-5)
        again = llm.embed([PROMPTS[2]], adapters="a0", pooling=pooling, normalize=False)[0]  # its prefix is cached
        assert again.embedding == raw and (again.num_cached_tokens > 0) == (pooling == "last")


def test_pooling_takes_no_logprobs_or_structured_outputs():
    for extra in ({"logprobs": 1}, {"prompt_logprobs": 1}):
        with pytest.raises(ValueError, match="pooling generates no token"):
            SamplingParams(max_tokens=1, pooling="last", **extra)
    with pytest.raises(ValueError, match="pooling must be one of"):
        SamplingParams(max_tokens=1, pooling="cls")
