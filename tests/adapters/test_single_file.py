"""TensorRT Edge-LLM's loadWeights(name, file) and getActiveWeight(binding): an adapter from one .safetensors
file (rank and targets from its tensors, lora_alpha from the caller or a sidecar config), against PEFT."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import peft_logits, save_peft_adapter, tiny_llama
from loramux import LoRAConfig, LoRAModel, LoRAStatus
from loramux.adapters.files import SAFETENSORS_FILE

ATOL = 2e-5


@pytest.fixture(scope="module")
def base():
    return tiny_llama()


def lone_file(adapter_dir, target) -> str:
    """The adapter's weights file alone, outside its directory (no adapter_config.json beside it)."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copy(os.path.join(adapter_dir, SAFETENSORS_FILE), target)
    return str(target)


def lora_model(base):
    import copy

    model = copy.deepcopy(base)
    return model, LoRAModel(model, LoRAConfig(max_loras=4, max_lora_rank=16))


def test_a_lone_file_with_the_callers_alpha_gives_peft_logits_with_ranks_from_its_shapes(base, tmp_path):
    """Ranks differ by module (PEFT's rank_pattern); the file says them all through its shapes."""
    adapter = save_peft_adapter(base, tmp_path / "peft", seed=3, r=16, lora_alpha=32,
                                rank_pattern={"v_proj": 4, "down_proj": 12})
    file = lone_file(adapter, tmp_path / "lone" / "weights.safetensors")
    model, lm = lora_model(base)
    assert lm.load_adapter("f", file, lora_alpha=32) == LoRAStatus.SUCCESS
    input_ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad(), lm.batch(["f", "f"]):
        ours = model(input_ids).logits
    torch.testing.assert_close(ours, peft_logits(base, adapter, input_ids), atol=ATOL, rtol=1e-4)
    assert lm.load_adapter("f", file, lora_alpha=32) == LoRAStatus.SUCCESS  # the same file and alpha again
    assert lm.load_adapter("f", file, lora_alpha=8) == LoRAStatus.LOAD_NAME_EXISTS  # other math: not the same


def test_a_sidecar_config_says_alpha_and_a_different_callers_alpha_is_refused(base, tmp_path):
    adapter = save_peft_adapter(base, tmp_path / "peft", seed=4, r=4, lora_alpha=8, use_rslora=True)
    file = lone_file(adapter, tmp_path / "lone" / "tuned.safetensors")
    shutil.copy(os.path.join(adapter, "adapter_config.json"), tmp_path / "lone" / "tuned.json")
    model, lm = lora_model(base)
    refused = lm.load_adapter("x", file, lora_alpha=16)
    assert refused == LoRAStatus.LOAD_INVALID_ADAPTER and "give one of them" in refused.message
    assert lm.load_adapter("f", file) == LoRAStatus.SUCCESS  # rsLoRA's scaling comes with the sidecar
    input_ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad(), lm.batch(["f"]):
        torch.testing.assert_close(model(input_ids).logits, peft_logits(base, adapter, input_ids), atol=ATOL, rtol=1e-4)


def test_what_a_lone_file_cannot_say_is_refused_with_the_reason(base, tmp_path):
    adapter = save_peft_adapter(base, tmp_path / "peft", seed=5, r=4, lora_alpha=8)
    file = lone_file(adapter, tmp_path / "lone" / "a.safetensors")
    _, lm = lora_model(base)
    no_alpha = lm.load_adapter("a", file)
    assert no_alpha == LoRAStatus.LOAD_INVALID_ADAPTER and "pass lora_alpha" in no_alpha.message
    assert "a.json" in no_alpha.message
    tensors = load_file(file)
    save_file({**tensors, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.weight":
               torch.ones(64)}, tmp_path / "lone" / "dora.safetensors")
    dora = lm.load_adapter("d", str(tmp_path / "lone" / "dora.safetensors"), lora_alpha=8)
    assert dora == LoRAStatus.LOAD_INVALID_ADAPTER and "only LoRA pairs" in dora.message
    save_file({"something.weight": torch.ones(2)}, tmp_path / "lone" / "none.safetensors")
    none = lm.load_adapter("n", str(tmp_path / "lone" / "none.safetensors"), lora_alpha=8)
    assert none == LoRAStatus.LOAD_INVALID_ADAPTER
    directory = lm.load_adapter("dir", adapter, lora_alpha=8)
    assert directory == LoRAStatus.LOAD_INVALID_ADAPTER and "lone .safetensors" in directory.message
    outside = lm.load_adapter("o", file, lora_alpha=8, allowed_dirs=[str(tmp_path / "peft")])
    assert outside == LoRAStatus.LOAD_INVALID_PATH and "outside the allowed" in outside.message
    os.symlink(os.path.join(adapter, "adapter_config.json"), tmp_path / "lone" / "linked.json")
    shutil.copy(file, tmp_path / "lone" / "linked.safetensors")
    linked = lm.load_adapter("l", str(tmp_path / "lone" / "linked.safetensors"), allowed_dirs=[str(tmp_path / "lone")])
    assert linked == LoRAStatus.LOAD_INVALID_PATH  # the sidecar is a file read too: inside the allowed directories
    assert lm.loras == []


def test_get_active_weight_is_the_selected_adapters_update_for_one_module(base, tmp_path):
    adapter = save_peft_adapter(base, tmp_path / "peft", seed=6, r=4, lora_alpha=16)
    _, lm = lora_model(base)
    assert lm.load_adapter("a", adapter)
    binding = "model.layers.0.self_attn.q_proj"
    assert lm.get_active_weight(binding) is None  # nothing selected
    lm.switch("a")
    weight = lm.get_active_weight(binding)
    tensors = load_file(os.path.join(adapter, SAFETENSORS_FILE))
    a = tensors[f"base_model.model.{binding}.lora_A.weight"]
    b = tensors[f"base_model.model.{binding}.lora_B.weight"]
    assert weight.a.shape == (4, a.shape[1]) and weight.b.shape == (b.shape[0], 4)
    torch.testing.assert_close(weight.b @ weight.a, (16 / 4) * b @ a)
    assert lm.get_active_weight("model.layers.0.self_attn.nowhere") is None
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert json.load(f)["r"] == 4
    lm.reset()
    assert lm.get_active_weight(binding) is None
