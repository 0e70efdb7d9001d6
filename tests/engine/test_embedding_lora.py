"""Embedding and output-head LoRA (PEFT's lora_embedding_A/B, LoRA on lm_head) and whole per-adapter copies of
either (modules_to_save), in mixed batches: every row gives the prompt logprobs and greedy tokens of HF + PEFT
running that adapter alone (fp32), with base rows and plain adapters beside it."""

import pytest

from conftest import assert_prompt_logprobs_equal_peft, hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from conftest import save_distinct_adapter as save_adapter
from loramux import LoRAConfig, LoRAStatus, SamplingParams
from loramux.config import DEFAULT_TARGET_MODULES
from loramux.llm import LLM
from loramux.ops import lora_triton

TARGETS = (*DEFAULT_TARGET_MODULES, "embed_tokens", "lm_head")


@pytest.fixture(scope="module", params=[(False, "auto"), (True, "auto"), (False, "triton")],
                ids=["untied", "tied", "untied-triton"])
def setup(request, tmp_path_factory):
    """"triton": the LoRA op a GPU runs (here in Triton's interpreter), so the embedding's graph-safe form
    (through the op), not its per-slot one."""
    tied, backend = request.param
    if backend == "triton" and not lora_triton.available("cpu"):
        pytest.skip("needs triton (its interpreter runs here)")
    root = tmp_path_factory.mktemp("emb")
    base = tiny_llama(tie_word_embeddings=tied)
    adapters = {
        "emb_head": save_adapter(base, root / "a", 1, r=4, target_modules=["embed_tokens", "lm_head", "q_proj"]),
        "save_head": save_adapter(base, root / "b", 2, r=8, target_modules=["q_proj", "v_proj"],
                                  modules_to_save=["lm_head"]),
        "save_embed": save_adapter(base, root / "c", 3, r=6, target_modules=["o_proj"], modules_to_save=["embed_tokens"]),
        "plain": save_peft_adapter(base, root / "d", seed=4, r=8),
    }
    copies = 4 * 2 * base.config.vocab_size * base.config.hidden_size
    llm = LLM(model=save_checkpoint(base, root / "model"), dtype="float32", kv_cache_memory=2**23, max_model_len=64,
              lora=LoRAConfig(max_loras=4, max_lora_rank=8, target_modules=TARGETS, max_module_copies_bytes=copies),
              lora_backend=backend)
    embedding = llm.engine.adapters.slots._embeddings[0]
    assert (embedding.add_lora is not None) == (backend == "triton")
    for name, path in adapters.items():
        result = llm.load_adapter(name, path)
        assert result, result.message
    return base, adapters, llm


ROWS = ["emb_head", None, "save_head", "save_embed", "plain", "emb_head"]


def test_mixed_rows_give_peft_prompt_logprobs(setup):
    base, adapters, llm = setup
    prompts = [[5 + i, 17, 33 + 2 * i, 9, 64 - i, 3] for i in range(len(ROWS))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), adapters=ROWS)
    for prompt, row, out in zip(prompts, ROWS, outs):
        assert_prompt_logprobs_equal_peft(out, base, adapters.get(row), prompt)


def test_mixed_rows_give_peft_greedy_tokens(setup):
    base, adapters, llm = setup
    prompts = [[7, 8 + i, 9, 10 + 3 * i] for i in range(len(ROWS))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), adapters=ROWS)
    for prompt, row, out in zip(prompts, ROWS, outs):
        assert out.token_ids == hf_greedy(base, adapters.get(row), prompt, 8), row


def test_copies_are_held_to_their_byte_budget_and_need_the_module_wrapped(setup, tmp_path):
    base, adapters, _ = setup
    model = save_checkpoint(base, tmp_path / "model")
    one_copy = 4 * base.config.vocab_size * base.config.hidden_size
    llm = LLM(model=model, dtype="float32", kv_cache_memory=2**22, max_model_len=64,
              lora=LoRAConfig(max_loras=2, max_lora_rank=8, target_modules=TARGETS, max_module_copies_bytes=one_copy))
    assert llm.load_adapter("save_head", adapters["save_head"])
    over = llm.load_adapter("save_embed", adapters["save_embed"])
    assert over == LoRAStatus.LOAD_INVALID_ADAPTER and "over max_module_copies_bytes" in over.message
    assert llm.unload_adapter("save_head")
    assert llm.load_adapter("save_embed", adapters["save_embed"])  # the budget counts loaded adapters only
    off = LLM(model=model, dtype="float32", kv_cache_memory=2**22, max_model_len=64,
              lora=LoRAConfig(max_loras=2, max_lora_rank=8))
    refused = off.load_adapter("save_head", adapters["save_head"])
    assert refused == LoRAStatus.LOAD_INVALID_ADAPTER and "max_module_copies_bytes" in refused.message
    refused = off.load_adapter("emb_head", adapters["emb_head"])
    assert "does not target" not in refused.message and "embed_tokens" in refused.message


