"""Speculative decoding (EngineConfig.speculative_config, n-gram): every row of a mixed batch gets, token for
token, what it gets without speculation (base rows and adapters of several ranks, a quantized base, chunked and
unchunked steps, prefix-cache hits, preemption, logprobs, stop tokens and strings, max_tokens); sampled rows keep
the model's distribution (a seeded statistical test against the exact probabilities); a rejected proposal's K/V
never reaches the prefix cache; and the proposer, the acceptance policy and the block bookkeeping alone."""
import copy
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import char_tokenizer, hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from engine.test_llm import record_preemptions
from models.test_quantized import dense_or_gguf
from loramux import LoRAConfig, SamplingParams
from loramux.config import EngineConfig, SpeculativeConfig
from loramux.engine.block_manager import BlockManager
from loramux.engine.detokenizer import Detokenizer
from loramux.engine.sequence import Sequence
from loramux.engine.speculative import MAX_PROBE_EVERY, PROBE_EVERY, Acceptance, NgramProposer, Speculator
from loramux.llm import LLM
from loramux.tokenizer import Tokenizer

SPEC = {"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, "disable_by_batch_size": 16}
ROWS = ["r4", None, "r8_rslora", "r16", None, "r4", "r16", "r8_rslora"]


def repetitive_prompts(n, seed=0, period=11, repeats=3):
    """Prompts that repeat a random phrase: the tiny models continue them in loops, where lookup proposes."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(3, 128, (period + i % 4,), generator=gen).tolist()
        out.append(phrase * repeats + phrase[:3])
    return out


@pytest.fixture(scope="module", params=["dense", "gguf"])
def setup(request, tmp_path_factory):
    """(reference HF model, model path, {adapter: dir})."""
    model, reference = dense_or_gguf(request.param, tmp_path_factory.mktemp(f"spec-{request.param}"))
    root = Path(model).parent
    adapters = {"r4": save_peft_adapter(reference, root / "r4", seed=1, r=4, lora_alpha=8),
                "r8_rslora": save_peft_adapter(reference, root / "r8", seed=2, r=8, lora_alpha=8, use_rslora=True),
                "r16": save_peft_adapter(reference, root / "r16", seed=3, r=16, lora_alpha=32)}
    return reference, model, adapters


def make(setup, spec=None, **kw):
    _, model, adapters = setup
    llm = LLM(model=model, dtype="float32", kv_cache_memory=kw.pop("kv_cache_memory", 2**23),
              max_model_len=kw.pop("max_model_len", 128), lora=kw.pop("lora", LoRAConfig(max_loras=4, max_lora_rank=16)),
              speculative_config=spec, **kw)
    for name, path in adapters.items():
        assert llm.load_adapter(name, path)
    return llm


def spec_stats(llm):
    return llm.engine.core.speculator.stats


def assert_same(plain, spec, logprobs=False, tolerance=1e-4):
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.text == b.text
        if logprobs:
            assert a.logprobs.token_ids == b.logprobs.token_ids and a.logprobs.top_ids == b.logprobs.top_ids
            torch.testing.assert_close(torch.tensor(a.logprobs.logprobs), torch.tensor(b.logprobs.logprobs),
                                       atol=tolerance, rtol=tolerance)


def assert_speculated(llm):
    """Proposals were made, some kept and some rejected (so the rollback ran)."""
    stats = spec_stats(llm)
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens, stats


@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_rows_of_a_mixed_batch_equal_decoding_without_speculation(setup, chunked):
    prompts = repetitive_prompts(len(ROWS))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    plain = make(setup, enable_chunked_prefill=chunked).generate(prompts, params, adapters=ROWS)
    llm = make(setup, SPEC, enable_chunked_prefill=chunked)
    # a quantized base's few-row steps and its larger verification steps take different kernel paths (weights
    # decoded in registers, or panels decoded for torch's GEMM): different sums, logprobs within ~1e-3
    tolerance = 1e-4 if setup[0].config.hidden_size == 64 else 5e-3
    assert_same(plain, llm.generate(prompts, params, adapters=ROWS), logprobs=True, tolerance=tolerance)
    assert_speculated(llm)
    assert set(spec_stats(llm).by_adapter) == {None, "r4", "r8_rslora", "r16"}


def test_greedy_rows_equal_hf_peft_alone(setup):
    reference, _, adapters = setup
    prompts = repetitive_prompts(4, seed=3)
    names = ["r16", None, "r4", "r8_rslora"]
    llm = make(setup, SPEC)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), adapters=names)
    for prompt, name, out in zip(prompts, names, outs):
        assert out.token_ids == hf_greedy(reference, adapters.get(name), prompt, 16), name
    assert_speculated(llm)


def test_prefix_cache_hits_and_continuations_equal_decoding_without_speculation(setup):
    """The second pass reads blocks the first wrote while speculating; a continuation (prompt + answer, a chat's
    next turn) reads the blocks of its answer. A rejected proposal's K/V in any cached block would change them."""
    prompts = repetitive_prompts(6, seed=5)
    names = ROWS[:6]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm = make(setup, SPEC)
    first = llm.generate(prompts, params, adapters=names)
    assert_speculated(llm)
    turns = [p + o.token_ids + p[:5] for p, o in zip(prompts, first)]
    second, then = llm.generate(prompts, params, adapters=names), llm.generate(turns, params, adapters=names)
    assert all(o.num_cached_tokens >= 32 for o in second + then)
    fresh = make(setup, enable_prefix_caching=False)
    assert_same(fresh.generate(prompts, params, adapters=names), second)
    assert_same(fresh.generate(turns, params, adapters=names), then)


def test_preemption_equals_decoding_without_speculation(setup):
    prompts = repetitive_prompts(6, seed=7)
    names = ROWS[:6]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    small = dict(kv_cache_memory=12 * 2 * 2 * 16 * 2 * 16 * 4, max_model_len=128)  # 12 blocks (dense shape)
    if setup[0].config.hidden_size != 64:
        pytest.skip("the KV budget is sized for the dense model")
    plain = make(setup, **small).generate(prompts, params, adapters=names)
    llm = make(setup, SPEC, **small)
    preempted = record_preemptions(llm.engine.core.scheduler)
    assert_same(plain, llm.generate(prompts, params, adapters=names))
    assert preempted and llm.engine.core.block_manager.num_free_blocks == llm.engine.core.block_manager.num_blocks
    assert_speculated(llm)


def test_stop_tokens_stop_strings_and_max_tokens_behave_as_without_speculation(setup):
    prompts = repetitive_prompts(8, seed=9)
    plain_llm, llm = make(setup), make(setup, SPEC)
    free = plain_llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), adapters=ROWS)
    cases = []
    for prompt, name, out in zip(prompts, ROWS, free):
        ids, text = out.token_ids, out.text
        cases.append((prompt, name, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[ids[7]])))
        if len(text) >= 6:  # (ids past the character tokenizer's decode to nothing)
            middle = len(text) // 2
            cases.append((prompt, name, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                       stop=[text[middle:middle + 2]], logprobs=1)))
        cases.append((prompt, name, SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)))
    plain = [plain_llm.generate([p], sp, adapters=[n])[0] for p, n, sp in cases]
    spec = llm.generate([p for p, _, _ in cases], [sp for _, _, sp in cases], adapters=[n for _, n, _ in cases])
    assert_same(plain, spec)
    assert sum(sp.stop != () for _, _, sp in cases) >= 3
    for a, b in zip(plain, spec):
        assert (a.logprobs is None) == (b.logprobs is None)
        assert b.logprobs is None or len(b.logprobs) == len(b.token_ids)
    assert_speculated(llm)


