"""Tiny random models and PEFT adapters, built here: nothing is downloaded."""
from __future__ import annotations

import copy
import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`'s workers share the cores: one thread each (and the servers
    os.environ["OMP_NUM_THREADS"] = "1"  # they start), or two processes' OpenMP threads spin against each other
import torch

if not torch.cuda.is_available():  # Triton's kernels run on CPU tensors in its interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def tiny_llama(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()


def tiny_qwen2(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**{**TINY, **overrides})).eval()


MODEL_FACTORIES = {"llama": tiny_llama, "qwen2": tiny_qwen2}

# The longest modules (30 s to 2 min each on 2 cores), handed out first so that `make test`'s two workers finish
# together rather than one running the longest alone at the end. Only the order changes.
LONGEST_FIRST = ("server/test_supervision.py", "server/test_scaleout.py", "test_benchmark.py", "engine/test_llm.py",
                 "server/test_lm_eval.py", "engine/test_moe_lora.py", "models/test_quantized.py",
                 "examples/test_examples.py", "server/test_server.py", "server/test_remote_adapters.py")


def pytest_collection_modifyitems(items):
    here = os.path.dirname(__file__)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.relpath(str(item.path), here), len(rank)))


def backend_params(backends, cpu_available) -> list:
    """pytest params for every backend name on CPU tensors; "cpu" (the C++ kernels) is skipped where it cannot
    run, "triton" where triton is not installed (its interpreter runs the kernels here)."""
    from loramux.ops import lora_triton

    skips = {"cpu": pytest.mark.skipif(not cpu_available(), reason="needs the C++ CPU kernel (AVX-512 BF16)"),
             "triton": pytest.mark.skipif(not lora_triton.available("cpu"), reason="needs triton and TRITON_INTERPRET=1")}
    return [pytest.param(name, marks=skips.get(name, ())) for name in backends]


def save_distinct_adapter(base, path, seed, **kwargs) -> str:
    """A PEFT adapter whose embedding LoRA and saved modules differ clearly from the base (PEFT initialises
    them to no-ops)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, lora_alpha=8, **kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding" in name:
                p.normal_(0, 0.2)
            elif "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(str(path))
    return str(path)


def save_peft_adapter(base, path, seed: int = 0, **lora_kwargs) -> str:
    """Train-free PEFT adapter: random A and B (init_lora_weights=False), saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    kwargs = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"], init_lora_weights=False)
    kwargs.update(lora_kwargs)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**kwargs))
    with torch.no_grad():  # PEFT's random B is small; make the deltas clearly visible in logits
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(str(path))
    return str(path)


def peft_logits(base, adapter_dir, input_ids):
    """The oracle: HF transformers + PEFT running one adapter alone (None = the base model)."""
    from peft import PeftModel

    model = copy.deepcopy(base)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids).logits


def peft_logprobs(base, adapter_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: PEFT's log-softmax at every position of `ids`, that adapter alone."""
    return torch.log_softmax(peft_logits(base, adapter_dir, torch.tensor([ids]))[0].float(), -1)


def assert_prompt_logprobs_equal_peft(out, base, adapter_dir, prompt: list[int], msg=None) -> None:
    """An engine output's prompt logprobs (prompt_logprobs=0) against PEFT's for the same adapter alone."""
    expected = peft_logprobs(base, adapter_dir, prompt)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs.logprobs), expected, atol=1e-4, rtol=1e-4, msg=msg)


# Adapters that exercise every PEFT field that changes the math, with different ranks.
ADAPTER_KINDS = {
    "r4": dict(r=4, lora_alpha=8),
    "r8_rslora": dict(r=8, lora_alpha=16, use_rslora=True),
    "r16_patterns": dict(r=16, lora_alpha=32, rank_pattern={"v_proj": 4, "down_proj": 12},
                         alpha_pattern={"q_proj": 8, "up_proj": 64}),
    "r64_qv": dict(r=64, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
    "r8_regex_layer1": dict(r=8, lora_alpha=8, target_modules=r".*\.1\.mlp\.(gate|up)_proj"),
    "r8_layers": dict(r=8, lora_alpha=12, layers_to_transform=[0]),
}


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory):
    """{(model kind, adapter kind): directory} for every tiny model and adapter kind."""
    dirs = {}
    for model_kind, factory in MODEL_FACTORIES.items():
        base = factory()
        for i, (kind, kwargs) in enumerate(ADAPTER_KINDS.items()):
            path = tmp_path_factory.mktemp(f"{model_kind}-{kind}")
            dirs[model_kind, kind] = save_peft_adapter(base, path, seed=100 + i, **kwargs)
    return dirs


def char_tokenizer():
    """A character-level fast tokenizer (ids < 128), made here: nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    chars = [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_checkpoint(model, path) -> str:
    """An HF checkpoint directory (config.json + safetensors + tokenizer), as users have them."""
    model.config.eos_token_id = 2
    model.config.bos_token_id = 1
    model.save_pretrained(str(path))
    char_tokenizer().save_pretrained(str(path))
    return str(path)


def hf_greedy(base, adapter_dir, prompt_ids, max_new_tokens):
    """The oracle for generation: HF (+ PEFT) greedy decoding, one request alone, no KV-cache tricks."""
    from peft import PeftModel

    model = copy.deepcopy(base)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt_ids):].tolist()