def test_adapters_with_new_tokens_are_refused_naming_both_sizes(setup, tmp_path):
    base, _, llm = setup
    bigger = tiny_llama(vocab_size=136, tie_word_embeddings=base.config.tie_word_embeddings)
    path = save_adapter(bigger, tmp_path / "big", 5, r=4, target_modules=["embed_tokens", "q_proj"])
    result = llm.load_adapter("big", path)
    assert result == LoRAStatus.LOAD_INVALID_ADAPTER
    assert "adds tokens" in result.message and "136" in result.message and "128" in result.message


def test_the_copies_budget_counts_adapters_evicted_to_disk_and_never_refuses_their_reload(setup, tmp_path):
    base, adapters, _ = setup
    one_copy = 4 * base.config.vocab_size * base.config.hidden_size
    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**22, max_model_len=64,
              lora=LoRAConfig(max_loras=1, max_cpu_loras=1, max_lora_rank=8, target_modules=TARGETS,
                              max_module_copies_bytes=one_copy + one_copy // 2))
    plain = save_adapter(base, tmp_path / "plain", 9, r=2, target_modules=["q_proj"])
    assert llm.load_adapter("save_head", adapters["save_head"])
    assert llm.load_adapter("plain", plain)  # save_head leaves host memory (max_cpu_loras=1)
    adapters_ = llm.engine.adapters
    assert not adapters_.cache.in_host(adapters_.identity_for("save_head"))
    over = llm.load_adapter("save_embed", adapters["save_embed"])  # still over: save_head's copy is still loaded
    assert over == LoRAStatus.LOAD_INVALID_ADAPTER and "over max_module_copies_bytes" in over.message
    prompt = [7, 8, 9, 10]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), adapters=["save_head"])
    assert out[0].token_ids == hf_greedy(base, adapters["save_head"], prompt, 4)  # its reload is not refused


@pytest.mark.parametrize("kwargs", [dict(r=2, target_modules=["v_proj"], modules_to_save=["lm_head"]),
                                    dict(r=4, target_modules=["embed_tokens", "lm_head"])], ids=["saved", "lora"])
def test_ensure_weight_tying_adapters_equal_peft(setup, tmp_path, kwargs):
    """PEFT's ensure_weight_tying (on a tied model, the head follows the embedding): it writes both tied copies,
    or the head's LoRA beside the embedding's, under names of its own (modules_to_save=["model.embed_tokens"])."""
    base, _, _ = setup
    path = save_adapter(base, tmp_path / "a", 11, ensure_weight_tying=True, **kwargs)
    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**22,
              max_model_len=64, lora=LoRAConfig(max_loras=1, max_lora_rank=8, target_modules=TARGETS,
                                                max_module_copies_bytes=4 * 2 * base.config.vocab_size * base.config.hidden_size))
    result = llm.load_adapter("tied", path)
    assert result, result.message
    prompt = [5, 17, 33, 9, 64, 3]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), adapters=["tied"])[0]
    assert_prompt_logprobs_equal_peft(out, base, path, prompt)


def test_bf16_lora_slots_keep_whole_copies_in_the_activations_dtype(setup, tmp_path):
    """lora_dtype="bfloat16" on an fp32 model with the head first-wrapped after a linear layer: the adapter's
    saved head stays fp32 (it once took the first layer's slot dtype, bf16, and the head's matmul raised)."""
    base, adapters, _ = setup
    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**23,
              max_model_len=64, lora=LoRAConfig(max_loras=2, max_lora_rank=8, target_modules=("q_proj", "v_proj", "lm_head"),
                                                max_module_copies_bytes=2 * 4 * base.config.vocab_size * base.config.hidden_size,
                                                lora_dtype="bfloat16"))
    assert llm.load_adapter("save_head", adapters["save_head"])
    out = llm.generate([[7, 8, 9, 10]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       adapters=["save_head"])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_adapters_given_at_start_get_their_embedding_and_head_wrapped(setup, tmp_path, caplog):
    """LLM(adapters=...) wraps what they have LoRA on beyond target_modules (here the 7 projections only), logs
    it, and serves them as PEFT does; an adapter loaded later that needs an unwrapped module is refused."""
    base, adapters, _ = setup
    model = save_checkpoint(base, tmp_path / "model")
    with caplog.at_level("INFO", logger="loramux.engine.engine_core"):
        llm = LLM(model=model, dtype="float32", kv_cache_memory=2**22, max_model_len=64,
                  lora=LoRAConfig(max_loras=2, max_lora_rank=8), adapters={"emb_head": adapters["emb_head"]})
    assert "wrapped embed_tokens, lm_head for the start-up adapters" in caplog.text and "MB of those" in caplog.text
    prompt = [7, 8, 9, 10]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), adapters="emb_head")
    assert out[0].token_ids == hf_greedy(base, adapters["emb_head"], prompt, 8)
    plain = LLM(model=model, dtype="float32", kv_cache_memory=2**22, max_model_len=64,
                lora=LoRAConfig(max_loras=2, max_lora_rank=8), adapters=[f"plain={adapters['plain']}"])
    refused = plain.load_adapter("emb_head", adapters["emb_head"])
    assert refused == LoRAStatus.LOAD_INVALID_ADAPTER and "embed_tokens" in refused.message
    with pytest.raises(ValueError, match="adapter 'x=/nowhere'"):
        LLM(model=model, dtype="float32", kv_cache_memory=2**22, max_model_len=64, adapters=["x=/nowhere"])