def test_structured_rows_do_not_propose_and_keep_their_output(setup):
    from loramux.sampling_params import StructuredOutputsParams

    prompts = repetitive_prompts(3, seed=11)
    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-f]{3,9}"))
    plain = make(setup).generate(prompts, params, adapters=["r4", None, "r16"])
    llm = make(setup, SPEC)
    assert_same(plain, llm.generate(prompts, params, adapters=["r4", None, "r16"]))
    assert spec_stats(llm).num_drafts == 0


def test_seeded_sampled_requests_are_reproducible_with_speculation(setup):
    prompts = repetitive_prompts(4, seed=13)
    seeded = SamplingParams(max_tokens=30, temperature=0.3, seed=1234, ignore_eos=True)
    llm = make(setup, {**SPEC, "prompt_lookup_min": 1})
    alone = llm.generate(prompts[:1], seeded, adapters=["r4"])[0]
    crowd = llm.generate(prompts, [seeded] + [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)] * 3,
                         adapters=["r4", None, "r16", "r4"])[0]
    assert alone.token_ids == crowd.token_ids
    assert spec_stats(llm).num_drafts > 0


def test_sampled_tokens_keep_the_model_distribution(setup, monkeypatch):
    """Every decoding row proposes the model's most likely next token twice in a row; the tokens kept at output
    positions 1 and 2 must follow the model's own distribution given the tokens before them. Chi-square over the
    likely tokens (and the rest pooled) against the exact probabilities, at p < 1e-6; the engine's generator is
    seeded, so the outcome is fixed. Tokens are drawn at temperature 0.02 (the tiny model is near uniform) so that the
    proposals are often right and often wrong."""
    reference, _, _ = setup
    if reference.config.hidden_size != 64:
        pytest.skip("one model is enough for the statistics")
    temperature, n = 0.02, 1500
    prompt = repetitive_prompts(1, seed=17)[0]
    cache = {}

    def probs(tokens):  # the exact next-token distribution of the base model after `tokens`
        key = tuple(tokens)
        if key not in cache:
            with torch.no_grad():
                logits = reference(torch.tensor([list(tokens)])).logits[0, -1].double()
            cache[key] = torch.softmax(logits / temperature, -1)
        return cache[key]

    llm = make(setup, {**SPEC, "disable_by_batch_size": 64}, max_num_seqs=64)
    speculator = llm.engine.core.speculator

    def propose(seqs, ks):  # the greedy next token, then the greedy one after it
        drafts = []
        for seq, k in zip(seqs, ks):
            first = int(probs(seq.token_ids).argmax())
            drafts.append([first, int(probs(seq.token_ids + [first]).argmax())][:k])
        return drafts

    monkeypatch.setattr(speculator, "plan", lambda seqs, limits: list(limits))  # as many as max_tokens leaves
    monkeypatch.setattr(speculator, "propose", propose)
    outs = llm.generate([prompt] * n, SamplingParams(max_tokens=4, temperature=temperature))
    stats = speculator.stats
    assert stats.num_accepted_tokens > n / 4 and stats.num_draft_tokens - stats.num_accepted_tokens > n / 4, stats
    for position in (1, 2):
        observed, expected = Counter(), torch.zeros(128, dtype=torch.float64)
        for out in outs:
            if len(out.token_ids) > position:
                observed[out.token_ids[position]] += 1
                expected += probs(prompt + out.token_ids[:position])
        assert chi_square_p(observed, expected) > 1e-6, position


