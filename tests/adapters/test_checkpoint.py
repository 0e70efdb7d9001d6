"""Reading PEFT directories: every refusal names its cause."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import save_peft_adapter, tiny_llama
from loramux.adapters.checkpoint import (
    AdapterPathError,
    build_adapter,
    parse_adapter_arg,
    read_adapter_dir,
)
from loramux.adapters.peft_config import InvalidAdapterError

SHAPES = {f"model.layers.{i}.self_attn.{p}": (64, 64 if p in ("q_proj", "o_proj") else 32)
          for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}


@pytest.mark.parametrize(
    "arg, expected",
    [("pirate=/a/b", ("pirate", "/a/b")), ("/a/b", ("/a/b", "/a/b")), ("x=/a=b", ("x", "/a=b"))],
)
def test_parse_adapter_arg(arg, expected):
    assert parse_adapter_arg(arg) == expected


@pytest.mark.parametrize("arg", ["=/a", "name="])
def test_parse_adapter_arg_refuses_empty_parts(arg):
    with pytest.raises(ValueError, match="name=path"):
        parse_adapter_arg(arg)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return save_peft_adapter(tiny_llama(), tmp_path_factory.mktemp("qv"), r=8, target_modules=["q_proj", "v_proj"])


def copy_adapter(adapter, tmp_path):
    return shutil.copytree(adapter, tmp_path / "copy")


def edit_config(path, **changes):
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def test_reads_safetensors_and_folds_scaling(adapter):
    config, tensors = read_adapter_dir(adapter)
    weights = build_adapter("a", config, tensors, SHAPES, max_rank=64)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    module = weights.modules["model.layers.0.self_attn.q_proj"]
    assert torch.equal(module.b, tensors[key] * (16 / 8)) and module.rank == 8
    assert len(weights.modules) == 4


@pytest.mark.parametrize("path, words", [("/nonexistent/x", ["not a directory"]), ("{empty}", ["no adapter_config.json"])])
def test_bad_paths(tmp_path, path, words):
    with pytest.raises(AdapterPathError) as err:
        read_adapter_dir(path.format(empty=tmp_path))
    assert all(w in str(err.value) for w in words)


def test_missing_weights_and_bad_json(adapter, tmp_path):
    path = copy_adapter(adapter, tmp_path)
    os.remove(path / "adapter_model.safetensors")
    with pytest.raises(AdapterPathError, match="neither adapter_model.safetensors"):
        read_adapter_dir(str(path))
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidAdapterError, match="not valid JSON"):
        read_adapter_dir(str(path))


def test_pickle_is_refused_unless_allowed_and_then_weights_only(adapter, tmp_path):
    path = copy_adapter(adapter, tmp_path)
    tensors = load_file(path / "adapter_model.safetensors")
    os.remove(path / "adapter_model.safetensors")
    torch.save(tensors, path / "adapter_model.bin")
    with pytest.raises(InvalidAdapterError, match="refusing to unpickle"):
        read_adapter_dir(str(path))
    _, loaded = read_adapter_dir(str(path), allow_pickle=True)
    assert loaded.keys() == tensors.keys()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Evil()}, path / "adapter_model.bin", _use_new_zipfile_serialization=True)
    with pytest.raises(InvalidAdapterError, match="weights_only=True"):
        read_adapter_dir(str(path), allow_pickle=True)


def test_unreadable_safetensors(adapter, tmp_path):
    path = copy_adapter(adapter, tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(InvalidAdapterError, match="unreadable safetensors"):
        read_adapter_dir(str(path))


def build(adapter, shapes=SHAPES, max_rank=64, **config_changes):
    config, tensors = read_adapter_dir(adapter)
    return build_adapter("a", {**config, **config_changes}, tensors, shapes, max_rank=max_rank)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(max_rank=4), ["rank 8", "max_lora_rank=4"]),
        (dict(shapes={k: v for k, v in SHAPES.items() if "v_proj" not in k}), ["v_proj", "does not wrap"]),
        (dict(shapes={k: (64, 48) for k in SHAPES}), ["q_proj", "lora_B (64, 8)", "[48, r]"]),
        (dict(r=4), ["rank 8 in its weights but 4"]),
        (dict(use_dora=True, bias="lora_only"), ["DoRA", "bias='lora_only'"]),
        (dict(target_modules=["o_proj"]), ["no LoRA weights"]),
    ],
)
def test_invalid_adapters_name_the_cause(adapter, kwargs, words):
    with pytest.raises(InvalidAdapterError) as err:
        build(adapter, **kwargs)
    for word in words:
        assert word in str(err.value)


def test_embedding_lora_and_missing_pair_are_refused(adapter, tmp_path):
    path = copy_adapter(adapter, tmp_path)
    tensors = load_file(path / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(8, 128)
    save_file(tensors, path / "adapter_model.safetensors")
    with pytest.raises(InvalidAdapterError, match="lora_embedding_A"):
        build(str(path))
    del tensors["base_model.model.model.embed_tokens.lora_embedding_A"]
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, path / "adapter_model.safetensors")
    with pytest.raises(InvalidAdapterError, match="lora_A but not its pair"):
        build(str(path))
