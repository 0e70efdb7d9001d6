"""Property: whatever a safetensors header says, reading an adapter either gives checked weights or raises
one of the two adapter errors (naming the file) — never another exception, never a hang or a huge read."""
import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import save_peft_adapter, tiny_llama
from loramux.adapters.checkpoint import build_adapter
from loramux.adapters.files import AdapterPathError, read_adapter_dir
from loramux.adapters.peft_config import InvalidAdapterError

SHAPES = {f"model.layers.{i}.self_attn.{p}": (64, 64 if p in ("q_proj", "o_proj") else 32)
          for i in range(2) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
DTYPES = ["F32", "F16", "BF16", "F64", "I8", "I64", "BOOL", "U8", "F8_E4M3", "XYZ", "", 7, None]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = save_peft_adapter(tiny_llama(), tmp_path_factory.mktemp("good"), r=8,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    data = open(os.path.join(path, "adapter_model.safetensors"), "rb").read()
    length = int.from_bytes(data[:8], "little")
    return path, json.loads(data[8:8 + length]), data[8 + length:]


def _field_edit():
    value = st.one_of(st.sampled_from(DTYPES), st.integers(-2**64, 2**64), st.lists(st.integers(-5, 2**40), max_size=4),
                      st.text(max_size=8), st.none(), st.floats(allow_nan=True))
    return st.tuples(st.integers(0, 64), st.sampled_from(["dtype", "shape", "data_offsets", "extra"]), value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(_field_edit(), max_size=4), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                                                   max_size=3),
       cut=st.one_of(st.none(), st.integers(0, 10**6)), extra_key=st.booleans())
def test_mutated_headers_are_read_or_refused_cleanly(good, tmp_path, edits, flips, cut, extra_key):
    path, header, body = good
    header = json.loads(json.dumps(header))
    keys = [k for k in header if k != "__metadata__"]
    for index, field, value in edits:
        header[keys[index % len(keys)]][field] = value
    if extra_key:
        header["base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"] = header[keys[0]]
    raw = json.dumps(header).encode()
    data = bytearray(len(raw).to_bytes(8, "little") + raw + body)
    for position, byte in flips:
        data[position % len(data)] = byte
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    target = tmp_path / "mutant"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(path, target)
    (target / "adapter_model.safetensors").write_bytes(bytes(data))
    try:
        config, tensors = read_adapter_dir(str(target), max_weight_bytes=len(body) * 4 + (1 << 16))
        weights = build_adapter("m", config, tensors, SHAPES, max_rank=16)
    except (InvalidAdapterError, AdapterPathError) as e:
        assert str(e)
        return
    for module in weights.modules.values():  # what loads is exactly what the model can use
        assert module.a.dtype == module.b.dtype == torch.float32
        assert torch.isfinite(module.a).all() and torch.isfinite(module.b).all()