def chi_square_p(observed: Counter, expected: torch.Tensor) -> float:
    """The chi-square test's p-value (Wilson-Hilferty's normal approximation), categories expected >= 5 times
    each and the rest pooled into one."""
    big = [t for t in range(len(expected)) if expected[t] >= 5]
    rest_obs = sum(c for t, c in observed.items() if t not in big)
    rest_exp = float(expected.sum()) - sum(float(expected[t]) for t in big)
    cells = [(observed[t], float(expected[t])) for t in big] + ([(rest_obs, rest_exp)] if rest_exp >= 5 else [])
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


# ---- the pieces alone ----------------------------------------------------------------------------------------
def test_ngram_proposer_takes_the_latest_longest_match():
    proposer = NgramProposer(2, 3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # the latest earlier occurrence
    assert proposer.propose([5, 6, 7, 8, 6, 7, 4, 5, 6, 7], 3) == [8, 6, 7]  # the longest n first: (5, 6, 7)
    assert proposer.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert proposer.propose([1, 2, 1, 2], 5) == [1, 2]  # as much as follows
    # byte patterns that only match across token boundaries are no match
    assert proposer.propose([256, 1, 0, 1], 2) == []
    assert NgramProposer(1, 1).propose([3, 8, 3], 2) == [8, 3]
    assert proposer.propose([1, 2, 1, 2], 0) == []


def test_acceptance_proposes_fewer_tokens_as_they_are_rejected_and_probes_when_none_pay():
    state = Acceptance()
    assert state.worth(0.25, 5) >= 3
    for _ in range(6):
        state.update(proposed=3, accepted=0)
    assert state.worth(0.25, 5) == 0 and state.patience == MAX_PROBE_EVERY  # every failure doubled the wait
    for _ in range(10):
        state.update(proposed=5, accepted=5)
    assert state.worth(0.25, 5) == 5 and state.patience == PROBE_EVERY

    hopeless = Acceptance(accepted=0.1, rejected=5.0)
    probes = [hopeless.worth(0.25, 5) for _ in range(2 * PROBE_EVERY)]
    assert probes.count(1) == 2 and set(probes) == {0, 1}  # one token every PROBE_EVERY steps
    hopeless.update(proposed=1, accepted=0)  # a failed probe: the next comes after twice as long
    waits = [hopeless.worth(0.25, 5) for _ in range(2 * PROBE_EVERY)]
    assert waits.index(1) == 2 * PROBE_EVERY - 1


def test_speculator_is_off_past_its_batch_size_and_for_structured_rows():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, disable_by_batch_size=2))
    seqs = [Sequence([1, 2, 1, 2, 1], SamplingParams(max_tokens=9)) for _ in range(3)]
    assert speculator.drafts(seqs, [9] * 3) == [[], [], []]
    assert speculator.drafts(seqs[:2], [9, 1]) == [[2, 1], [2]]  # limited by what each may still produce
    seqs[0].grammar = object()
    assert speculator.drafts(seqs[:2], [9, 9]) == [[], [2, 1]]


