"""Logprobs and prompt logprobs against HF transformers + PEFT: every row of a mixed batch gets the
log-softmax of the logits its own adapter produces alone, before sampling changes them."""
import pytest
import torch

from conftest import peft_logprobs as oracle
from loramux.sampling_params import MAX_LOGPROBS, SamplingParams
from test_llm import checkpoints, make_llm, prompts, record_preemptions  # noqa: F401  (the module fixture)

ROWS = ["r4", None, "r8_rslora", "r64_qv", "r4", None]


def test_generated_token_logprobs_equal_peft_for_every_row_of_a_mixed_batch(checkpoints):  # noqa: F811
    base, path, adapters = checkpoints["llama"]
    llm = make_llm(path, adapters)
    batch = prompts(len(ROWS), seed=3)
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]  # rows that do not ask get none
    outs = llm.generate(batch, [params[i % 2] for i in range(len(ROWS))], adapters=ROWS)
    for i, (prompt, adapter, out) in enumerate(zip(batch, ROWS, outs)):
        if i % 2:
            assert out.logprobs is None
            continue
        expected = oracle(base, adapters.get(adapter), prompt + out.token_ids)[len(prompt) - 1:-1]
        lp = out.logprobs
        assert lp.token_ids == out.token_ids and len(lp) == 6
        chosen = expected.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(lp.logprobs), chosen, atol=1e-4, rtol=1e-4)
        assert lp.ranks == [1] * 6  # greedy: the chosen token is the most likely
        top = expected.topk(3, -1)
        assert lp.top_ids == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), top.values, atol=1e-4, rtol=1e-4)


def test_logprobs_are_raw_before_penalties_and_temperature(checkpoints):  # noqa: F811
    base, path, adapters = checkpoints["llama"]
    llm = make_llm(path, adapters)
    prompt = prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=5, temperature=1.7, top_k=4, seed=3, presence_penalty=2.0, ignore_eos=True,
                            logprobs=0)
    out = llm.generate(prompt, params, adapters="r8_rslora")[0]
    expected = oracle(base, adapters["r8_rslora"], prompt + out.token_ids)[len(prompt) - 1:-1]
    chosen = expected.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(out.logprobs.logprobs), chosen, atol=1e-4, rtol=1e-4)
    ranks = (expected > chosen[:, None]).sum(-1) + 1
    assert out.logprobs.ranks == ranks.tolist() and out.logprobs.top_ids == [[]] * 5


def test_prompt_logprobs_equal_peft(checkpoints):  # noqa: F811
    base, path, adapters = checkpoints["llama"]
    llm = make_llm(path, adapters)
    batch = prompts(4, seed=7)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(batch, params, adapters=["r4", None, "r64_qv", "r4"])
    for prompt, adapter, out in zip(batch, ["r4", None, "r64_qv", "r4"], outs):
        expected = oracle(base, adapters.get(adapter), prompt)[:-1]  # position i predicts prompt token i+1
        lp = out.prompt_logprobs
        assert lp.token_ids == prompt[1:] and out.logprobs is None
        chosen = expected.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(lp.logprobs), chosen, atol=1e-4, rtol=1e-4)
        assert lp.ranks == ((expected > chosen[:, None]).sum(-1) + 1).tolist()
        assert lp.top_ids == expected.topk(2, -1).indices.tolist()


def test_prompt_and_token_logprobs_survive_preemption_and_prompt_logprobs_are_sent_once(checkpoints):  # noqa: F811
    """A preempted request is prefilled again (prompt + its tokens so far): its prompt is not scored again,
    and its token logprobs go on where they were."""
    from loramux import LoRAConfig

    base, path, adapters = checkpoints["llama"]
    llm = make_llm(path, adapters, lora=LoRAConfig(max_loras=2, max_cpu_loras=4, max_lora_rank=64),
                   kv_cache_memory=6 * 2 * 2 * 16 * 2 * 16 * 4, max_model_len=64, block_size=16)
    rows = ["r4", "r8_rslora", None, "r64_qv", None, "r4"]
    batch = prompts(len(rows), seed=5)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    core, sent = llm.engine.core, {}
    for i, (prompt, adapter) in enumerate(zip(batch, rows)):
        core.add_request(str(i), prompt, params, adapter)
    preempted = record_preemptions(core.scheduler)
    tokens, logprobs = {str(i): [] for i in range(len(rows))}, {str(i): [] for i in range(len(rows))}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.logprobs.logprobs
            if out.prompt_logprobs is not None:
                sent[out.request_id] = sent.get(out.request_id, 0) + 1
    assert preempted, "the tiny KV cache should have forced a preemption"
    assert sent == {str(i): 1 for i in range(len(rows))}
    for i, (prompt, adapter) in enumerate(zip(batch, rows)):
        expected = oracle(base, adapters.get(adapter), prompt + tokens[str(i)])[len(prompt) - 1:-1]
        chosen = expected.gather(1, torch.tensor(tokens[str(i)])[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(logprobs[str(i)]), chosen, atol=1e-4, rtol=1e-4)


def test_a_one_token_prompt_has_no_prompt_logprobs(checkpoints):  # noqa: F811
    _, path, adapters = checkpoints["llama"]
    out = make_llm(path).generate([[5]], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert len(out.prompt_logprobs) == 0


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, True, "2"])
def test_out_of_range_logprob_counts_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
