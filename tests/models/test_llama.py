"""Our Llama-family model and loader against HF transformers on the same weights."""
import json
import os

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from conftest import TINY, save_checkpoint
from loramux.layers.attention import AttentionMetadata
from loramux.models.loader import build_model, load_model

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES = {
    "llama3-rope": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE)),
    "llama-tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
    "qwen2-bias": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3-qk-norm": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32)),
}


def prefill_logits(model, input_ids):
    """One prefill of equal-length rows through our flat-token forward."""
    rows, length = input_ids.shape
    n = rows * length
    meta = AttentionMetadata(True, torch.arange(n), pad_index=torch.arange(n).view(rows, length),
                             unpad_index=torch.arange(n))
    positions = torch.arange(length).repeat(rows)
    with torch.no_grad():
        return model.compute_logits(model(input_ids.reshape(-1), positions, meta)).view(rows, length, -1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_hf(family):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**TINY, **extra)).eval()
    ours = build_model(hf.config, hf.state_dict(), torch.float32, "cpu", 128)
    input_ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        expected = hf(input_ids).logits
    torch.testing.assert_close(prefill_logits(ours, input_ids), expected, atol=1e-5, rtol=1e-5)


def test_sharded_checkpoint_and_bf16(tmp_path):
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()
    path = save_checkpoint(hf, tmp_path / "m")
    hf.save_pretrained(path, max_shard_size="60KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    loaded = load_model(path, dtype="bfloat16")
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16
    input_ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        expected = hf(input_ids).logits
    assert (prefill_logits(loaded.model, input_ids).float() - expected).abs().max() < 0.1


def test_unsupported_architecture_is_named(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("path, words", [("/nonexistent", "neither a .gguf file"), ("/x/missing.gguf", "does not exist")])
def test_bad_model_paths(path, words):
    with pytest.raises(FileNotFoundError, match=words):
        load_model(path)


def test_auto_dtype_follows_the_checkpoint(tmp_path):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.bfloat16)
    path = save_checkpoint(hf, tmp_path / "m")
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    assert load_model(path).model.lm_head.weight.dtype == torch.bfloat16


def test_float16_runs_as_bfloat16_on_cpu(tmp_path, caplog):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.float16)  # many HF checkpoints are fp16
    path = save_checkpoint(hf, tmp_path / "m")
    for dtype in ("auto", "float16"):
        caplog.clear()
        with caplog.at_level("WARNING"):
            loaded = load_model(path, dtype=dtype, device="cpu")
        assert loaded.model.lm_head.weight.dtype == torch.bfloat16
        assert "float16 is not supported on CPU; running in bfloat16" in caplog.text
