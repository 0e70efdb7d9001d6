"""DoRA (PEFT's use_dora) in mixed batches: each DoRA row gives the prompt logprobs and greedy tokens of HF + PEFT
running that adapter alone (fp32), beside plain LoRA rows and base rows, on a model with biases (Qwen2's q/k/v)
and one without; rsLoRA and rank patterns with DoRA; packed layers (q|k|v, gate|up) with DoRA on some slices.
What cannot run is refused at load, naming it."""
import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_prompt_logprobs_equal_peft, hf_greedy, save_checkpoint, save_peft_adapter, tiny_llama
from conftest import tiny_qwen2
from loramux import LoRAConfig, SamplingParams
from loramux.config import DEFAULT_TARGET_MODULES
from loramux.llm import LLM


def save_dora_adapter(base, path, seed: int, **kwargs) -> str:
    """A PEFT DoRA adapter with random A, B and magnitudes (PEFT starts the magnitude at the weight norm, which
    would make its scale 1 and hide a wrong norm)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    options = dict(r=8, lora_alpha=16, use_dora=True, init_lora_weights=False,
                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(copy.deepcopy(base), LoraConfig(**{**options, **kwargs}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
            elif "lora_magnitude_vector" in name:
                p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
    model.save_pretrained(str(path))
    return str(path)


KINDS = {
    "dora": dict(r=8, lora_alpha=16),
    "dora_rslora_patterns": dict(r=8, lora_alpha=16, use_rslora=True, rank_pattern={"v_proj": 4},
                                 alpha_pattern={"o_proj": 32}),
    "dora_q_gate": dict(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj"]),  # one slice of each packed layer
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"dora-{request.param}")
    base = tiny_llama() if request.param == "llama" else tiny_qwen2()
    adapters = {name: save_dora_adapter(base, root / name, seed, **kw) for seed, (name, kw) in enumerate(KINDS.items())}
    adapters["plain"] = save_peft_adapter(base, root / "plain", seed=7, r=8)
    llm = LLM(model=save_checkpoint(base, root / "model"), dtype="float32", kv_cache_memory=2**23, max_model_len=64,
              lora=LoRAConfig(max_loras=4, max_lora_rank=8))
    for name, path in adapters.items():
        result = llm.load_adapter(name, path)
        assert result, result.message
    return base, adapters, llm


ROWS = ["dora", None, "plain", "dora_rslora_patterns", "dora_q_gate", "dora"]


def test_dora_rows_give_peft_prompt_logprobs_beside_lora_and_base_rows(setup):
    base, adapters, llm = setup
    prompts = [[5 + i, 17, 33 + 2 * i, 9, 64 - i, 3] for i in range(len(ROWS))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), adapters=ROWS)
    for prompt, row, out in zip(prompts, ROWS, outs):
        assert_prompt_logprobs_equal_peft(out, base, adapters.get(row), prompt, msg=str(row))


def test_dora_rows_give_peft_greedy_tokens(setup):
    base, adapters, llm = setup
    prompts = [[7, 8 + i, 9, 10 + 3 * i] for i in range(len(ROWS))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), adapters=ROWS)
    for prompt, row, out in zip(prompts, ROWS, outs):
        assert out.token_ids == hf_greedy(base, adapters.get(row), prompt, 8), row


def test_a_slot_reused_by_plain_lora_after_dora_runs_without_the_scale(setup, tmp_path):
    """A slot that held a DoRA adapter and then a plain one scales nothing (its row goes back to ones)."""
    base, adapters, _ = setup
    llm = LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**22,
              max_model_len=64, lora=LoRAConfig(max_loras=1, max_lora_rank=8))
    for name in ("dora", "plain"):
        assert llm.load_adapter(name, adapters[name])
    prompt = [3, 4, 5, 6]
    slots = llm.engine.core.runner.slots
    for row in ("dora", "plain", "dora", None):  # one slot: each run evicts the other's adapter
        out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), adapters=[row])[0]
        assert out.token_ids == hf_greedy(base, adapters.get(row), prompt, 4), row
        # while a DoRA adapter is in a slot a GPU decodes eagerly (its rows' scales are not in the graphs); a base
        # request leaves the slot's adapter (the second DoRA) where it is
        assert slots.needs_eager == {"dora": True, "plain": False, None: True}[row]


def _rewrite(src, dst, edit_tensors=None, edit_config=None) -> str:
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = json.load(f)
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


def _first_magnitude(tensors):
    return next(k for k in tensors if k.endswith("lora_magnitude_vector"))


def test_what_dora_cannot_run_is_refused_naming_it(setup, tmp_path):
    base, adapters, llm = setup
    src = adapters["dora_q_gate"]

    def nan(t):
        t[_first_magnitude(t)][0] = float("nan")

    def short(t):
        key = _first_magnitude(t)
        t[key] = t[key][:-1].clone()

    def missing(t):
        del t[_first_magnitude(t)]

    def no_dora(c):
        c["use_dora"] = False

    cases = {"nan": (nan, None, "NaN"), "short": (short, None, "lora_magnitude_vector of shape"),
             "missing": (missing, None, "the file has none"), "no_use_dora": (None, no_dora, "does not set use_dora")}
    for case, (tensors, config, words) in cases.items():
        result = llm.load_adapter(f"bad_{case}", _rewrite(src, tmp_path / case, tensors, config))
        assert not result and words in result.message, (case, result.message)
    embedding = save_dora_adapter(base, tmp_path / "emb", 9, target_modules=["q_proj", "embed_tokens"])
    llm_emb = LLM(model=save_checkpoint(base, tmp_path / "model"), dtype="float32", kv_cache_memory=2**22,
                  max_model_len=64, lora=LoRAConfig(max_loras=1, max_lora_rank=8,
                                                    target_modules=(*DEFAULT_TARGET_MODULES, "embed_tokens")))
    result = llm_emb.load_adapter("emb", embedding)
    assert not result and "DoRA on model.embed_tokens is not supported" in result.message


@pytest.fixture(scope="module")
def gguf_setup(tmp_path_factory):
    """A Q4_K_M-style GGUF kept quantized, the same weights dequantized by transformers' GGUF loader (the oracle's
    base), and DoRA adapters made on that base."""
    from models.test_quantized import q4_k_m_llama

    root = tmp_path_factory.mktemp("dora-gguf")
    path, reference = q4_k_m_llama(root)
    adapters = {"dora": save_dora_adapter(reference, root / "dora", 1),
                "dora_rslora": save_dora_adapter(reference, root / "dora_rslora", 2, r=4, lora_alpha=8, use_rslora=True),
                "plain": save_peft_adapter(reference, root / "plain", seed=3, r=8)}
    llm = LLM(model=path, lora=LoRAConfig(max_loras=3, max_lora_rank=8), dtype="float32", kv_cache_memory=2**24,
              max_model_len=64)
    for name, adapter in adapters.items():
        result = llm.load_adapter(name, adapter)
        assert result, result.message
    return reference, adapters, llm


def test_dora_on_a_kept_quantized_base_gives_peft_tokens_on_its_dequantized_weights(gguf_setup):
    """The norms are taken against the weights the engine runs (the GGUF's, as its kernels decode them): mixed
    rows, and each adapter alone one request at a time (batch-1 decode: the quantized matmul and LoRA as one op
    where the C++ kernels run), give HF + PEFT's greedy tokens on the dequantized weights."""
    from loramux.layers.quantized import QuantizedLinear

    reference, adapters, llm = gguf_setup
    assert isinstance(llm.engine.core.runner.model.model.layers[0].self_attn.o_proj.base, QuantizedLinear)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    rows = ["dora", None, "plain", "dora_rslora", "dora"]
    prompts = [[5 + i, 6, 7, 8 + 2 * i] for i in range(len(rows))]
    for prompt, row, out in zip(prompts, rows, llm.generate(prompts, params, adapters=rows)):
        assert out.token_ids == hf_greedy(reference, adapters.get(row), prompt, 8), row
    for name in ("dora", "dora_rslora"):
        alone = llm.generate([[9, 10, 11]], params, adapters=[name])[0].token_ids
        assert alone == hf_greedy(reference, adapters[name], [9, 10, 11], 8), name


def test_a_dora_adapter_pushed_from_memory_runs_as_its_files(setup):
    """A trainer's push (PEFT tensors and config from memory, as /v1/load_lora_adapter's uploads and the RL path
    take them) of a DoRA adapter: the same tokens as the one loaded from its files."""
    base, adapters, llm = setup
    with open(os.path.join(adapters["dora"], "adapter_config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(adapters["dora"], "adapter_model.safetensors"))
    assert llm.load_adapter_from_tensors("dora_pushed", tensors, config)
    try:
        prompts = [[3, 4, 5, 6], [9, 8, 7]]
        pushed = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                              adapters="dora_pushed")
        read = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), adapters="dora")
        assert [o.token_ids for o in pushed] == [o.token_ids for o in read]
    finally:
        llm.unload_adapter("dora_pushed")