def test_blocks_for_proposals_are_added_and_trimmed():
    bm = BlockManager(8, 4)
    seq = Sequence(list(range(6)), SamplingParams(max_tokens=20))
    bm.allocate(seq)
    assert len(seq.block_table) == 2 and bm.can_append(seq, 6)
    bm.may_append(seq, 6)  # positions up to 11: three blocks
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert not bm.can_append(seq, 30)
    seq.token_ids += [7, 8]  # two tokens kept: positions up to 7 need two blocks
    bm.trim(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.deallocate(seq)
    assert bm.num_free_blocks == 8


def test_a_stop_string_inside_several_new_tokens_leaves_the_tokens_after_it_unused():
    tokenizer = Tokenizer.from_pretrained(char_tokenizer())
    detokenizer = Detokenizer(tokenizer, stop=("XY",))
    ids = tokenizer.encode("abcXYdef", add_special_tokens=False)
    assert detokenizer.update(ids, final=False) == ("abc", True)
    assert detokenizer.unused == 3 and detokenizer.num_tokens == 5


def test_speculative_config_is_parsed_and_checked():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=4,
                                                          prompt_lookup_min=4)
    assert SpeculativeConfig().prompt_lookup_min == SpeculativeConfig().prompt_lookup_max == 5  # vLLM's defaults
    for bad, message in (({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                         ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                         ({"draft_tensor_parallel_size": 1}, "unknown key"), ("{", "JSON")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=bad)
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(speculative_config={}, batch_invariant=True)
    assert copy.copy(config).speculative_config is config.speculative_config


# ---- a draft model ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """Two draft models for the dense tiny model: itself (every greedy proposal right) and another tiny model of
    its vocabulary (most proposals wrong)."""
    root = tmp_path_factory.mktemp("drafts")
    return {"same": None, "other": save_checkpoint(tiny_llama(seed=5, num_hidden_layers=1), root / "other")}


@pytest.mark.parametrize("draft", ["same", "other"])
def test_a_draft_models_proposals_keep_every_row_as_without_speculation(setup, drafts, draft):
    if setup[0].config.hidden_size != 64:
        pytest.skip("the drafts are made for the dense model")
    prompts = repetitive_prompts(len(ROWS), seed=19)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1)
    plain = make(setup).generate(prompts, params, adapters=ROWS)
    spec = {"model": drafts[draft] or setup[1], "num_speculative_tokens": 3, "disable_by_batch_size": 16}
    llm = make(setup, spec)
    assert llm.engine.core.config.speculative_config.method == "draft_model"
    assert_same(plain, llm.generate(prompts, params, adapters=ROWS), logprobs=True)
    proposed, accepted = spec_stats(llm).by_adapter[None]  # the base rows
    # the model drafting for itself is right every time (its K/V kept in step with each row's kept tokens); the
    # adapters' rows differ from it, and so does the other draft
    assert proposed > 10 and (accepted == proposed if draft == "same" else accepted < proposed)


def test_a_draft_model_must_share_the_vocabulary(setup, tmp_path):
    if setup[0].config.hidden_size != 64:
        pytest.skip("one model is enough")
    other = save_checkpoint(tiny_llama(vocab_size=96), tmp_path / "small-vocab")
    with pytest.raises(ValueError, match="vocabulary of 96 tokens"):
        make(setup, {"model": other})
